"""shared.backoff: the delays every retry loop waits, their caps and when a loop gives up."""

from __future__ import annotations

import itertools

import pytest

from turnbus.shared.backoff import Backoff

pytestmark = pytest.mark.timeout(10)


def test_delays_double_from_the_base_up_to_the_cap() -> None:
    backoff = Backoff(0.05, 0.5)
    assert list(itertools.islice(backoff, 6)) == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.5, 0.5])
    assert backoff.tries == 6


def test_a_try_that_worked_starts_again_from_the_base() -> None:
    backoff = Backoff(0.1, 1.0)
    next(backoff), next(backoff), next(backoff)
    backoff.reset()
    assert next(backoff) == pytest.approx(0.1)


def test_a_loop_that_never_gives_up_stays_at_the_cap_however_long_it_fails() -> None:
    backoff = Backoff(0.05, 2.0)
    for _ in range(5000):
        delay = next(backoff)
    assert delay == 2.0


def test_jitter_cuts_each_delay_by_at_most_its_share() -> None:
    backoff = Backoff(1.0, 1.0, jitter=0.5)
    delays = [next(backoff) for _ in range(500)]
    assert all(0.5 <= d <= 1.0 for d in delays)
    assert len(set(delays)) > 1  # drawn, not fixed


def test_max_tries_delays_are_given_then_none() -> None:
    backoff = Backoff(0.2, 5.0, jitter=0.5, max_tries=2)
    assert next(backoff, None) is not None
    assert next(backoff, None) is not None
    assert next(backoff, None) is None
    backoff.reset()
    assert next(backoff, None) is not None


def test_no_delay_may_end_past_the_deadline() -> None:
    now = [100.0]
    backoff = Backoff(0.05, 1.0, within_s=0.3, clock=lambda: now[0])
    assert next(backoff, None) == pytest.approx(0.05)
    now[0] += 0.05
    assert next(backoff, None) == pytest.approx(0.1)
    now[0] += 0.1
    # 0.15 s are left: the next delay (0.2 s) would end past them.
    assert next(backoff, None) is None
    assert backoff.tries == 2


def test_a_loop_that_counts_its_own_failures_asks_for_the_nth_delay() -> None:
    restart = Backoff(0.5, 10.0)
    assert [restart.delay(n) for n in (1, 2, 3, 6, 100)] == [0.5, 1.0, 2.0, 10.0, 10.0]
    assert restart.tries == 0


@pytest.mark.parametrize(
    ("base_s", "cap_s", "jitter"), [(1.0, 0.5, 0.0), (-1.0, 1.0, 0.0), (0.1, 1.0, 1.5)]
)
def test_a_backoff_that_makes_no_sense_is_refused(
    base_s: float, cap_s: float, jitter: float
) -> None:
    with pytest.raises(ValueError):
        Backoff(base_s, cap_s, jitter=jitter)

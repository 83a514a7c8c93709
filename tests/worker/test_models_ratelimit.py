"""The rate-limit gate: its states, then a worker's turns at load against the fake API in
its own process."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import time
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis

from harness.fake_anthropic import FakeAnthropicProcess
from tests.worker_kit import running_worker, turn_events
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.events import (
    Event,
    RoundWaiting,
    TextDelta,
    TurnCompleted,
    UnknownEvent,
    is_terminal,
)
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.anthropic import AnthropicModel, sdk_client
from turnbus.worker.models.ratelimit import RateGate, budget_reset_s

TURNS = 100


def test_a_fresh_gate_lets_one_probe_go_then_everyone_once_it_passes() -> None:
    gate = RateGate()
    assert gate.try_admit() is True  # nothing known of the key yet: one request first
    assert gate.try_admit() is None  # the others wait for its answer
    gate.passed({}, probe=True, max_wait_s=30)
    assert gate.try_admit() is False and gate.try_admit() is False
    assert not gate.limiting()


def test_a_limit_closes_the_gate_and_reopens_it_for_one_probe() -> None:
    gate = RateGate()
    gate.passed({}, probe=False, max_wait_s=30)
    gate.limited(0.0, "overloaded", probe=False)
    assert gate.limiting() and gate.reason == "overloaded"
    assert gate.try_admit() is True and gate.try_admit() is None
    gate.released(probe=True)  # the probe ended without a verdict: another may try
    assert gate.try_admit() is True


def test_a_spent_budget_closes_the_gate_until_its_reset() -> None:
    reset = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=20)
    spent = {
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": reset.isoformat().replace("+00:00", "Z"),
        "anthropic-ratelimit-tokens-remaining": "5000",
    }
    assert budget_reset_s({**spent, "anthropic-ratelimit-requests-remaining": "3"}) is None
    gate = RateGate()
    gate.passed(spent, probe=gate.try_admit() is True, max_wait_s=30)
    assert gate.try_admit() is None
    assert 15 < gate.closed_for_s() <= 20
    gate = RateGate()
    gate.passed(spent, probe=False, max_wait_s=5)  # capped like a retry-after
    assert gate.closed_for_s() <= 5


@pytest.fixture(scope="module")
def fake_process() -> Iterator[FakeAnthropicProcess]:
    with FakeAnthropicProcess() as server:
        yield server


@pytest.fixture
def fake(fake_process: FakeAnthropicProcess) -> FakeAnthropicProcess:
    fake_process.reset()
    fake_process.configure(responder="remember")
    return fake_process


async def run_turns(
    settings: Settings,
    fake: FakeAnthropicProcess,
    redis: aioredis.Redis,
    keys: Keys,
    store: EnvelopeStore,
    messages: list[str],
    **model_options: float,
) -> list[list[Event | UnknownEvent]]:
    """Submit one turn per message, each in a session of its own, all at once; the
    events of each once every turn has ended."""
    settings = dataclasses.replace(settings, model="anthropic")
    sdk = sdk_client(api_key=fake.api_key, base_url=fake.url)
    # A gate of its own, as a fresh worker process has: nothing is known of the key yet.
    model = AnthropicModel(settings, client=sdk, gate=RateGate(), **model_options)
    turns = TurnStore(redis, keys, settings)
    ids = []
    for i in range(len(messages)):
        await store.create("u1", f"s{i}")
    try:
        async with running_worker(settings, model):
            for i, message in enumerate(messages):
                record, _, _ = await turns.submit_queued("u1", f"s{i}", message)
                ids.append(record.turnId)
            pending = dict(enumerate(ids))
            ended: dict[int, list[Event | UnknownEvent]] = {}
            deadline = time.monotonic() + 50
            while pending:
                assert time.monotonic() < deadline, f"{len(pending)} turns did not end"
                for i, tid in list(pending.items()):
                    events = await turn_events(redis, keys, "u1", f"s{i}", tid)
                    if any(is_terminal(e) for e in events):
                        ended[i] = events
                        del pending[i]
                if pending:
                    await asyncio.sleep(0.2)
    finally:
        await model.aclose()
        await sdk.close()
    return [ended[i] for i in range(len(messages))]


async def test_a_rate_limit_holds_the_herd_and_every_turn_completes(
    settings: Settings,
    fake: FakeAnthropicProcess,
    redis: aioredis.Redis,
    keys: Keys,
    store: EnvelopeStore,
) -> None:
    fake.configure(limit_for_s=3, limit_retry_after=1)
    results = await run_turns(
        settings, fake, redis, keys, store, [f"hello {i}" for i in range(TURNS)]
    )
    assert all(isinstance(events[-1], TurnCompleted) for events in results)
    stats = fake.stats()
    # One probe per retry-after while the limit holds, not a retry per turn.
    during = [t for t in stats["request_times"] if t < 3.0]
    assert len(during) <= 8, during
    assert stats["statuses"]["429"] <= 8
    assert stats["statuses"]["200"] == TURNS
    # The turns held back said why nothing streamed.
    waiting = [e for events in results for e in events if isinstance(e, RoundWaiting)]
    assert waiting and {e.reason for e in waiting} == {"rate_limited"}


async def test_overload_on_a_share_of_requests_completes_every_turn_once(
    settings: Settings,
    fake: FakeAnthropicProcess,
    redis: aioredis.Redis,
    keys: Keys,
    store: EnvelopeStore,
) -> None:
    fake.configure(overload_share=0.3, seed=7)
    messages = [f"remember item {i} is done" for i in range(TURNS)]
    results = await run_turns(
        settings, fake, redis, keys, store, messages, base_delay_s=0.05, max_delay_s=0.4
    )
    assert all(isinstance(events[-1], TurnCompleted) for events in results)
    for i, events in enumerate(results):
        texts: dict[int, str] = {}
        for e in events:
            if isinstance(e, TextDelta):
                texts[e.round] = texts.get(e.round, "") + e.text
        # Each round's text streamed once: a 529 is retried only before any text.
        assert texts[1] == "Saving that to my working notes."
        assert texts[2].startswith(f"Noted: item {i} is done. The tool said: ")
        assert texts[2].count("Noted:") == 1
    stats = fake.stats()
    assert stats["statuses"]["529"] > 0
    assert stats["statuses"]["200"] == 2 * TURNS

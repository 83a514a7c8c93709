"""A worker's run capacity (:class:`RunSlots`) and its per-session wait lists
(:class:`SessionWaits`).

Every entry a worker has read runs as one task until it ends. While it runs (or is
about to try) it holds one of ``concurrency`` run slots; while it waits behind its
session's running turn it gives its slot back and sleeps in its session's wait list.
No new work is taken while every slot is held, nor while the process is saturated
(the back-pressure signals of :mod:`turnbus.worker.pressure`) with turns running here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from turnbus.shared.connect import pool_wait_ms
from turnbus.shared.muxclient import mux_client
from turnbus.shared.settings import Settings
from turnbus.worker.health import WorkerMetrics
from turnbus.worker.pressure import LoopLag
from turnbus.worker.workqueue import Entry

__all__ = ["RunSlots", "SessionWaits", "WaitForSession"]

log = logging.getLogger(__name__)

# An entry's wait behind its session's running turn: ``wait(head, paused)``, ``False``
# when the worker stops (:meth:`SessionWaits.waiter`).
WaitForSession = Callable[[str, bool], Awaitable[bool]]

_WAIT_POLL_S = 0.05
_WAIT_POLL_MAX_S = 0.4
# Behind a turn paused for its caller (requires_action), which may wait a day, the
# oldest waiter looks less often: first after this long, then 1.5 times longer each
# time, up to the most. Its answer makes the head run again (a model round at least),
# and the waiter's next look, seeing it run, goes back to the pace above.
_PAUSED_POLL_S = 1.0
_PAUSED_POLL_MAX_S = 5.0
# A waiting entry that is not its session's oldest here re-checks this often (a safety
# net: it is normally woken when its session's turn ends or a poll finds it at the head).
_WAIT_IDLE_S = 2.0
# A turn that interrupted its session's running turn polls at this pace, for this long.
_STEADY_POLL_S = 0.02
_STEADY_FOR_S = 2.0


async def _woken(event: asyncio.Event, within: float) -> bool:
    """A waiting entry's sleep until its next look: whether ``event`` woke it first."""
    try:
        await asyncio.wait_for(event.wait(), within)
    except TimeoutError:
        return False
    return True


class RunSlots:
    """The entries in flight (running, or waiting for their session), how many of them
    hold a run slot (:attr:`busy`), and the gate on taking more (:meth:`room_now`)."""

    def __init__(
        self,
        settings: Settings,
        *,
        concurrency: int,
        name: str,
        metrics: WorkerMetrics,
        lag: LoopLag,
        redis: Callable[[], aioredis.Redis],
        stop: asyncio.Event,
    ) -> None:
        self.settings = settings
        self.concurrency = concurrency
        self.name = name
        self.metrics = metrics
        self.lag = lag
        self._redis = redis
        self._stop = stop
        self.in_flight: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.busy = 0
        # Set when a slot frees or an entry ends (and on stop): the read loop and the
        # entries waiting for a slot look again.
        self.room = asyncio.Event()
        self._was_saturated = False

    def pressure(self) -> str | None:
        """Why the process is saturated now (``None``: it is not). Every signal follows
        the present within a second: a worker that takes no work gets few replies, so
        no signal may need replies to come down."""
        lag = self.lag.lag_ms
        if lag > self.settings.worker_max_loop_lag_ms:
            return f"event loop {lag:.0f} ms late"
        redis = self._redis()
        wait_ms = pool_wait_ms(redis)
        if wait_ms > self.settings.worker_max_pool_wait_ms:
            return f"calls wait {wait_ms:.0f} ms for a pooled Redis connection"
        latency_ms = mux_client(redis).latency_ms
        if latency_ms > self.settings.worker_max_pool_wait_ms:
            return f"Redis answers in {latency_ms:.0f} ms"
        return None

    def room_now(self) -> int:
        """How many entries to take now: none while full, nor while saturated with turns
        running here. A saturated worker that runs nothing takes one at a time: refusing
        would relieve nothing here, and were every worker saturated (a host short of CPU)
        no turn would start at all."""
        room = self.concurrency - self.busy
        if room > 0 and self._check_saturated():
            return 1 if self.busy == 0 else 0
        return room

    def _check_saturated(self) -> bool:
        """:meth:`pressure`, logging when the state changes (and the gauge follows)."""
        why = self.pressure()
        if (why is not None) != self._was_saturated:
            self._was_saturated = why is not None
            self.metrics.saturated.set(1 if why is not None else 0)
            if why is not None:
                log.warning("worker %s saturated (%s): taking no new work", self.name, why)
            else:
                log.info("worker %s no longer saturated: taking work again", self.name)
        return why is not None

    async def wait_for_room(self) -> None:
        """Full, or the process is saturated: wait for a turn to end (or the pressure to
        ease) before taking more work."""
        self.room.clear()
        full = self.busy >= self.concurrency
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.room.wait(), 1.0 if full else 0.1)

    def spawn(self, entry: Entry, run: Callable[[Entry], Awaitable[None]]) -> None:
        """Run ``run(entry)`` as a task holding a slot, unless the entry is in flight."""
        key = entry.key
        if key in self.in_flight:
            return
        task = asyncio.create_task(self._hold(entry, run), name=f"entry:{entry.id}")
        self.in_flight[key] = task
        self.busy += 1  # until it runs and ends, or waits for its session
        self.metrics.in_flight.set(len(self.in_flight))
        task.add_done_callback(lambda _t: self._done(key))

    async def _hold(self, entry: Entry, run: Callable[[Entry], Awaitable[None]]) -> None:
        try:
            await run(entry)
        finally:
            self.free()

    def _done(self, key: tuple[str, str]) -> None:
        self.in_flight.pop(key, None)
        self.metrics.in_flight.set(len(self.in_flight))
        self.room.set()

    async def take(self) -> None:
        """Wait until fewer than ``concurrency`` entries hold a slot, then hold one."""
        try:
            while self.busy >= self.concurrency and not self._stop.is_set():
                self.room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.room.wait(), 1.0)
        finally:
            self.busy += 1  # even when cancelled: the caller frees it

    def free(self) -> None:
        self.busy -= 1
        self.room.set()


class SessionWaits:
    """Per session (its tag): the turn ids of this process's entries waiting for that
    session's running turn, each with the event that wakes it."""

    def __init__(self, slots: RunSlots, stop: asyncio.Event) -> None:
        self._slots = slots
        self._stop = stop
        self._waiting: dict[str, dict[str, asyncio.Event]] = {}

    @property
    def count(self) -> int:
        return sum(len(w) for w in self._waiting.values())

    def waiter(self, tag: str, turn_id: str, *, steady: bool = False) -> WaitForSession:
        """The ``wait(head, paused)`` of one entry's attempt: sleep without a run slot
        until the session's turn may be this one; ``False``: the worker stops.
        ``paused``: the head waits for its caller, so the oldest waiter looks every
        ``_PAUSED_POLL_S`` and less often after, up to ``_PAUSED_POLL_MAX_S``.
        ``steady``: the oldest waiter looks every ``_STEADY_POLL_S`` without backing
        off, for ``_STEADY_FOR_S`` (a turn that interrupted the running one: it ends at
        once)."""
        delay = _STEADY_POLL_S if steady else _WAIT_POLL_S
        steady_until = time.monotonic() + _STEADY_FOR_S if steady else 0.0
        behind_pause = False

        async def wait(head: str, paused: bool = False) -> bool:
            nonlocal delay, behind_pause
            if self._stop.is_set():
                return False
            self._slots.metrics.session_looks.inc()
            paused = paused and time.monotonic() >= steady_until
            if paused != behind_pause:
                behind_pause = paused
                delay = _PAUSED_POLL_S if paused else _WAIT_POLL_S
            waiters = self._waiting.setdefault(tag, {})
            mine = waiters.setdefault(turn_id, asyncio.Event())
            other = waiters.get(head)
            if head != turn_id and other is not None:
                other.set()  # the head is ours, asleep: its turn now
            # The oldest waiter polls (so does a steady one); the others are woken.
            oldest = min(waiters) == turn_id or time.monotonic() < steady_until
            self._slots.free()
            try:
                mine.clear()
                if await _woken(mine, delay if oldest else _WAIT_IDLE_S):
                    delay = _STEADY_POLL_S if time.monotonic() < steady_until else _WAIT_POLL_S
                elif oldest and time.monotonic() >= steady_until:
                    most = _PAUSED_POLL_MAX_S if behind_pause else _WAIT_POLL_MAX_S
                    delay = min(delay * 1.5, most)
            finally:
                await self._slots.take()
            return not self._stop.is_set()

        return wait

    def leave(self, tag: str, turn_id: str) -> None:
        """The entry's attempt is over: off its session's wait list, and the oldest
        waiting entry of the session polls at once."""
        waiters = self._waiting.get(tag)
        if waiters is not None and waiters.pop(turn_id, None) is not None and not waiters:
            self._waiting.pop(tag, None)
        self.wake(tag)

    def wake(self, tag: str) -> None:
        """The session's oldest waiting entry here looks now (its head ended, here or
        elsewhere)."""
        waiters = self._waiting.get(tag)
        if waiters:
            waiters[min(waiters)].set()

    def wake_all(self) -> None:
        for waiters in self._waiting.values():
            for event in waiters.values():
                event.set()

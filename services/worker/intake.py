"""How a worker takes work entries from the streams (:class:`Intake`).

At start it takes back this consumer's own pending entries; then it reads new ones
while it has room (:meth:`RunSlots.room_now`); a background pass reclaims entries
idle longer than ``claim_idle_ms`` from dead consumers, trims the streams and forgets
dead workers by their own heartbeat. Each entry taken runs as a task of
:class:`RunSlots`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from turnbus.shared.backoff import Backoff
from turnbus.shared.settings import Settings
from turnbus.worker.health import WorkerMetrics
from turnbus.worker.retry import REDIS_ERRORS
from turnbus.worker.slots import RunSlots
from turnbus.worker.workqueue import Entry, WorkQueue

__all__ = ["Intake"]

log = logging.getLogger(__name__)

_READ_BLOCK_MS = 250
# After a failed read of the work streams, the next comes this soon, doubling up to the max.
_READ_RETRY_S = 0.1
_READ_RETRY_MAX_S = 1.0
# A blocking read that has not returned this long after its BLOCK ends is given up.
_READ_GRACE_S = 1.0


class Intake:
    """Reads, takes back and reclaims entries into ``slots``, each run by ``run``
    (which answers whether the next read should take this consumer's own entries back)."""

    def __init__(
        self,
        queue: WorkQueue,
        slots: RunSlots,
        settings: Settings,
        *,
        run: Callable[[Entry], Awaitable[bool]],
        name: str,
        metrics: WorkerMetrics,
        stop: asyncio.Event,
        dead_after_ms: Callable[[], int],
    ) -> None:
        self.queue = queue
        self.slots = slots
        self.settings = settings
        self.name = name
        self.metrics = metrics
        self._run = run
        self._stop = stop
        self._dead_after_ms = dead_after_ms
        self.forget_passes = 0
        # After a read error an entry may have been delivered with its reply lost, and
        # after Redis outlived a turn's retries its entry was left pending: the next
        # read takes this consumer's own pending entries (not in flight) first.
        self._reread_own = False

    def _spawn(self, entry: Entry) -> None:
        self.slots.spawn(entry, self._run_entry)

    async def _run_entry(self, entry: Entry) -> None:
        if await self._run(entry):
            self._reread_own = True

    async def take_own_pending(self) -> None:
        """Entries this consumer name was given before a restart come first."""
        try:
            entries = await self.queue.own_pending()
        except Exception:  # the read loop takes them back after its first failure
            log.warning("could not take back own pending entries", exc_info=True)
            self._reread_own = True
            return
        for entry in entries:
            self._spawn(entry)

    async def read_loop(self) -> None:
        """Read new entries until stop, while there is room."""
        backoff = Backoff(_READ_RETRY_S, _READ_RETRY_MAX_S)
        while not self._stop.is_set():
            room = self.slots.room_now()
            if room <= 0:
                await self.slots.wait_for_room()
                continue
            try:
                entries = await self._read(room)
            except Exception as exc:  # the read loop must outlive any one failure
                # The reply of a read may be what was lost: entries it delivered are
                # pending on this consumer and no new read returns them.
                self._reread_own = True
                why = str(exc) or f"no answer in {_READ_BLOCK_MS / 1000 + _READ_GRACE_S:.2f} s"
                delay = next(backoff)
                log.warning(
                    "reading work failed (%s); retrying in %.1f s",
                    why,
                    delay,
                    exc_info=not isinstance(exc, REDIS_ERRORS),
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
                continue
            backoff.reset()
            for entry in entries:
                self._spawn(entry)

    async def _read(self, room: int) -> list[Entry]:
        if self._reread_own:
            entries = await self.queue.own_delivered(self.slots.in_flight)
            self._reread_own = False
            if entries:
                log.info(
                    "worker %s took back %d of its own pending entries", self.name, len(entries)
                )
            return entries
        # Bounded: a paused Redis or a half-open connection must not hold the loop (its
        # saturation would go unseen); the cancel drops the connection, and the next
        # read first takes back what it delivered.
        return await asyncio.wait_for(
            self.queue.read(room, _READ_BLOCK_MS), _READ_BLOCK_MS / 1000 + _READ_GRACE_S
        )

    async def reclaim_loop(self) -> None:
        """Until stop: reclaim idle entries of dead consumers while there is room, trim
        every stream, forget dead workers."""
        interval = max(self.settings.claim_idle_ms / 2000, 0.05)
        while True:
            await asyncio.sleep(interval)
            if self._stop.is_set():
                return
            for stream in self.queue.streams:
                try:
                    room = self.slots.room_now()
                    if room > 0:
                        for entry in await self.queue.reclaim(stream, room, self.slots.in_flight):
                            log.info("reclaimed %s", entry.id)
                            self.metrics.reclaimed.inc()
                            self._spawn(entry)
                    await self.queue.trim(stream)
                except Exception:  # a background loop must outlive any one failure
                    log.warning("XAUTOCLAIM on %s failed", stream, exc_info=True)
            try:
                await self.queue.forget_dead(self._dead_after_ms())
                self.forget_passes += 1
            except Exception:
                log.warning("could not forget dead workers", exc_info=True)

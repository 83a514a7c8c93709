"""A worker's heartbeat and the outbox sweeps (:class:`Upkeep`).

Every heartbeat the idle time of each in-flight entry is reset (XCLAIM JUSTID, which
does not count as a delivery), so a long or queued turn is never reclaimed from a live
worker, and the worker's own heartbeat record is renewed. Every half outbox grace
period one worker of all (a lock) enqueues the accepted turns whose work entry was
lost between the submit's two calls (``TurnStore.sweep_outboxes``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import redis.asyncio as aioredis

from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.health import WorkerMetrics
from turnbus.worker.workqueue import WorkQueue

__all__ = ["Upkeep"]

log = logging.getLogger(__name__)


class Upkeep:
    """The background loops that keep a worker's entries and the outboxes in order."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        *,
        queue: WorkQueue,
        turns: TurnStore,
        name: str,
        metrics: WorkerMetrics,
        stop: asyncio.Event,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.queue = queue
        self.turns = turns
        self.name = name
        self.metrics = metrics
        self._stop = stop

    async def keepalive_loop(self, in_flight: Iterable[tuple[str, str]]) -> None:
        """Reset the idle time of every in-flight entry; record this worker as alive."""
        settings = self.settings
        interval = max(min(settings.heartbeat_ms, settings.claim_idle_ms // 3), 50) / 1000
        while True:
            await asyncio.sleep(interval)
            try:
                await self.queue.keepalive(list(in_flight))
            except Exception:  # a background loop must outlive any one failure
                log.warning("keepalive failed", exc_info=True)

    async def sweep_loop(self) -> None:
        """Until stop, every half grace period one worker of all (a lock) sweeps the
        outboxes."""
        interval_ms = max(self.settings.outbox_grace_ms // 2, 50)
        while True:
            await asyncio.sleep(interval_ms / 1000)
            if self._stop.is_set():
                return
            try:
                lock = self.keys.sweeper_lock()
                if await self.redis.set(lock, self.name, nx=True, px=interval_ms):
                    swept = await self.turns.sweep_outboxes()
                    self.metrics.swept.inc(len(swept))
            except Exception:  # a background loop must outlive any one failure
                log.warning("outbox sweep failed", exc_info=True)

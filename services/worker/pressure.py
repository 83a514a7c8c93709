"""The worker's Redis pool and its back-pressure signals.

A worker runs hundreds of I/O-bound turns at once, so it must never fail a call for
lack of a free connection: its pool is a :class:`MeteredPool` (redis-py's
``BlockingConnectionPool``), sized from the concurrency, where a call waits up to
``redis_pool_timeout_ms`` for a connection. How long calls wait there, and how late the
event loop runs its callbacks (:class:`LoopLag`), are the signals the read loop uses to
stop taking new work while the process is saturated.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection, BlockingConnectionPool

from shared.mux import MuxRedis
from shared.settings import Settings

__all__ = ["LoopLag", "MeteredPool", "pool_size", "worker_redis"]

# How fast the signals forget a spike (exponential moving average weight of a sample).
_EWMA = 0.3
_WAIT_HALF_LIFE_S = 0.25


class MeteredPool(BlockingConnectionPool):
    """A blocking pool that remembers how long callers waited for a connection."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._wait_ms = 0.0  # moving average of recent waits, as of ``_wait_at``
        self._wait_at = time.monotonic()
        self.waits = 0  # calls that found no free connection

    @property
    def wait_ms(self) -> float:
        """Moving average of recent waits, halved every ``_WAIT_HALF_LIFE_S`` without a
        call: a saturated worker makes few calls, and must see the pressure ease."""
        idle = time.monotonic() - self._wait_at
        decay: float = 0.5 ** (idle / _WAIT_HALF_LIFE_S)
        return self._wait_ms * decay

    def _record(self, waited_ms: float) -> None:
        self._wait_ms = self.wait_ms * (1 - _EWMA) + waited_ms * _EWMA
        self._wait_at = time.monotonic()

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if self.can_get_connection():
            self._record(0.0)
            return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        began = time.monotonic()
        self.waits += 1
        try:
            return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        finally:
            self._record((time.monotonic() - began) * 1000)


def pool_size(settings: Settings, concurrency: int) -> int:
    """Connections for one worker process: the setting, else half the concurrency (most
    turns wait on the model, not on Redis) plus room for the background loops."""
    if settings.worker_redis_connections:
        return settings.worker_redis_connections
    return max(concurrency // 2, 8) + 8


def worker_redis(settings: Settings, concurrency: int) -> aioredis.Redis:
    """The worker's client: a blocking pool where a call waits, never fails, for a
    connection (up to ``redis_pool_timeout_ms``, then a retryable ``ConnectionError``)."""
    extra: dict[str, Any] = {}
    if "driver_info" in inspect.signature(AbstractConnection.__init__).parameters:
        # No CLIENT SETINFO: redis-py builds its driver info (a package-metadata read)
        # for every new connection, a real cost when hundreds of turns open them.
        extra["driver_info"] = None
    pool = MeteredPool.from_url(
        settings.redis_url,
        decode_responses=True,
        max_connections=pool_size(settings, concurrency),
        timeout=settings.redis_pool_timeout_ms / 1000,
        **extra,
    )
    # Commands share one pipelined connection (shared.mux); the pool runs the blocking
    # reads (XREADGROUP BLOCK) and anything else that must not hold that connection.
    return MuxRedis(pool)


class LoopLag:
    """How late the event loop wakes a sleeper: a direct measure of a saturated process."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.lag_ms = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._measure(), name="worker:loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _measure(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await asyncio.sleep(self.interval_s)
            late = max((loop.time() - began - self.interval_s) * 1000, 0.0)
            self.lag_ms = self.lag_ms * (1 - _EWMA) + late * _EWMA

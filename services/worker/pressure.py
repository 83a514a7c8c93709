"""How late the worker's event loop runs its callbacks (:class:`LoopLag`).

One of the three back-pressure signals with which the read loop (through
``RunSlots.pressure``, worker/slots.py) stops taking new work while the process is
saturated: the event loop runs late; the multiplexed Redis connection, which every
turn's commands share, answers slowly (``latency_ms`` of :mod:`turnbus.shared.mux`);
or calls wait for one of the pooled connections under it, which only blocking reads,
pub/sub and ``WAIT`` take (:func:`turnbus.shared.connect.pool_wait_ms`).
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["LoopLag"]

# How fast the signals forget a spike (exponential moving average weight of a sample).
_EWMA = 0.3


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

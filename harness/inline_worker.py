"""A :class:`Worker` running in the caller's event loop, for the tests and the benchmarks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis

from harness.waits import wait_until
from turnbus.shared.settings import Settings
from turnbus.worker.consumer import Worker
from turnbus.worker.registry import ToolRegistry

__all__ = ["running_worker"]


@contextlib.asynccontextmanager
async def running_worker(
    settings: Settings,
    model: Any,
    *,
    name: str | None = None,
    concurrency: int | None = None,
    redis_client: aioredis.Redis | None = None,
    tools: ToolRegistry | None = None,
) -> AsyncIterator[Worker]:
    """A :class:`Worker` running in this event loop; stopped and closed on exit."""
    worker = Worker(
        settings, name=name, concurrency=concurrency, model=model, redis=redis_client, tools=tools
    )
    task = asyncio.create_task(worker.run())
    try:
        await wait_until(lambda: _true(worker.running or task.done()), 10)
        if task.done():
            task.result()
        yield worker
    finally:
        worker.request_stop()
        try:
            await asyncio.wait_for(task, 30)
        finally:
            await worker.aclose()


async def _true(value: bool) -> bool:
    return value

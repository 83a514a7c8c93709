"""Cancellation of the worker's own tasks: a unit a cancel must not split, a task that
must stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

__all__ = ["shield_until_done", "stop_task"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


async def shield_until_done(step: Awaitable[_T]) -> _T:
    """Run ``step`` as one unit: a cancel that lands in the middle (the turn's, the wall
    clock's) is honoured once ``step`` is done, so a write is never left half done with
    its bookkeeping (an event not handed over, rows written twice by a later call)."""
    unit = asyncio.ensure_future(step)
    try:
        return await asyncio.shield(unit)
    except asyncio.CancelledError:
        while not unit.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({unit})
        if not unit.cancelled():
            unit.exception()  # retrieved: the cancel wins
        raise


async def stop_task(task: asyncio.Task[Any], within: float = 5.0) -> bool:
    """Cancel ``task`` and wait until it is done; ``False`` if it outlived ``within``.

    The cancel is repeated: redis-py (8.1, Python 3.11) can swallow a cancellation that
    lands inside a command, and the task would otherwise run on.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not task.done():
        if loop.time() > deadline:
            log.error("task %s did not stop within %.1f s", task.get_name(), within)
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
    return True

"""Waiting on state with a deadline: the one poll loop of the tests and the benchmarks (no
sleeps to wait for state)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def poll(
    condition: Callable[[], Any | Awaitable[Any]],
    *,
    within: float = 10.0,
    what: str = "",
    interval: float = 0.02,
) -> Any:
    """Call ``condition`` (sync or async) until it returns something truthy, and return
    that; fail after ``within`` seconds, naming ``what`` was awaited."""
    deadline = time.monotonic() + within
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what or condition}")
        await asyncio.sleep(interval)


def poll_blocking(
    condition: Callable[[], Any],
    *,
    within: float = 10.0,
    what: str = "",
    interval: float = 0.02,
    not_yet: tuple[type[BaseException], ...] = (),
) -> Any:
    """:func:`poll` for code outside an event loop (a fixture that starts servers):
    ``condition`` raising one of ``not_yet`` counts as not holding yet."""
    deadline = time.monotonic() + within
    while True:
        try:
            result = condition()
        except not_yet:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what or condition}")
        time.sleep(interval)


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], within: float = 10.0, interval: float = 0.02
) -> None:
    """Poll ``predicate`` until it holds; fail after ``within`` seconds."""
    await poll(predicate, within=within, interval=interval)

"""The tools of bench_load.py's ``tools`` scenario: one call takes 50 ms.

``wait_50ms`` is side-effecting (the default), so each call costs what the crash
promise costs: the round's intent written before it starts, its result after.
"""

from __future__ import annotations

import asyncio

from turnbus.tools import ToolContext, tool

TOOL_MS = 50


@tool
async def wait_50ms(i: int, ctx: ToolContext) -> str:
    """Wait 50 ms, then say which call this was."""
    await asyncio.sleep(TOOL_MS / 1000)
    return f"call {i} done ({ctx.call_id})"

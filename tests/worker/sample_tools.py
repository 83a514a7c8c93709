"""Tools the worker tests load (by this file's path, as ``TURNBUS_TOOLS`` allows).

``charge`` (side-effecting) and ``fetch`` (idempotent) block on a gate the test runs:
each call connects to ``SAMPLE_TOOLS_GATE`` (host:port), says which call it is, and
waits for the test's answer, so a test can kill a worker while a tool runs.
"""

from __future__ import annotations

import asyncio
import json
import os

from turnbus.tools import ToolContext, tool


@tool(idempotent=True)
async def lookup(term: str) -> str:
    """Look a term up."""
    return f"{term}: found"


@tool
async def count_to(count: int, ctx: ToolContext) -> str:
    """Count up to ``count``."""
    return f"{ctx.user_id}/{ctx.session_id}/{ctx.turn_id}/{ctx.call_id}: {count}"


@tool
async def boom(reason: str = "no such ticket") -> str:
    """Always raises."""
    raise ValueError(reason)


@tool
async def exits() -> str:
    """Raises what would end a process."""
    raise SystemExit(3)


@tool(timeout_s=0.3)
async def hang() -> str:
    """Never answers."""
    await asyncio.Event().wait()
    return "unreachable"


@tool(idempotent=True)
async def big(megabytes: int = 5) -> str:
    """A result far over the cap."""
    return "x" * (megabytes * 1024 * 1024)


async def _through_gate(tool: str, n: int, ctx: ToolContext) -> str:
    host, port = os.environ["SAMPLE_TOOLS_GATE"].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        hello = {"tool": tool, "n": n, "callId": ctx.call_id, "turnId": ctx.turn_id}
        writer.write(json.dumps(hello).encode() + b"\n")
        await writer.drain()
        answer = await reader.readline()
        return f"{tool} {n}: {answer.decode().strip()}"
    finally:
        writer.close()


@tool(timeout_s=60)
async def charge(n: int, ctx: ToolContext) -> str:
    """A side-effecting call that waits for the test's gate."""
    return await _through_gate("charge", n, ctx)


@tool(idempotent=True, timeout_s=60)
async def fetch(n: int, ctx: ToolContext) -> str:
    """An idempotent call that waits for the test's gate."""
    return await _through_gate("fetch", n, ctx)

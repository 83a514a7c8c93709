"""Tools that require approval, loaded by the approval tests (by this file's path).

``send`` appends a line to ``APPROVAL_TOOLS_LOG`` (each line an effect that happened);
``pay`` waits on the gate a test runs (``SAMPLE_TOOLS_GATE``, as in sample_tools.py),
so a test can kill a worker while an approved call runs.
"""

from __future__ import annotations

import asyncio
import json
import os

from turnbus.tools import ToolContext, tool


@tool(requires_approval=True)
async def send(to: str, body: str, ctx: ToolContext) -> str:
    """Send a message to someone."""
    line = json.dumps({"to": to, "body": body, "callId": ctx.call_id}) + "\n"
    await asyncio.to_thread(_append, os.environ["APPROVAL_TOOLS_LOG"], line)
    return f"sent to {to}: {body}"


def _append(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as log:
        log.write(line)


@tool(requires_approval=True, timeout_s=60)
async def pay(amount: int, ctx: ToolContext) -> str:
    """Pay an invoice (waits for the test's gate)."""
    host, port = os.environ["SAMPLE_TOOLS_GATE"].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        hello = {"tool": "pay", "n": amount, "callId": ctx.call_id, "turnId": ctx.turn_id}
        writer.write(json.dumps(hello).encode() + b"\n")
        await writer.drain()
        answer = await reader.readline()
        return f"paid {amount}: {answer.decode().strip()}"
    finally:
        writer.close()

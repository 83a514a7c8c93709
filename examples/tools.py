"""Example tools for a local stack: ``TURNBUS_TOOLS=examples/tools.py make run``.

``lookup`` only reads, so it is idempotent: after a lost worker it is simply run again.
``append_line`` writes to a file, so it is side-effecting (the default): after a lost
worker it is never run again behind the model's back; the model is told the outcome is
unknown and decides (docs/tools.md).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from turnbus.tools import ToolContext, tool

GLOSSARY = {
    "turn": "one request to the agent and everything it does to answer it",
    "round": "one model call inside a turn, with the tools it asked for",
    "notes": "the session's working notes, folded into every later round's system prompt",
    "lease": "the session's lock: one running turn per session, renewed by a heartbeat",
}


@tool(idempotent=True, timeout_s=5)
async def lookup(term: str) -> str:
    """Look a word up in the turnbus glossary (turn, round, notes, lease)."""
    return GLOSSARY.get(term.strip().lower(), f"no entry for {term!r}")


@tool(timeout_s=5)
async def append_line(line: str, ctx: ToolContext) -> str:
    """Append one line of text to the example file (EXAMPLE_APPEND_FILE, by default
    ./turnbus-example.txt). Side-effecting: never repeated without saying so."""
    path = Path(os.environ.get("EXAMPLE_APPEND_FILE", "turnbus-example.txt"))
    text = f"{ctx.session_id} {ctx.call_id} {line}\n"

    def write() -> None:
        with path.open("a", encoding="utf-8") as out:
            out.write(text)

    await asyncio.to_thread(write)
    return f"appended {len(text.encode())} bytes to {path.name}"

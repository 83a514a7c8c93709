"""A real MCP server for the tests, written with the ``mcp`` SDK's server side.

Run it in its own process::

    python -m tests.mcp_server --transport stdio
    python -m tests.mcp_server --transport http --port 8123

``--pid-file`` writes the server's pid there, so a test can kill it;
``--child-pid-file`` starts a child process that outlives the server (for the group kill).
Its tools: ``echo``, ``hang`` (sleeps, for timeouts), ``big`` (a large result),
``fail`` (raises), ``lookup``
(read-only), ``put`` (idempotent), ``drop`` (destructive), ``note`` (no hints),
``stats`` (structured content), ``has_env`` and ``has_header`` (whether an env var or
a header reached it), ``whoami`` (the identity in the call's ``_meta``) and
``dotted.name`` (a name the worker must rewrite).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations

server = MCPServer("turnbus-test")


@server.tool(description="Echo the text back.")
def echo(text: str) -> str:
    return text


@server.tool(description="Sleep for the given seconds, then answer.")
async def hang(seconds: float = 3600.0, started: str = "") -> str:
    if started:  # a file the test waits for: the call is running
        await asyncio.to_thread(Path(started).write_text, "started")
    await asyncio.sleep(seconds)
    return "woke"


@server.tool(description="A text of the given size.")
def big(size: int) -> str:
    return "x" * size


@server.tool(description="Raise with the given message.")
def fail(message: str) -> str:
    raise ToolError(message)


@server.tool(description="Look a key up.", annotations=ToolAnnotations(read_only_hint=True))
def lookup(key: str) -> str:
    return f"value of {key}"


@server.tool(description="Store a value.", annotations=ToolAnnotations(idempotent_hint=True))
def put(key: str, value: str) -> str:
    return f"stored {key}"


@server.tool(description="Delete a key.", annotations=ToolAnnotations(destructive_hint=True))
def drop(key: str) -> str:
    return f"dropped {key}"


@server.tool(description="Record a note.")
def note(text: str) -> str:
    return "noted"


@server.tool(description="Counts, as structured content.")
def stats(word: str) -> dict[str, Any]:
    return {"word": word, "length": len(word)}


@server.tool(description="Whether an environment variable is set (never its value).")
def has_env(name: str) -> str:
    return "yes" if os.environ.get(name) else "no"


@server.tool(description="The turnbus identity the call carried in its _meta.")
def whoami(ctx: Context) -> str:
    meta = ctx.request_context.meta or {}
    return json.dumps({k: v for k, v in meta.items() if k.startswith("turnbus/")}, sort_keys=True)


@server.tool(description="Whether the HTTP request carried a header (never its value).")
def has_header(name: str, ctx: Context) -> str:
    return "yes" if (ctx.headers or {}).get(name.lower()) else "no"


@server.tool(name="dotted.name", description="A tool whose name has a dot.")
def dotted() -> str:
    return "dotted"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--pid-file", type=Path, default=None)
    parser.add_argument(
        "--child-pid-file",
        type=Path,
        default=None,
        help="start a child that outlives a clean exit (it ignores stdin) and write its pid",
    )
    args = parser.parse_args()
    if args.pid_file is not None:
        args.pid_file.write_text(str(os.getpid()))
    if args.child_pid_file is not None:
        child = subprocess.Popen(
            ["sleep", "300"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
        args.child_pid_file.write_text(str(child.pid))
    if args.transport == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()

"""What a source of tools gives the worker: its tools' specs and one call at a time.

A source is the deployment's Python tools (``TURNBUS_TOOLS``, the ``turnbus.tools`` entry
points) or one MCP server (``TURNBUS_MCP_CONFIG``). The worker's registry merges the
sources' tools with the always-on notes tools; the round's tool pipeline validates a
call's input, bounds it in time (``RegisteredTool.timeout_s``, around :meth:`ToolSource.call`)
and in size (``max_result_bytes``), records a side-effecting call's intent before it
starts, and turns every failure into an error result. A source therefore only runs the
call: it never sees ids from the model's input, only the turn's :class:`ToolContext`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

__all__ = ["RegisteredTool", "ToolCallResult", "ToolContext", "ToolSource", "ToolSourceError"]


class ToolSourceError(RuntimeError):
    """A source that cannot start, or tools that cannot be merged; the message names
    what is wrong (the file, the module, the entry). The worker stops at start with it."""


@dataclasses.dataclass(frozen=True, slots=True)
class ToolContext:
    """The turn's identity, from the turn record, never from the model's input.
    ``call_id`` (the model's ``tool_use`` id) is the call's idempotency key: a rerun of
    an idempotent call after a crash carries the same one."""

    user_id: str
    session_id: str
    turn_id: str
    call_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class RegisteredTool:
    """One tool as the model is offered it and as the pipeline runs it."""

    name: str  # unique across sources; an MCP tool's is "<server>__<tool>"
    description: str
    input_schema: dict[str, Any]  # a JSON Schema object
    source: str  # the source's name: "python", or the MCP server's name
    idempotent: bool = False  # safe to run again with the same key; else side-effecting
    timeout_s: float = 30.0
    max_result_bytes: int = 16 * 1024
    requires_approval: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallResult:
    output: str
    is_error: bool = False


class ToolSource(Protocol):
    """A source of tools. ``call`` must be cancel-safe: the pipeline cancels it at the
    tool's timeout or the turn's cancel, and the source stays usable afterwards."""

    name: str

    async def start(self) -> None:
        """Connect and list the tools; a source that cannot start raises with a message
        that names what is wrong (the file, the entry)."""
        ...

    def tools(self) -> list[RegisteredTool]:
        """The tools this source offers now (stable between reconnects)."""
        ...

    async def call(
        self, tool: RegisteredTool, arguments: dict[str, Any], context: ToolContext
    ) -> ToolCallResult:
        """Run one call. A failure the source can describe (a server down, a tool's own
        error) is an error result; any exception is turned into one by the pipeline."""
        ...

    def status(self) -> dict[str, Any]:
        """A small JSON-able state for ``/readyz`` and ``turnbus status`` (no secrets)."""
        ...

    async def aclose(self) -> None: ...

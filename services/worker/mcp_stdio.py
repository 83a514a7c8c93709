"""A stdio MCP server as a child process in its own process group.

The SDK's ``stdio_client`` keeps the child to itself; the worker needs it, to kill the
server's whole group whatever its leader did (a server that exits on EOF can leave
children behind) and to report the pid. So the worker spawns the server here and
bridges its pipes to the session's streams, one JSON-RPC message per line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable

import anyio
import anyio.abc
import mcp_types
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.client.stdio import get_default_environment
from mcp.shared.message import SessionMessage

from turnbus.worker.mcp_config import McpStdioServer

__all__ = ["MAX_MESSAGE_BYTES", "StdioConnection", "stdio_connection"]

log = logging.getLogger(__name__)

# The largest message a server may send (a stdio line, an HTTP event): a server cannot
# make the worker hold more. A result is cut to its tool's cap after it arrives.
MAX_MESSAGE_BYTES = 32 * 1024 * 1024
# After stdin closes, how long the server has to exit before its group gets SIGTERM,
# then SIGKILL.
_EXIT_GRACE_S = 1.0
_TERM_GRACE_S = 1.0
_POLL_S = 0.01


class StdioConnection:
    """The streams a ``ClientSession`` reads and writes, and the server's process."""

    def __init__(
        self,
        read: MemoryObjectReceiveStream[SessionMessage | Exception],
        write: MemoryObjectSendStream[SessionMessage],
        process: anyio.abc.Process,
    ) -> None:
        self.read = read
        self.write = write
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid


@contextlib.asynccontextmanager
async def stdio_connection(
    server: McpStdioServer, *, on_close: Callable[[], None]
) -> AsyncIterator[StdioConnection]:
    """Spawn ``server`` (a new session, so a process group of its own) and bridge its
    pipes; ``on_close`` runs when the server's stdout ends (it exited or dropped us).
    Leaving the context closes stdin, waits a moment, then kills the whole group."""
    # Only a safe base environment (PATH, HOME, ...) and the entry's own env: the
    # worker's keys and secrets never reach the server.
    env = get_default_environment() | dict(server.env)
    process = await anyio.open_process(
        [server.command, *server.args],
        env=env,
        cwd=server.cwd,
        stderr=None,  # the server's own log goes to the worker's stderr
        start_new_session=True,
    )
    read_send, read_recv = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_send, write_recv = anyio.create_memory_object_stream[SessionMessage](0)

    async def pump_stdout() -> None:
        assert process.stdout is not None
        pending: list[bytes] = []
        size = 0
        try:
            async with read_send:
                async for chunk in process.stdout:
                    *lines, rest = chunk.split(b"\n")
                    for line in lines:
                        pending.append(line)
                        message = _parse(b"".join(pending))
                        pending, size = [], 0
                        if message is not None:
                            await read_send.send(message)
                    if rest:
                        pending.append(rest)
                        size += len(rest)
                        if size > MAX_MESSAGE_BYTES:
                            log.error(
                                "MCP server %r sent a line over %d bytes; disconnecting",
                                server.name,
                                MAX_MESSAGE_BYTES,
                            )
                            return
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        finally:
            on_close()

    async def pump_stdin() -> None:
        assert process.stdin is not None
        try:
            async with write_recv:
                async for item in write_recv:
                    data = item.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await process.stdin.send(data.encode() + b"\n")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            # The server stopped reading: end the session's reads, so no call hangs.
            await read_send.aclose()

    async with anyio.create_task_group() as tg:
        tg.start_soon(pump_stdout)
        tg.start_soon(pump_stdin)
        try:
            yield StdioConnection(read_recv, write_send, process)
        finally:
            with anyio.CancelScope(shield=True):
                read_recv.close()
                write_send.close()
                await _stop(process)
            tg.cancel_scope.cancel()


def _parse(line: bytes) -> SessionMessage | Exception | None:
    if not line.strip():
        return None
    try:
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        return exc  # the session reports it; the connection carries on


async def _exited(process: anyio.abc.Process, within_s: float) -> bool:
    # Polled, not ``process.wait()``: on asyncio that also waits for the pipes' EOF, which
    # a child still holding stdout would delay past the leader's exit.
    with anyio.move_on_after(within_s):
        while process.returncode is None:  # noqa: ASYNC110
            await anyio.sleep(_POLL_S)
    return process.returncode is not None


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


async def _stop(process: anyio.abc.Process) -> None:
    """Close stdin, give the server a moment, then SIGTERM and SIGKILL its group. The
    group is killed even when its leader exited by itself: children it left die too."""
    pgid = process.pid  # start_new_session: the leader's pid is the group's id
    if process.stdin is not None:
        with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await process.stdin.aclose()
    if not await _exited(process, _EXIT_GRACE_S):
        _signal_group(pgid, signal.SIGTERM)
        await _exited(process, _TERM_GRACE_S)
    _signal_group(pgid, signal.SIGKILL)
    with anyio.move_on_after(_TERM_GRACE_S):
        await process.aclose()

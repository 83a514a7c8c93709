"""One MCP server as a :class:`~turnbus.worker.toolsource.ToolSource`.

Each server has one owner task for the connection's whole life: it enters the
transport and the SDK's ``ClientSession`` (whose task groups must be exited by the task
that entered them), initializes, lists the tools, then watches the connection (its end,
or a failed ping) and reconnects with backoff when it drops. Calls are issued on the
session from the calling tasks, which the SDK allows: a request's waiting and its
timeout live in the caller's task, the connection's tasks in the owner's.

While the server is down its tools answer an error result at once. A call the
connection dropped under gets a result saying its outcome is unknown; it is never
sent again by the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Literal, cast

import anyio
import httpx2
import mcp_types
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED, INVALID_REQUEST, REQUEST_TIMEOUT

from turnbus.shared.backoff import Backoff
from turnbus.worker.mcp_config import (
    McpHttpServer,
    McpServerConfig,
    McpStdioServer,
    load_mcp_config,
)
from turnbus.worker.mcp_stdio import MAX_MESSAGE_BYTES, stdio_connection
from turnbus.worker.toolsource import (
    RegisteredTool,
    ToolCallResult,
    ToolContext,
    ToolSourceError,
)

__all__ = [
    "McpStartError",
    "McpToolSource",
    "call_result_text",
    "is_idempotent",
    "list_tools",
    "mcp_sources",
    "prefixed_name",
    "registered_tools",
]

log = logging.getLogger(__name__)

State = Literal["idle", "connecting", "up", "down", "closed"]

_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_NOT_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_-]")
_MAX_TOOLS = 512  # per server; a listing beyond this is cut, with a warning
_MAX_LIST_PAGES = 32
# The smallest secret value that is masked in messages: shorter env values ("1",
# "true") are settings, and masking them would garble every message.
_MIN_SECRET_LEN = 4
_CLOSE_TIMEOUT_S = 10.0
# The SDK's own bound on a call, past the tool's ``timeout_s``: the pipeline's timeout
# (around :meth:`McpToolSource.call`) fires first; this one holds where none is around.
_CALL_TIMEOUT_GRACE_S = 1.0
_CLIENT_INFO = mcp_types.Implementation(name="turnbus", version="1")


class _SecretMask(logging.Filter):
    """Masks the configured secrets in the records of the loggers that print an MCP
    server's URL (the HTTP client logs every request's URL, query included)."""

    LOGGERS = ("httpx2", "mcp.client.streamable_http")

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def add(self, secrets: Iterable[str]) -> None:
        self.secrets.update(secrets)
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            if self not in logger.filters:
                logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            text = record.getMessage()
            masked = _mask(text, self.secrets)
            if masked != text:
                record.msg, record.args = masked, None
        return True


def _mask(text: str, secrets: Iterable[str]) -> str:
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


_SECRET_MASK = _SecretMask()


class _NoAnswer(Exception):
    """The server did not finish the handshake in time (its message says so)."""


class McpStartError(ToolSourceError):
    """A server could not be reached or listed when the worker started."""


def prefixed_name(server: str, tool: str, taken: Iterable[str] = ()) -> str:
    """``<server>__<tool>``, rewritten to fit ``^[a-zA-Z0-9_-]{1,64}$``: other characters
    become ``_``; a name too long, or one that clashes after rewriting, is cut and ends
    in a short digest of the tool's own name."""
    name = f"{server}__{_NOT_NAME_CHARS.sub('_', tool)}"
    if _TOOL_NAME.match(name) and name not in set(taken):
        return name
    digest = hashlib.sha256(tool.encode()).hexdigest()[:8]
    return f"{name[: 64 - 9]}_{digest}"


def is_idempotent(annotations: mcp_types.ToolAnnotations | None) -> bool:
    """MCP's hints decide the rerun rule: read-only or idempotent may run again with
    the same key; no hint (or only ``destructiveHint``) is side-effecting."""
    if annotations is None:
        return False
    return bool(annotations.read_only_hint or annotations.idempotent_hint)


def call_result_text(result: mcp_types.CallToolResult) -> ToolCallResult:
    """A tool's answer as the model gets it: the text blocks joined by newlines (other
    blocks named, not inlined); with no text, the structured content as JSON."""
    parts: list[str] = []
    texts = 0
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
            texts += 1
        elif isinstance(block, mcp_types.EmbeddedResource):
            resource = block.resource
            if isinstance(resource, mcp_types.TextResourceContents):
                parts.append(resource.text)
                texts += 1
            else:
                parts.append(f"[resource {resource.uri}: binary content omitted]")
        elif isinstance(block, mcp_types.ResourceLink):
            parts.append(f"[resource link: {block.uri}]")
        else:
            parts.append(f"[{block.type} ({block.mime_type}) omitted]")
    if not texts and result.structured_content is not None:
        parts.insert(0, json.dumps(result.structured_content, ensure_ascii=False))
    return ToolCallResult("\n".join(parts), is_error=bool(result.is_error))


def _identity_meta(context: ToolContext) -> mcp_types.RequestParamsMeta:
    """The turn's identity for the server, in the request's ``_meta``; the call id is
    the idempotency key an idempotent tool sees again on a rerun."""
    meta = {
        "turnbus/userId": context.user_id,
        "turnbus/sessionId": context.session_id,
        "turnbus/turnId": context.turn_id,
        "turnbus/callId": context.call_id,
    }
    # The TypedDict allows extra keys (PEP 728), which mypy does not read yet.
    return cast(mcp_types.RequestParamsMeta, meta)


async def list_tools(session: ClientSession, server: str) -> list[mcp_types.Tool]:
    """The server's tools, page by page, the first ``_MAX_TOOLS`` of them."""
    tools: list[mcp_types.Tool] = []
    cursor: str | None = None
    for _ in range(_MAX_LIST_PAGES):
        params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor or len(tools) >= _MAX_TOOLS:
            break
    if len(tools) > _MAX_TOOLS:
        log.warning("MCP server %r lists over %d tools; using the first", server, _MAX_TOOLS)
    return tools[:_MAX_TOOLS]


def registered_tools(
    config: McpServerConfig, listed: Sequence[mcp_types.Tool]
) -> tuple[list[RegisteredTool], dict[str, str]]:
    """A server's listing as the worker's tools (sorted, names prefixed by the server),
    and each one's name on the server (our name -> the server's)."""
    wanted = config.requires_approval
    remote: dict[str, str] = {}
    tools: list[RegisteredTool] = []
    for tool in sorted(listed, key=lambda t: t.name):
        name = prefixed_name(config.name, tool.name, remote)
        remote[name] = tool.name
        schema = dict(tool.input_schema) if tool.input_schema else {}
        schema.setdefault("type", "object")
        tools.append(
            RegisteredTool(
                name=name,
                description=tool.description or tool.title or "",
                input_schema=schema,
                source=config.name,
                idempotent=is_idempotent(tool.annotations),
                timeout_s=config.timeout_s,
                requires_approval=wanted if isinstance(wanted, bool) else tool.name in wanted,
            )
        )
    if isinstance(wanted, frozenset):
        for name in sorted(wanted - {t.name for t in listed}):
            log.warning(
                "MCP server %s: requiresApproval names %r, which the server does not list",
                config.name,
                name,
            )
    return tools, remote


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _describe(exc: BaseException) -> str:
    """One line for an exception, exception groups unwrapped to their first cause."""
    leaf = next((e for e in _leaves(exc) if not isinstance(e, asyncio.CancelledError)), exc)
    text = str(leaf).strip() or "no detail"
    if isinstance(leaf, MCPError | _NoAnswer):
        return text
    return f"{type(leaf).__name__}: {text}"


class McpToolSource:
    """The tools of one MCP server (see the module's docstring)."""

    def __init__(
        self,
        config: McpServerConfig,
        *,
        backoff_initial_s: float = 0.25,
        backoff_max_s: float = 15.0,
        ping_interval_s: float = 5.0,
    ) -> None:
        self.name = config.name
        self.config = config
        # Each reconnect's wait: doubling, cut by up to a fifth at random.
        self._backoff = Backoff(min(backoff_initial_s, backoff_max_s), backoff_max_s, jitter=0.2)
        self._ping_interval_s = ping_interval_s
        self._secrets = [s for s in config.secrets if len(s) >= _MIN_SECRET_LEN]
        if isinstance(config, McpHttpServer):
            _SECRET_MASK.add(self._secrets)
        self._tools: list[RegisteredTool] = []
        self._remote: dict[str, str] = {}  # our name -> the server's name
        self._session: ClientSession | None = None
        self._state: State = "idle"
        self._reconnects = 0
        self._last_error: str | None = None
        self._pid: int | None = None
        self._closing = False
        self._dropped = False
        self._was_up = False  # the last connection got as far as listing the tools
        self._wake = asyncio.Event()
        self._owner: asyncio.Task[None] | None = None
        self._first: asyncio.Future[None] | None = None

    # --- the ToolSource protocol ------------------------------------------------------

    async def start(self) -> None:
        """Connect and list the tools; raises :class:`McpStartError` (naming the server
        and the reason) when the first connection fails."""
        if self._owner is not None:
            return
        self._first = asyncio.get_running_loop().create_future()
        self._owner = asyncio.create_task(self._own(), name=f"mcp-server-{self.name}")
        try:
            await asyncio.shield(self._first)
        except BaseException:
            await self.aclose()
            raise

    def tools(self) -> list[RegisteredTool]:
        return list(self._tools)

    async def call(
        self, tool: RegisteredTool, arguments: dict[str, Any], context: ToolContext
    ) -> ToolCallResult:
        session = self._session
        remote = self._remote.get(tool.name)
        if remote is None:
            return ToolCallResult(
                f"the MCP server {self.name!r} has no tool {tool.name!r}", is_error=True
            )
        if session is None or self._state != "up" or self._dropped:
            why = f": {self._last_error}" if self._last_error else ""
            return ToolCallResult(
                f"the MCP server {self.name!r} is unavailable (reconnecting{why}); "
                "the call was not made",
                is_error=True,
            )
        try:
            result = await session.call_tool(
                remote,
                arguments,
                read_timeout_seconds=tool.timeout_s + _CALL_TIMEOUT_GRACE_S,
                meta=_identity_meta(context),
            )
        except MCPError as exc:
            return self._call_failed(session, exc, tool)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            return self._call_failed(session, exc, tool)
        except Exception as exc:  # a malformed answer, an input request we do not serve
            message = self._redact(_describe(exc))
            log.warning("MCP server %r: call of %r failed: %s", self.name, remote, message)
            return ToolCallResult(
                f"the MCP server {self.name!r} gave an answer that cannot be used: {message}",
                is_error=True,
            )
        return call_result_text(result)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "transport": self.config.transport,
            "state": self._state,
            "tools": len(self._tools),
            "reconnects": self._reconnects,
            "lastError": self._last_error,
        }
        if isinstance(self.config, McpHttpServer):
            out["url"] = self.config.display_url
        else:
            out["pid"] = self._pid
        return out

    async def aclose(self) -> None:
        """Stop the owner: it leaves the session and the transport (killing a stdio
        server's process group) in its own task."""
        self._closing = True
        self._wake.set()
        owner, self._owner = self._owner, None
        if owner is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(owner), _CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.warning("MCP server %r did not close in %g s", self.name, _CLOSE_TIMEOUT_S)
            owner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await owner
        self._state = "closed"

    # --- the owner ----------------------------------------------------------------------

    async def _own(self) -> None:
        try:
            await self._connect_until_closed()
        finally:
            self._state = "closed"
            if self._first is not None and not self._first.done():
                self._first.set_exception(
                    McpStartError(
                        f"MCP server {self.name!r} ({self.config.transport}): could not connect "
                        f"and list its tools: {self._last_error or 'it closed the connection'}"
                    )
                )

    async def _connect_until_closed(self) -> None:
        failures = 0
        while not self._closing:
            self._state = "connecting"
            try:
                await self._connect_and_serve()
            except Exception as exc:
                self._note_error(exc)
            finally:
                self._session = None
                self._pid = None
            if self._closing or self._first is None or not self._first.done():
                return  # closing, or the first connection failed: start() raises
            self._state = "down"
            failures = 1 if self._was_up else failures + 1
            delay = self._backoff.delay(failures)
            log.warning(
                "MCP server %r is down (%s); reconnecting in %.2f s",
                self.name,
                self._last_error,
                delay,
            )
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    async def _connect_and_serve(self) -> None:
        self._was_up = False
        self._dropped = False
        timeout = self.config.connect_timeout_s
        async with self._session_for(self.config) as session:
            try:
                with anyio.fail_after(timeout):
                    await session.initialize()
                    listed = await list_tools(session, self.name)
            except TimeoutError:
                raise _NoAnswer(
                    f"no answer to initialize and tools/list in {timeout:g} s"
                ) from None
            if self._first is not None and self._first.done():
                self._reconnects += 1  # not the first connection
            self._adopt(listed)
            self._session = session
            self._state = "up"
            self._was_up = True
            self._last_error = None
            if self._first is not None and not self._first.done():
                self._first.set_result(None)
            log.info("MCP server %r connected: %d tools", self.name, len(self._tools))
            await self._watch(session)
            self._session = None
            if self._dropped and self._last_error is None:
                self._last_error = "the server closed the connection"

    @contextlib.asynccontextmanager
    async def _session_for(self, config: McpServerConfig) -> AsyncIterator[ClientSession]:
        # Every step is bounded: requests by the session's read timeout, the HTTP
        # connection by the client's timeouts.
        timeout = config.connect_timeout_s
        if isinstance(config, McpStdioServer):
            async with stdio_connection(config, on_close=self._connection_ended) as conn:
                self._pid = conn.pid
                async with ClientSession(
                    conn.read, conn.write, read_timeout_seconds=timeout, client_info=_CLIENT_INFO
                ) as session:
                    yield session
        else:
            # The client the SDK's own helper would make, without its private import.
            http = httpx2.AsyncClient(
                headers=dict(config.headers),
                timeout=httpx2.Timeout(timeout, read=max(300.0, config.timeout_s)),
            )
            async with (
                http,
                streamable_http_client(
                    config.url, http_client=http, max_sse_event_size=MAX_MESSAGE_BYTES
                ) as (read, write),
                ClientSession(
                    read, write, read_timeout_seconds=timeout, client_info=_CLIENT_INFO
                ) as session,
            ):
                yield session

    def _adopt(self, listed: Sequence[mcp_types.Tool]) -> None:
        """The first listing makes the tools; a later one is only compared with it (the
        offered set stays stable between reconnects)."""
        if not self._tools:
            self._tools, self._remote = registered_tools(self.config, listed)
        elif {tool.name for tool in listed} != set(self._remote.values()):
            log.warning(
                "MCP server %r changed its tools since the worker started; "
                "the worker keeps offering the first set",
                self.name,
            )

    async def _watch(self, session: ClientSession) -> None:
        """Until closing or a drop, with a ping every interval (an HTTP server that went
        away is otherwise seen only by the next call)."""
        while True:
            if self._closing or self._dropped:
                return
            woke = False
            with anyio.move_on_after(self._ping_interval_s):
                await self._wake.wait()
                woke = True
            self._wake.clear()
            if woke:
                continue
            try:
                with anyio.fail_after(self.config.connect_timeout_s):
                    await session.send_ping()
            except Exception as exc:
                self._note_error(exc)
                return

    # --- failures -----------------------------------------------------------------------

    def _connection_ended(self) -> None:
        self._dropped = True
        if self._state == "up":
            self._state = "down"
        self._wake.set()

    def _call_failed(
        self, session: ClientSession, exc: Exception, tool: RegisteredTool
    ) -> ToolCallResult:
        code = exc.error.code if isinstance(exc, MCPError) else CONNECTION_CLOSED
        message = self._redact(_describe(exc))
        if code == REQUEST_TIMEOUT:
            bound = tool.timeout_s + _CALL_TIMEOUT_GRACE_S
            return ToolCallResult(
                f"the MCP tool {tool.name!r} timed out after {bound:g} s", is_error=True
            )
        lost = code == CONNECTION_CLOSED or (
            code == INVALID_REQUEST and "session terminated" in message.lower()
        )
        if not lost:
            return ToolCallResult(
                f"the MCP server {self.name!r} answered with an error: {message}", is_error=True
            )
        if session is self._session:
            self._last_error = message
            self._connection_ended()
        return ToolCallResult(
            f"the connection to the MCP server {self.name!r} was lost during the call "
            f"({message}); the outcome of this call is unknown: check before retrying",
            is_error=True,
        )

    def _note_error(self, exc: BaseException) -> None:
        self._last_error = self._redact(_describe(exc))
        log.debug("MCP server %r: %s", self.name, self._last_error)

    def _redact(self, text: str) -> str:
        return _mask(text, self._secrets)


def mcp_sources(config_path: str, **options: Any) -> list[McpToolSource]:
    """One source per server of the config file (not started); a bad file raises
    :class:`~turnbus.worker.mcp_config.McpConfigError` naming the file and the entry."""
    return [McpToolSource(config, **options) for config in load_mcp_config(config_path)]

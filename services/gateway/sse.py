"""A lean SSE response: one ASGI send per chunk, one helper task per stream.

Thousands of streams are open at once and each sends a chunk every few tens of
milliseconds, so the per-send cost is the gateway's cost. :class:`SseResponse` sends
a chunk with a bare ``send`` (no cancel scope, no task per send) and keeps one task
per stream beside it that waits for the client to leave, sends the keep-alive
comment when the stream has been quiet for ``ping_s``, and lets go of a client that
has not taken a chunk for ``send_timeout_s`` (its buffers are full).

The response start goes through the middleware (metrics, CORS, error handling see the
status and headers as for any response); the body chunks go straight to the server's
``send`` when the app left it in the scope (:data:`RAW_SEND`): no middleware looks at
a body chunk, and three wrappers per chunk are a cost at thousands of streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from redis.exceptions import RedisError
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["RAW_SEND", "LastChunk", "SseResponse", "encode_sse"]

# The scope key under which the gateway app keeps the server's own ``send``.
RAW_SEND = "turnbus.raw_send"

log = logging.getLogger(__name__)

_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_HAS_BREAK = re.compile(r"[\r\n]")


def encode_sse(data: str, event: str | None = None, event_id: str | None = None) -> bytes:
    """One SSE event; line breaks in ``data`` become several ``data:`` lines, and
    are removed from ``event`` and ``event_id``."""
    if (
        event_id is not None
        and event is not None
        and "\n" not in data
        and "\r" not in data
        and not _HAS_BREAK.search(event + event_id)
    ):
        # The usual case, a stream entry with no line break anywhere: one format.
        return f"id: {event_id}\r\nevent: {event}\r\ndata: {data}\r\n\r\n".encode(
            "utf-8", "replace"
        )
    parts: list[str] = []
    if event_id is not None:
        parts.append(f"id: {_LINE_BREAK.sub('', event_id)}\r\n")
    if event is not None:
        parts.append(f"event: {_LINE_BREAK.sub('', event)}\r\n")
    if "\n" in data or "\r" in data:
        parts.extend(f"data: {line}\r\n" for line in _LINE_BREAK.split(data))
    else:
        parts.append(f"data: {data}\r\n")
    parts.append("\r\n")
    return "".join(parts).encode("utf-8", "replace")


class LastChunk(bytes):
    """A body chunk after which the stream ends: it goes out with the end of the
    response in one write."""


class SseResponse(Response):
    """``text/event-stream`` from an async iterator of encoded chunks."""

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncIterator[bytes],
        *,
        ping_s: float,
        send_timeout_s: float,
        headers: dict[str, str] | None = None,
        there: Callable[[], Awaitable[bool]] | None = None,
        gone: bytes = b"",
    ) -> None:
        """``there``: asked when the stream is quiet, before each keep-alive; when it
        answers no (what the stream follows was deleted), ``gone`` is the last chunk
        sent and the response ends. A Redis error counts as yes (asked again next time)."""
        self.status_code = 200
        self.background = None
        self.body_iterator = body
        self.ping_s = ping_s
        self.send_timeout_s = send_timeout_s
        self.there = there
        self.gone = gone
        self.init_headers(
            {
                **(headers or {}),
                "cache-control": "no-store",
                "connection": "keep-alive",
                "x-accel-buffering": "no",
            }
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.body_iterator
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            if scope.get("method") == "HEAD":
                await send({"type": "http.response.body", "body": b""})
                return
            # The stream runs as a task of its own: each batch then resumes a few frames,
            # not the whole middleware stack's (a dozen more) under the request's task.
            stream = asyncio.get_running_loop().create_task(
                self._stream(body, receive, scope.get(RAW_SEND, send)), name="sse:stream"
            )
            await stream
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _stream(self, body: AsyncIterator[bytes], receive: Receive, send: Send) -> None:
        main = asyncio.current_task()
        assert main is not None
        state = _State()
        helper = asyncio.get_running_loop().create_task(
            self._watch(receive, send, main, state), name="sse:watch"
        )
        try:
            async for chunk in body:
                last = isinstance(chunk, LastChunk)
                state.sending_since = time.monotonic()
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                state.sending_since = 0.0
                state.last_send = time.monotonic()
                if last:
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            # Cancelled by the helper (the client left or stopped reading): a normal end.
            if state.let_go and main.uncancel() == 0:
                return
            raise
        except OSError:
            return  # the connection broke under a send
        finally:
            helper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await helper

    async def _watch(
        self, receive: Receive, send: Send, main: asyncio.Task[None], state: _State
    ) -> None:
        """Wait for the client to leave; ping a quiet stream; drop a client that reads nothing."""
        while True:
            try:
                async with asyncio.timeout(self.ping_s):
                    message = await receive()
            except TimeoutError:
                now = time.monotonic()
                if state.sending_since and now - state.sending_since > self.send_timeout_s:
                    log.info("SSE client let go: it took nothing for %.0f s", self.send_timeout_s)
                    state.let_go = True
                    main.cancel()
                    return
                if not state.sending_since and now - state.last_send >= self.ping_s * 0.9:
                    state.sending_since = now
                    if not await self._still_there():
                        with contextlib.suppress(OSError):
                            await send(
                                {
                                    "type": "http.response.body",
                                    "body": self.gone,
                                    "more_body": False,
                                }
                            )
                        state.let_go = True
                        main.cancel()
                        return
                    with contextlib.suppress(OSError):
                        await send(
                            {"type": "http.response.body", "body": _ping(), "more_body": True}
                        )
                    state.sending_since = 0.0
                    state.last_send = time.monotonic()
                continue
            if message["type"] == "http.disconnect":
                state.let_go = True
                main.cancel()
                return

    async def _still_there(self) -> bool:
        if self.there is None:
            return True
        try:
            return await self.there()
        except (RedisError, OSError, TimeoutError):
            return True


class _State:
    __slots__ = ("last_send", "let_go", "sending_since")

    def __init__(self) -> None:
        self.last_send = time.monotonic()
        self.sending_since = 0.0
        self.let_go = False


def _ping() -> bytes:
    return f": ping - {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\r\n\r\n".encode()

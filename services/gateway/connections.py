"""Bounds on what a client may hold: time to send a request, and connections per process.

uvicorn's httptools protocol closes an idle keep-alive connection
(``timeout_keep_alive``) but waits for ever on a request that arrives slowly: a
header block sent a byte at a time, a body trickled or cut short of its
``Content-Length``, a connection that never says anything. This protocol arms a
deadline for each phase a client controls:

- the header block must be complete within ``header_timeout_s`` of the
  connection opening (or of the request's first byte, on a kept-alive connection);
- the body must be complete within ``body_timeout_s`` of the headers.

Past either, the client is answered ``408 request_timeout`` and the connection
closed. The response phase is never bounded here: an SSE stream lasts as long as
it has events to send. A connection beyond ``max_connections`` is answered
``503 unavailable`` and closed at once, before it costs anything more.

Accepting: libuv (under uvloop) accepts one connection per event-loop pass and waits
for the next poll to accept another. Under load a pass takes milliseconds, so a burst
of new clients (a thousand users answering at once, every follower reconnecting after
a restart) waited in the kernel's queue, one pass each: tens of milliseconds before a
request was read. Each connection the server accepts now takes the ones queued behind
it, through a duplicate of the listening socket (:attr:`listeners`, set by the server
once it listens) handed to ``loop.connect_accepted_socket``, as asyncio's own loop
does.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, ClassVar

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from turnbus.gateway.schemas import ErrorBody, ErrorDetail

__all__ = ["GuardedHttpToolsProtocol", "guarded_protocol"]

log = logging.getLogger(__name__)

# The most connections one accepted connection takes from the queue behind it (each
# of those takes more in its turn): a bound on the event-loop pass it runs in.
ACCEPT_BATCH = 128
# The tasks that wrap accepted sockets, held until their connection is made.
_accepting: set[asyncio.Task[None]] = set()


def _raw_response(status: str, code: str, message: str, extra: bytes = b"") -> bytes:
    body = msgspec.json.encode(ErrorBody(error=ErrorDetail(code=code, message=message)))
    return (
        f"HTTP/1.1 {status}\r\n".encode()
        + b"content-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n".encode()
        + extra
        + b"connection: close\r\n\r\n"
        + body
    )


_HEADERS_TIMEOUT = _raw_response(
    "408 Request Timeout",
    "request_timeout",
    "the request's headers did not arrive in time; send the whole request promptly",
)
_BODY_TIMEOUT = _raw_response(
    "408 Request Timeout",
    "request_timeout",
    "the request's body did not arrive in time; send the whole body promptly",
)
_TOO_MANY = _raw_response(
    "503 Service Unavailable",
    "unavailable",
    "this gateway process has too many open connections; retry shortly",
    b"retry-after: 1\r\n",
)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header and body deadlines and a connection cap.

    Configure a subclass with :func:`guarded_protocol`; the class attributes here
    are the settings' defaults.
    """

    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 30.0
    max_connections: ClassVar[int] = 8192
    # Duplicates of the server's listening sockets (non-blocking), once it listens.
    listeners: ClassVar[tuple[socket.socket, ...]] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        # The phase's answer the armed deadline sends, and the one the request's phase
        # wants armed once the bytes at hand are parsed (None: no request under way).
        self._armed: bytes | None = None
        self._wanted: bytes | None = None

    def _arm(self, seconds: float, response: bytes) -> None:
        self._disarm()
        self._armed = response
        self._deadline = self.loop.call_later(seconds, self._expire, seconds, response)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
            self._armed = None

    def _settle(self) -> None:
        """Arm the deadline of the phase the request is in after the bytes at hand: a
        request that arrived whole (the usual case) arms and disarms nothing."""
        wanted = self._wanted
        if wanted is None or wanted is self._armed:
            return
        seconds = self.header_timeout_s if wanted is _HEADERS_TIMEOUT else self.body_timeout_s
        self._arm(seconds, wanted)

    def _expire(self, seconds: float, response: bytes) -> None:
        self._deadline = None
        self._armed = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if response is _HEADERS_TIMEOUT:
            if cycle is not None and not cycle.response_complete:
                # A pipelined request is arriving behind a response still on the wire
                # (an SSE stream): not ours to interrupt; look again later.
                self._arm(seconds, response)
                return
        elif cycle is not None and cycle.response_complete:
            # The app answered without the whole body (a 413): just stop listening.
            log.debug("closing a connection from %s: request timeout", self.client)
            self.transport.close()
            return
        elif cycle is not None:
            # The app is waiting on the body: it sees a disconnect and writes nothing.
            cycle.disconnected = True
            cycle.message_event.set()
        log.debug("closing a connection from %s: request timeout", self.client)
        self.transport.write(response)
        self.transport.close()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.debug("refusing a connection: %d open", len(self.connections))
            transport.write(_TOO_MANY)
            transport.close()
            return
        self._arm(self.header_timeout_s, _HEADERS_TIMEOUT)
        if self.listeners:
            self._accept_queued()

    def _accept_queued(self) -> None:
        """Take the connections queued behind this one, now rather than one per
        event-loop pass (the module's docstring). Nothing queued costs one ``accept``
        that finds none; a failure leaves the rest to the server's own accept."""
        for listener in self.listeners:
            for _ in range(ACCEPT_BATCH):
                try:
                    conn, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:  # out of descriptors, or the server closing
                    return
                conn.setblocking(False)
                task = self.loop.create_task(self._serve_accepted(conn))
                _accepting.add(task)
                task.add_done_callback(_accepting.discard)

    async def _serve_accepted(self, conn: socket.socket) -> None:
        def another() -> GuardedHttpToolsProtocol:
            return type(self)(self.config, self.server_state, self.app_state, _loop=self.loop)

        try:
            await self.loop.connect_accepted_socket(another, conn)
        except OSError:
            conn.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        try:
            super().data_received(data)
        finally:
            self._settle()

    # httptools parser callbacks: each notes the deadline its phase wants, armed once
    # the bytes at hand are parsed (_settle)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # A connection's first request keeps the deadline armed when it opened.
        self._wanted = _HEADERS_TIMEOUT

    def on_headers_complete(self) -> None:
        self._wanted = _BODY_TIMEOUT
        super().on_headers_complete()
        if self.cycle is not None:
            self.cycle.transport = _HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        self._wanted = None
        self._disarm()
        super().on_message_complete()


class _HeadWithBody:
    """A response cycle's transport whose first write (the response's head) waits, for
    the rest of this event-loop pass, for the first body bytes: a JSON answer, or an SSE
    stream's first events, then goes out in one write (one syscall here, one read at
    the client) instead of two. A head alone is sent at the end of the pass."""

    __slots__ = ("_first", "_flush", "_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._first = True
        self._held: bytes | None = None
        self._flush: asyncio.Handle | None = None

    def write(self, data: bytes) -> None:
        if self._held is not None:
            data = self._held + data
            self._held = None
            if self._flush is not None:
                self._flush.cancel()
                self._flush = None
        elif self._first:
            self._first = False
            self._held = data
            self._flush = self._loop.call_soon(self._send_held)
            return
        self._transport.write(data)

    def _send_held(self) -> None:
        self._flush = None
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._send_held()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def guarded_protocol(
    *, header_timeout_s: float, body_timeout_s: float, max_connections: int
) -> type[GuardedHttpToolsProtocol]:
    """A :class:`GuardedHttpToolsProtocol` class with these bounds, for ``uvicorn.Config(http=…)``."""
    return type(
        "GuardedHttpToolsProtocol",
        (GuardedHttpToolsProtocol,),
        {
            "header_timeout_s": header_timeout_s,
            "body_timeout_s": body_timeout_s,
            "max_connections": max_connections,
        },
    )

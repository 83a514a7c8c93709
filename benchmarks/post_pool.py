"""A minimal HTTP/1.1 client for the load generator's small JSON POSTs.

The pause scenario's answers are a fifth of its answer window's CPU when sent with
aiohttp (request building, URL handling, the connector, tracing): this client sends the
same request (method, path, the headers aiohttp sends, the same body bytes) from
prebuilt bytes over a keep-alive pool that opens a connection only when none is idle,
as aiohttp's does. It reads only ``Content-Length`` responses, as the gateway's JSON
answers are; anything else is a :class:`PostError`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast
from urllib.parse import urlsplit

from aiohttp.client_reqrep import ClientRequest
from aiohttp.http import SERVER_SOFTWARE

__all__ = ["PostError", "PostPool"]


class PostError(ConnectionError):
    """The connection closed before a whole answer, or the answer is not one this client
    reads."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time, its answer read whole."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = True
        self._buffer = bytearray()
        self._answer: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(PostError("connection closed before the answer"))

    def request(self, data: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self._answer = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self._answer

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0 or self._answer is None:
            return
        head = bytes(self._buffer[:end]).lower()
        length = -1
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip() == b"close":
                self.reusable = False
        if length < 0:
            self._fail("an answer without Content-Length")
            return
        if len(self._buffer) < end + 4 + length:
            return
        body = bytes(self._buffer[end + 4 : end + 4 + length])
        status = int(head[9:12])
        del self._buffer[: end + 4 + length]
        answer, self._answer = self._answer, None
        answer.set_result((status, body))

    def _fail(self, why: str) -> None:
        self.reusable = False
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(PostError(why))
        if self.transport is not None:
            self.transport.close()


class PostPool:
    """JSON POSTs to one ``http://host:port`` with the headers aiohttp's
    ``ClientSession(base_url, headers=headers).post(path, json=body)`` sends."""

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        url = urlsplit(base_url)
        self._host = url.hostname or "127.0.0.1"
        self._port = url.port or 80
        fixed = {
            "Host": url.netloc,
            **ClientRequest.DEFAULT_HEADERS,
            "User-Agent": SERVER_SOFTWARE,
            **headers,
            "Content-Type": "application/json",
        }
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")
        self._idle: list[_Connection] = []
        self.opened = 0  # connections opened: a POST that found none idle

    async def post_json(self, path: str, body: Any) -> tuple[int, bytes]:
        """POST ``body`` as JSON (``json.dumps``, as aiohttp encodes it) to ``path``;
        returns the answer's status and body."""
        payload = json.dumps(body).encode()
        data = b"".join(
            (
                b"POST %s HTTP/1.1\r\n" % path.encode(),
                self._head,
                b"Content-Length: %d\r\n\r\n" % len(payload),
                payload,
            )
        )
        connection = await self._take()
        try:
            answer = await connection.request(data)
        except BaseException:
            if connection.transport is not None:
                connection.transport.close()
            raise
        if connection.reusable and not connection.closed:
            self._idle.append(connection)
        elif connection.transport is not None:
            connection.transport.close()
        return answer

    async def _take(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection
        self.opened += 1
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(_Connection, self._host, self._port)
        return connection

    def close(self) -> None:
        for connection in self._idle:
            if connection.transport is not None:
                connection.transport.close()
        self._idle.clear()

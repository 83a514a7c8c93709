"""A fault-injecting TCP proxy between the project's clients and a test Redis.

Every connection made to :attr:`FaultProxy.port` is relayed to the target. The test
drives the faults:

- :meth:`reset`: every connection is cut at once (RST). With ``replies_lost=True``
  Redis's replies stop being relayed for a moment first, so the commands in flight ran
  on the server but their callers never hear back: the outcome-unknown case;
- :meth:`cut`: every connection is cut and new ones are refused, until :meth:`start`
  (Redis unreachable, the server itself untouched);
- :meth:`delay`: every chunk either way is held ``seconds`` before it is relayed (set
  to 0 to remove it);
- :meth:`stall`: the clients' requests are not read (their writes back up in their own
  sockets and transports) until ``stall(False)``: a reset then comes during a write.

The relay keeps order per direction: a chunk waits behind the chunks before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator

from tests.redis_server import free_port

__all__ = ["FaultProxy", "fault_proxy"]


class _Pair:
    """One client connection and its connection to the target."""

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream = upstream

    def abort(self) -> None:
        for writer in (self.client, self.upstream):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                # SO_LINGER 0: close sends RST, as a reset network path would.
                with contextlib.suppress(OSError, ValueError):  # ValueError: closed
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()


class FaultProxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = free_port()
        self.latency_s = 0.0
        self.resets = 0
        self._hold_replies = False
        self._requests_flow = asyncio.Event()
        self._requests_flow.set()
        self._server: asyncio.Server | None = None
        self._pairs: set[_Pair] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def connections(self) -> int:
        return len(self._pairs)

    async def start(self) -> None:
        """Listen (again, after :meth:`cut`) on :attr:`port`."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def cut(self) -> None:
        """Cut every connection and refuse new ones until :meth:`start`."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self._reset_all()

    async def close(self) -> None:
        await self.cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def delay(self, seconds: float) -> None:
        """Hold every chunk, either way, this long before relaying it (0: none)."""
        self.latency_s = seconds

    def stall(self, on: bool = True) -> None:
        """Stop reading the clients' requests (``False``: read them again)."""
        if on:
            self._requests_flow.clear()
        else:
            self._requests_flow.set()

    async def reset(self, *, replies_lost: bool = False, hold_s: float = 0.2) -> None:
        """Cut every connection. ``replies_lost``: first stop relaying replies for
        ``hold_s`` (commands still reach Redis and run), then cut: the replies of
        everything sent meanwhile are lost."""
        if replies_lost:
            self._hold_replies = True
            await asyncio.sleep(hold_s)
        self._reset_all()
        self._hold_replies = False

    def _reset_all(self) -> None:
        self.resets += 1
        for pair in list(self._pairs):
            pair.abort()
        self._pairs.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        pair = _Pair(writer, up_writer)
        self._pairs.add(pair)
        tasks = [
            asyncio.create_task(self._relay(reader, up_writer, pair, replies=False)),
            asyncio.create_task(self._relay(up_reader, writer, pair, replies=True)),
        ]
        self._tasks.update(tasks)
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._tasks.difference_update(tasks)
            self._pairs.discard(pair)
            pair.abort()

    async def _relay(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        pair: _Pair,
        *,
        replies: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        # Chunks in order, each with the time it may go: latency holds each chunk from
        # when it arrived, not one after another.
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def send() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                if replies and self._hold_replies:
                    continue  # lost: the connection is about to be cut
                dst.write(data)
                await dst.drain()

        sender = asyncio.create_task(send())
        try:
            with contextlib.suppress(OSError, ConnectionError):
                while (replies or await self._requests_flow.wait()) and (
                    data := await src.read(65536)
                ):
                    if replies and self._hold_replies:
                        continue
                    queue.put_nowait((loop.time() + self.latency_s, data))
            queue.put_nowait(None)
            with contextlib.suppress(OSError, ConnectionError):
                await sender
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError, ConnectionError):
                await sender
            pair.abort()


@contextlib.asynccontextmanager
async def fault_proxy(redis_url: str) -> AsyncIterator[FaultProxy]:
    """A started :class:`FaultProxy` in front of the Redis at ``redis_url``."""
    hostport = redis_url.split("://", 1)[1].split("/", 1)[0]
    host, port = hostport.rsplit(":", 1)
    proxy = FaultProxy(host, int(port))
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()

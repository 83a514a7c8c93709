"""A fault-injecting TCP proxy between the project's clients and a test Redis.

Every connection made to :attr:`FaultProxy.port` is relayed to the target. The test
drives the faults:

- :meth:`reset`: every connection is cut at once (RST). With ``replies_lost=True``
  Redis's replies stop being relayed for a moment first, so the commands in flight ran
  on the server but their callers never hear back: the outcome-unknown case;
- :meth:`cut`: every connection is cut and new ones are refused, until :meth:`start`
  (Redis unreachable, the server itself untouched);
- :meth:`delay`: every chunk either way (``replies_only``: every reply) is held
  ``seconds`` before it is relayed (set to 0 to remove it);
- :meth:`stall`: the clients' requests are not read (their writes back up in their own
  sockets and transports) until ``stall(False)``: a reset then comes during a write.

The relay keeps order per direction: a chunk waits behind the chunks before it.

:class:`FaultProxyProcess` runs one in a process of its own (``python -m
harness.fault_proxy``), driven by lines on its stdin, so that a benchmark's relay is not
the measured process's work.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator

from harness.redis_server import free_port

__all__ = ["FaultProxy", "FaultProxyProcess", "fault_proxy"]


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
        self._replies_only = False
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

    def delay(self, seconds: float, *, replies_only: bool = False) -> None:
        """Hold every chunk, either way (``replies_only``: only Redis's), this long before
        relaying it (0: none)."""
        self.latency_s = seconds
        self._replies_only = replies_only

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
                    held = self.latency_s if replies or not self._replies_only else 0.0
                    queue.put_nowait((loop.time() + held, data))
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


class FaultProxyProcess:
    """A :class:`FaultProxy` in a child process (on uvloop) in front of ``host:port``;
    each method is one command, answered once the child has done it."""

    def __init__(self, host: str, port: int) -> None:
        self._child = subprocess.Popen(
            [sys.executable, "-m", "harness.fault_proxy", "--target", f"{host}:{port}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.port = int(json.loads(self._read())["port"])

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def delay(self, seconds: float, *, replies_only: bool = False) -> None:
        self._command(f"delay {seconds} {int(replies_only)}")

    def reset(self, *, replies_lost: bool = False, hold_s: float = 0.2) -> None:
        self._command(f"reset {int(replies_lost)} {hold_s}")

    def close(self) -> None:
        if self._child.poll() is None:
            self._command("quit")
            self._child.wait(10)

    def __enter__(self) -> FaultProxyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            if self._child.poll() is None:
                self._child.kill()
                self._child.wait()

    def _command(self, line: str) -> None:
        assert self._child.stdin is not None
        self._child.stdin.write(line + "\n")
        self._child.stdin.flush()
        answer = self._read()
        if answer != "ok":
            raise RuntimeError(f"fault proxy: {line!r} answered {answer!r}")

    def _read(self) -> str:
        assert self._child.stdout is not None
        line = self._child.stdout.readline()
        if not line:
            raise RuntimeError(f"the fault proxy exited ({self._child.poll()})")
        return line.strip()


async def _serve_commands(target: str) -> None:
    """The child of :class:`FaultProxyProcess`: its port on stdout, then one command a
    line on stdin (``delay S REPLIES_ONLY``, ``reset LOST HOLD_S``, ``quit``), each
    answered ``ok``."""
    async with fault_proxy(f"redis://{target}/0") as proxy:
        print(json.dumps({"port": proxy.port}), flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command, *args = line.split()
            if command == "delay":
                proxy.delay(float(args[0]), replies_only=args[1] == "1")
            elif command == "reset":
                await proxy.reset(replies_lost=args[0] == "1", hold_s=float(args[1]))
            elif command == "quit":
                print("ok", flush=True)
                return
            print("ok", flush=True)


def main() -> None:
    import uvloop

    parser = argparse.ArgumentParser(description="the fault proxy, as a process")
    parser.add_argument("--target", required=True, help="host:port of the Redis to relay to")
    uvloop.run(_serve_commands(parser.parse_args().target))


if __name__ == "__main__":
    main()

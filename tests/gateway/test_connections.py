"""Slow and silent clients: header and body deadlines, the connection cap, SSE left alone."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import resource
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis
import uvloop

from harness.redis_server import free_port
from tests.gateway_server import LiveGateway, QuietServer, live_gateway, wait_for
from turnbus.gateway.auth import mint_token
from turnbus.gateway.server import RESERVED_FDS, connection_cap, make_server
from turnbus.shared.settings import Settings

# Far beyond the bounds under test, so a connection still open at this point was not bounded.
DEADLINE_S = 15


@pytest.fixture
def fast(settings: Settings) -> Settings:
    return dataclasses.replace(settings, header_timeout_ms=300, body_timeout_ms=300, sse_ping_s=1)


@pytest.fixture
async def slow_gw(fast: Settings, redis: aioredis.Redis) -> AsyncIterator[LiveGateway]:
    async with live_gateway(fast) as live:
        yield live


@contextlib.asynccontextmanager
async def _connection(
    gw: LiveGateway,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _closed_with(reader: asyncio.StreamReader) -> tuple[int, dict[str, object]]:
    """Read until the server closes; the last response's status and JSON error body."""
    raw = await asyncio.wait_for(reader.read(), DEADLINE_S)
    assert raw, "the server closed without an answer"
    head, _, body = raw.rpartition(b"HTTP/1.1 ")[2].partition(b"\r\n\r\n")
    status = int(head.split(b" ", 1)[0])
    assert b"connection: close" in head.lower()
    return status, json.loads(body)


async def _trickle(
    writer: asyncio.StreamWriter, reader: asyncio.StreamReader, chunk: bytes
) -> None:
    """Send ``chunk`` every 50 ms, as a slow client does, until the server hangs up."""
    for _ in range(DEADLINE_S * 20):
        if reader.at_eof() or writer.is_closing():
            return
        try:
            writer.write(chunk)
            await writer.drain()
        except (ConnectionError, OSError):
            return
        await asyncio.sleep(0.05)


def _auth(settings: Settings) -> bytes:
    assert settings.jwt_secret
    return f"Authorization: Bearer {mint_token(settings.jwt_secret, 'alice')}\r\n".encode()


@pytest.mark.timeout(30)
async def test_a_silent_connection_is_closed_with_a_408(slow_gw: LiveGateway) -> None:
    async with _connection(slow_gw) as (reader, _):
        status, body = await _closed_with(reader)
    assert status == 408
    assert body["error"]["code"] == "request_timeout"  # type: ignore[index]


@pytest.mark.timeout(30)
async def test_headers_sent_a_byte_at_a_time_are_cut_off(slow_gw: LiveGateway) -> None:
    async with _connection(slow_gw) as (reader, writer):
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        trickle = asyncio.create_task(_trickle(writer, reader, b"x"))
        status, body = await _closed_with(reader)
        await trickle
    assert status == 408
    assert "headers" in body["error"]["message"]  # type: ignore[index]


@pytest.mark.timeout(30)
async def test_the_header_deadline_applies_to_each_request_of_a_kept_alive_connection(
    slow_gw: LiveGateway,
) -> None:
    async with _connection(slow_gw) as (reader, writer):
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        first = await asyncio.wait_for(reader.readuntil(b'{"status":"ok"}'), DEADLINE_S)
        assert first.startswith(b"HTTP/1.1 200")
        writer.write(b"GET /healthz HTTP/1.1\r\n")
        trickle = asyncio.create_task(_trickle(writer, reader, b"X-Slow: 1\r\n"))
        status, _ = await _closed_with(reader)
        await trickle
    assert status == 408


@pytest.mark.timeout(30)
async def test_a_trickled_body_is_cut_off(slow_gw: LiveGateway, fast: Settings) -> None:
    async with _connection(slow_gw) as (reader, writer):
        writer.write(
            b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\n"
            + _auth(fast)
            + b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
        )
        trickle = asyncio.create_task(_trickle(writer, reader, b" "))
        status, body = await _closed_with(reader)
        await trickle
    assert status == 408
    assert "body" in body["error"]["message"]  # type: ignore[index]


@pytest.mark.timeout(30)
async def test_a_body_short_of_its_content_length_is_cut_off(
    slow_gw: LiveGateway, fast: Settings, redis: aioredis.Redis
) -> None:
    async with _connection(slow_gw) as (reader, writer):
        writer.write(
            b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\n"
            + _auth(fast)
            + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{}"
        )
        status, body = await _closed_with(reader)
    assert status == 408
    assert body["error"]["code"] == "request_timeout"  # type: ignore[index]
    # The half-sent request created nothing.
    assert [k async for k in redis.scan_iter(match=f"{fast.prefix}:*")] == []


@pytest.mark.timeout(30)
async def test_healthz_answers_while_slow_clients_hold_connections(slow_gw: LiveGateway) -> None:
    async with contextlib.AsyncExitStack() as stack:
        readers = []
        for _ in range(50):
            reader, writer = await stack.enter_async_context(_connection(slow_gw))
            writer.write(b"GET /healthz HTTP/1.1\r\n")
            readers.append(reader)
        async with httpx.AsyncClient(base_url=slow_gw.base_url, timeout=10) as http:
            assert (await http.get("/healthz")).status_code == 200
        for reader in readers:
            status, _ = await _closed_with(reader)
            assert status == 408
    await wait_for(
        lambda: len(slow_gw.server.server_state.connections) == 0,
        what="every slow connection to be gone",
    )


@pytest.mark.timeout(30)
async def test_connections_past_the_cap_are_refused_with_a_503(
    settings: Settings, redis: aioredis.Redis
) -> None:
    capped = dataclasses.replace(settings, max_connections=5)
    async with live_gateway(capped) as gw, contextlib.AsyncExitStack() as stack:
        held = [await stack.enter_async_context(_connection(gw)) for _ in range(5)]
        await wait_for(
            lambda: len(gw.server.server_state.connections) == 5, what="5 open connections"
        )
        async with _connection(gw) as (reader, _):
            status, body = await _closed_with(reader)
        assert status == 503
        assert body["error"]["code"] == "unavailable"  # type: ignore[index]
        # Those within the cap are served.
        reader, writer = held[0]
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.readuntil(b'{"status":"ok"}'), DEADLINE_S)
        assert answer.startswith(b"HTTP/1.1 200")


@pytest.mark.timeout(30)
async def test_an_sse_stream_outlives_the_request_deadlines(
    slow_gw: LiveGateway, fast: Settings
) -> None:
    assert fast.jwt_secret
    headers = {"Authorization": f"Bearer {mint_token(fast.jwt_secret, 'alice')}"}
    async with httpx.AsyncClient(base_url=slow_gw.base_url, headers=headers, timeout=10) as http:
        sid = (await http.post("/v1/sessions")).json()["sessionId"]
        async with http.stream("GET", f"/v1/sessions/{sid}/events") as resp:
            assert resp.status_code == 200
            pings = 0
            async for line in resp.aiter_lines():
                if line.startswith(":"):
                    pings += 1
                # Three pings a second apart: ten times the header and body deadlines.
                if pings == 3:
                    break
        assert pings == 3
        # A follow-up request on a fresh connection is still served.
        assert (await http.get(f"/v1/sessions/{sid}")).status_code == 200


def test_the_connection_cap_fits_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    assert connection_cap(8192) == 1024 - RESERVED_FDS
    assert connection_cap(500) == 500
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY,) * 2)
    assert connection_cap(8192) == 8192


class _Recorder:
    """A transport that records each write (one write is one send to the client)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


async def test_a_response_head_goes_out_with_its_first_body_bytes() -> None:
    from turnbus.gateway.connections import _HeadWithBody

    loop = asyncio.get_running_loop()
    sent = _Recorder()
    cycle = _HeadWithBody(sent, loop)  # type: ignore[arg-type]
    cycle.write(b"HTTP/1.1 200 OK\r\n\r\n")
    cycle.write(b"event one")
    cycle.write(b"event two")
    assert sent.writes == [b"HTTP/1.1 200 OK\r\n\r\nevent one", b"event two"]

    # A head with no body yet (a quiet stream) is sent when the event-loop pass ends.
    sent = _Recorder()
    cycle = _HeadWithBody(sent, loop)  # type: ignore[arg-type]
    cycle.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert sent.writes == []
    await asyncio.sleep(0)
    assert sent.writes == [b"HTTP/1.1 200 OK\r\n\r\n"]

    # Closing sends what is held first.
    sent = _Recorder()
    cycle = _HeadWithBody(sent, loop)  # type: ignore[arg-type]
    cycle.write(b"HTTP/1.1 204 No Content\r\n\r\n")
    cycle.close()
    assert sent.writes == [b"HTTP/1.1 204 No Content\r\n\r\n"] and sent.closed


def test_a_burst_of_new_connections_is_accepted_in_a_few_event_loop_passes(
    settings: Settings,
) -> None:
    """Under uvloop (as the gateway runs), libuv accepts one connection per event-loop
    pass: 200 clients arriving at once would wait up to 200 passes, each milliseconds
    long under load. The gateway takes the queued ones with the first."""
    burst = 200

    async def main() -> tuple[int, int]:
        port = free_port()
        base = make_server(settings, "127.0.0.1", port, lifespan="off", log_config=None)
        server = QuietServer(base.config)
        serving = asyncio.create_task(server.serve())
        await wait_for(lambda: server.started or serving.done(), what="the gateway to start")
        loop = asyncio.get_running_loop()
        passes = 0

        def count() -> None:
            nonlocal passes
            passes += 1
            if len(server.server_state.connections) < burst and passes < 10_000:
                loop.call_soon(count)

        clients = []
        for _ in range(burst):
            client = socket.socket()
            client.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                client.connect(("127.0.0.1", port))
            clients.append(client)
        loop.call_soon(count)
        await wait_for(lambda: len(server.server_state.connections) >= burst)
        accepted = len(server.server_state.connections)
        for client in clients:
            client.close()
        server.should_exit = True
        await asyncio.wait_for(serving, DEADLINE_S)
        return accepted, passes

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        accepted, passes = runner.run(main())
    assert accepted == burst
    assert passes < 50, passes  # one per pass would be at least 200


async def test_the_gateway_stops_listening_when_it_shuts_down(settings: Settings) -> None:
    """The duplicate listening socket closes with the server's: nothing is left to take
    a connection no one will serve."""
    base = make_server(settings, "127.0.0.1", free_port(), lifespan="off", log_config=None)
    server = QuietServer(base.config)
    serving = asyncio.create_task(server.serve())
    await wait_for(lambda: server.started or serving.done(), what="the gateway to start")
    port = base.config.port
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.close()
    server.should_exit = True
    await asyncio.wait_for(serving, DEADLINE_S)
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)

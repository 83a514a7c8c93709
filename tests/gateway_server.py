"""A live gateway (uvicorn) on a free loopback port, served from the test's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette

from harness.redis_server import free_port
from harness.waits import poll
from turnbus.gateway.auth import mint_token
from turnbus.gateway.server import GatewayServer, make_server
from turnbus.gateway.state import Gateway
from turnbus.shared.settings import Settings
from turnbus.sse import SseMessage, aiter_sse


class QuietServer(GatewayServer):
    """Leaves the test process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class LiveGateway:
    def __init__(self, server: uvicorn.Server, port: int) -> None:
        self.server = server
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"

    @property
    def app(self) -> Starlette:
        app = self.server.config.app
        assert isinstance(app, Starlette)
        return app

    @property
    def gateway(self) -> Gateway:
        gateway: Gateway = self.app.state.gateway
        return gateway


async def wait_for(
    condition: Callable[[], bool | Awaitable[bool]], deadline_s: float = 10.0, what: str = ""
) -> None:
    """Poll ``condition`` until true, failing after ``deadline_s`` seconds."""
    await poll(condition, within=deadline_s, what=what)


@contextlib.asynccontextmanager
async def live_gateway(
    settings: Settings, *, port: int | None = None, **overrides: Any
) -> AsyncIterator[LiveGateway]:
    port = port or free_port()
    options: dict[str, Any] = {"log_config": None, "log_level": "warning"}
    options.update(overrides)
    base = make_server(settings, "127.0.0.1", port, **options)
    server = QuietServer(base.config)
    task = asyncio.create_task(server.serve())
    try:
        await wait_for(lambda: server.started or task.done(), what="the gateway to start")
        if task.done():
            task.result()
            raise AssertionError("the gateway exited during startup")
        yield LiveGateway(server, port)
    finally:
        gateway = getattr(server.config.app.state, "gateway", None)
        if gateway is not None:
            gateway.hub.drain()  # what a SIGTERM does: open streams end cleanly
        server.should_exit = True
        await asyncio.wait_for(task, timeout=20)


@contextlib.asynccontextmanager
async def signed_in(
    gw: LiveGateway, settings: Settings, user: str = "alice"
) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of ``gw`` carrying ``user``'s token."""
    assert settings.jwt_secret
    headers = {"Authorization": f"Bearer {mint_token(settings.jwt_secret, user)}"}
    async with httpx.AsyncClient(base_url=gw.base_url, headers=headers, timeout=10) as client:
        yield client


# The one SSE parser (turnbus.sse), under the names the tests use.
SseEvent = SseMessage


def sse_events(lines: AsyncIterable[str]) -> AsyncIterator[SseMessage]:
    """Parse SSE lines into events (comments, i.e. pings, are skipped)."""
    return aiter_sse(lines)


async def session_and_turn(http: httpx.AsyncClient) -> tuple[str, str]:
    """A new session and one submitted turn ("hi"): their ids."""
    sid = (await http.post("/v1/sessions")).json()["sessionId"]
    tid = (await http.post(f"/v1/sessions/{sid}/turns", json={"message": "hi"})).json()["turnId"]
    return sid, tid


class Reader:
    """One SSE client collecting events in the background until the server closes.
    With ``expect``, a response of another status fails the reader. With ``json``, the
    request is a POST of that body (a submit that asks for the stream)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        url: str,
        headers: dict[str, str] | None = None,
        *,
        expect: int | None = None,
        json: Any = None,
    ) -> None:
        self.events: list[SseEvent] = []
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.task = asyncio.create_task(self._run(http, url, headers or {}, expect, json))

    async def _run(
        self,
        http: httpx.AsyncClient,
        url: str,
        headers: dict[str, str],
        expect: int | None,
        json: Any,
    ) -> None:
        method = "GET" if json is None else "POST"
        async with http.stream(method, url, headers=headers, json=json) as resp:
            self.status = resp.status_code
            self.headers = resp.headers
            assert expect is None or resp.status_code == expect, resp.status_code
            async for event in sse_events(resp.aiter_lines()):
                self.events.append(event)

    async def count(self, n: int) -> None:
        await wait_for(lambda: len(self.events) >= n or self.task.done(), what=f"{n} events")
        if self.task.done():
            self.task.result()

    async def closed(self) -> list[SseEvent]:
        await asyncio.wait_for(self.task, 10)
        return self.events

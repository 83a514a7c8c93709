"""A live gateway (uvicorn) on a free loopback port, served from the test's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from gateway.server import make_server
from gateway.state import Gateway
from starlette.applications import Starlette

from shared.settings import Settings
from tests.redis_server import free_port


class _QuietServer(uvicorn.Server):
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
    deadline = time.monotonic() + deadline_s
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def live_gateway(settings: Settings, **overrides: Any) -> AsyncIterator[LiveGateway]:
    port = free_port()
    options: dict[str, Any] = {"log_config": None, "log_level": "warning"}
    options.update(overrides)
    base = make_server(settings, "127.0.0.1", port, **options)
    server = _QuietServer(base.config)
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


class SseEvent:
    __slots__ = ("data", "event", "id")

    def __init__(self, event: str, data: str, id: str | None) -> None:
        self.event = event
        self.data = data
        self.id = id

    def json(self) -> Any:
        return json.loads(self.data)

    def __repr__(self) -> str:
        return f"SseEvent({self.event!r}, id={self.id!r})"


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[SseEvent]:
    """Parse SSE lines into events (comments, i.e. pings, are skipped)."""
    event, data, ident = "message", [], None
    async for line in lines:
        if line == "":
            if data:
                yield SseEvent(event, "\n".join(data), ident)
            event, data, ident = "message", [], None
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id":
            ident = value

"""Admission: the gateway works on at most TURNBUS_GATEWAY_ADMIT requests at once before
answering them; the others wait their turn, and an open stream holds no place."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from tests.gateway_server import live_gateway, signed_in, wait_for
from turnbus.gateway.admission import Admission
from turnbus.gateway.metrics import GatewayMetrics
from turnbus.shared.settings import Settings


class _App:
    """An ASGI app whose requests do what the test tells them, by path."""

    def __init__(self) -> None:
        self.entered: dict[str, asyncio.Event] = {}
        self.go: dict[str, asyncio.Event] = {}

    def request(self, path: str) -> None:
        self.entered[path] = asyncio.Event()
        self.go[path] = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        self.entered[path].set()
        if path.startswith("/fail"):
            raise RuntimeError("the handler failed")
        if path.startswith("/stream"):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await self.go[path].wait()
        else:
            await self.go[path].wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _scope(path: str) -> Scope:
    return {"type": "http", "path": path, "method": "GET", "headers": []}


async def _run(gate: Admission, path: str) -> None:
    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        return None

    await gate(_scope(path), receive, send)


def _waiting(metrics: GatewayMetrics) -> float:
    return float(metrics.admission_waiting._value.get())


async def test_a_request_waits_until_the_one_in_progress_is_answered() -> None:
    app, metrics = _App(), GatewayMetrics()
    gate = Admission(app, limit=1, metrics=metrics)
    for path in ("/a", "/b"):
        app.request(path)
    first = asyncio.create_task(_run(gate, "/a"))
    await asyncio.wait_for(app.entered["/a"].wait(), 5)
    second = asyncio.create_task(_run(gate, "/b"))
    await wait_for(lambda: _waiting(metrics) == 1, 5, "the second request to wait")
    assert not app.entered["/b"].is_set()

    app.go["/a"].set()  # the first is answered: the second goes in
    await asyncio.wait_for(app.entered["/b"].wait(), 5)
    app.go["/b"].set()
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert _waiting(metrics) == 0
    assert metrics.admission_waits._value.get() == 1


async def test_an_open_stream_and_a_failed_request_hold_no_place() -> None:
    app, metrics = _App(), GatewayMetrics()
    gate = Admission(app, limit=1, metrics=metrics)
    for path in ("/stream", "/fail", "/after"):
        app.request(path)
    stream = asyncio.create_task(_run(gate, "/stream"))
    await asyncio.wait_for(app.entered["/stream"].wait(), 5)
    # The stream answered (its body goes on): the next request is let in at once.
    failed = asyncio.create_task(_run(gate, "/fail"))
    await asyncio.wait_for(app.entered["/fail"].wait(), 5)
    await asyncio.wait_for(asyncio.gather(failed, return_exceptions=True), 5)
    assert isinstance(failed.exception(), RuntimeError)
    # The failed request gave its place back.
    after = asyncio.create_task(_run(gate, "/after"))
    await asyncio.wait_for(app.entered["/after"].wait(), 5)
    app.go["/after"].set()
    app.go["/stream"].set()
    await asyncio.wait_for(asyncio.gather(stream, after), 5)
    assert metrics.admission_waits._value.get() == 0


async def test_a_gateway_admitting_one_request_at_once_serves_a_crowd(settings: Settings) -> None:
    settings = dataclasses.replace(settings, gateway_admit=1)
    async with live_gateway(settings) as gw, signed_in(gw, settings) as http:
        sid = (await http.post("/v1/sessions", json={})).json()["sessionId"]
        # A turn nobody runs: its event stream stays open for the whole test.
        body: dict[str, Any] = {"message": "hello"}
        async with http.stream(
            "POST", f"/v1/sessions/{sid}/turns", json=body, headers={"Accept": "text/event-stream"}
        ) as stream:
            assert stream.status_code == 200
            answers = await asyncio.gather(*(http.post("/v1/sessions", json={}) for _ in range(20)))
        assert [r.status_code for r in answers] == [201] * 20
        text = (await http.get("/metrics")).text
    assert "turnbus_gateway_admission_waits_total" in text

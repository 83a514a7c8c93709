"""Admission: how many requests the gateway works on at once before it answers them.

A thousand submits that land together would otherwise all be parsed, authenticated and
sent to Redis in the same few event-loop passes, each hundreds of milliseconds long;
the open SSE streams' events would wait behind them, and so would every answer. The
gate lets at most ``limit`` requests run from arrival to the start of their answer; the
others wait their turn, first come first served. A request leaves the gate when its
answer starts: an SSE stream holds no place for its whole life.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from turnbus.gateway.metrics import GatewayMetrics

__all__ = ["Admission"]


class Admission:
    """Pure ASGI wrapper: at most ``limit`` HTTP requests between arrival and answer."""

    def __init__(self, app: ASGIApp, limit: int, metrics: GatewayMetrics) -> None:
        self.app = app
        self.limit = limit
        self._gate = asyncio.Semaphore(limit)
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gate = self._gate
        if gate.locked():
            self._metrics.admission_waits.inc()
            self._metrics.admission_waiting.inc()
            try:
                await gate.acquire()
            finally:
                self._metrics.admission_waiting.dec()
        else:
            await gate.acquire()
        held = True

        async def answer(message: Message) -> None:
            nonlocal held
            if held and message["type"] == "http.response.start":
                held = False
                gate.release()
            await send(message)

        try:
            await self.app(scope, receive, answer)
        finally:
            if held:
                gate.release()

"""A webhook receiver for the tests: a real aiohttp server on a local port, the
verification recipe of docs/operations.md, and a webhook secret."""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from turnbus.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
SECRET = "whsec_" + base64.b64encode(b"turnbus-test-webhook-key-32-byte").decode()


def documented_recipe() -> Callable[..., None]:
    """``verify_webhook`` exactly as docs/operations.md writes it."""
    text = (ROOT / "docs/operations.md").read_text()
    match = re.search(r"```python\n(# verify_webhook:.*?)```", text, re.DOTALL)
    assert match, "docs/operations.md has no verify_webhook recipe"
    scope: dict[str, Any] = {}
    exec(match.group(1), scope)
    verify: Callable[..., None] = scope["verify_webhook"]
    return verify


class Receiver:
    """POSTs to ``/hook`` are kept as ``(headers, body)``. ``status``: the answer;
    ``hang``: hold each request until :meth:`close` (a receiver that never answers)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.status = 200
        self.hang = False
        self._release = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def stop(self) -> None:
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._release = asyncio.Event()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests.append(({k.lower(): v for k, v in request.headers.items()}, body))
        if self.hang:
            await self._release.wait()
        return web.Response(status=self.status)

    def ids(self) -> list[str]:
        return [headers["webhook-id"] for headers, _ in self.requests]

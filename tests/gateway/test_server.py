"""``gateway.server.serve`` in a real process: uvloop + httptools, redacted access log, SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys

import httpx
import pytest
import redis.asyncio as aioredis

from harness.redis_server import free_port
from tests.gateway_server import live_gateway, wait_for
from turnbus.gateway.auth import mint_token
from turnbus.shared.settings import Settings

_SERVE = (
    "import sys\n"
    "from turnbus.shared.settings import Settings\n"
    "from turnbus.gateway.server import serve\n"
    "serve(Settings.from_env(), '127.0.0.1', int(sys.argv[1]))\n"
)


@pytest.mark.timeout(60)
async def test_serve_redacts_tokens_and_drains_on_sigterm(
    settings: Settings, redis: aioredis.Redis
) -> None:
    assert settings.jwt_secret
    port = free_port()
    env = {
        **os.environ,
        "TURNBUS_REDIS_URL": settings.redis_url,
        "TURNBUS_PREFIX": settings.prefix,
        "TURNBUS_JWT_SECRET": settings.jwt_secret,
        "TURNBUS_ACCESS_LOG": "1",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _SERVE,
        str(port),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    token = mint_token(settings.jwt_secret, "alice")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:

            async def up() -> bool:
                try:
                    return (await http.get("/healthz")).status_code == 200
                except httpx.TransportError:
                    assert proc.returncode is None, "the gateway exited"
                    return False

            await wait_for(up, deadline_s=30, what="the gateway process")
            headers = {"Authorization": f"Bearer {token}"}
            sid = (await http.post("/v1/sessions", headers=headers)).json()["sessionId"]
            url = f"/v1/sessions/{sid}/events"
            async with http.stream("GET", url, params={"access_token": token}) as resp:
                assert resp.status_code == 200
                lines = resp.aiter_lines()
                assert (await anext(lines)).startswith("id: ")
                proc.send_signal(signal.SIGTERM)
                # The open stream ends cleanly, with a last event saying why.
                rest = [line async for line in lines]
                assert "event: stream.dropped" in rest
                assert any('"reason":"shutdown"' in line for line in rest)
        returncode = await asyncio.wait_for(proc.wait(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        assert proc.stdout is not None
        output = (await proc.stdout.read()).decode()
    # uvicorn re-raises the signal it handled once it has shut down cleanly.
    assert returncode in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output
    assert f"/v1/sessions/{sid}/events?access_token=***" in output
    assert token not in output


_SERVER_LOGGERS = ("uvicorn", "gateway", "shared", "starlette")


@pytest.mark.timeout(30)
async def test_no_log_line_per_request_unless_the_access_log_is_on(
    settings: Settings, redis: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    assert settings.jwt_secret
    headers = {"Authorization": f"Bearer {mint_token(settings.jwt_secret, 'alice')}"}
    # uvicorn turns the access logger off in place (no handlers, no propagation).
    access_logger = logging.getLogger("uvicorn.access")
    saved = access_logger.handlers[:], access_logger.propagate
    for access_log, expected in ((True, 3), (False, 0)):
        access_logger.handlers, access_logger.propagate = [], True
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            live = live_gateway(
                dataclasses.replace(settings, access_log=access_log), log_level="info"
            )
            async with live as gw:
                async with httpx.AsyncClient(base_url=gw.base_url, headers=headers) as http:
                    sid = (await http.post("/v1/sessions")).json()["sessionId"]
                    assert (await http.get(f"/v1/sessions/{sid}")).status_code == 200
                    assert (await http.get("/healthz")).status_code == 200
                # What the server logged about them, at INFO or above.
                lines = [
                    r
                    for r in caplog.records
                    if r.levelno >= logging.INFO and r.name.split(".")[0] in _SERVER_LOGGERS
                ]
        access = [r for r in lines if r.name == "uvicorn.access"]
        assert len(access) == expected, [r.getMessage() for r in access]
        others = [r.getMessage() for r in lines if r.name != "uvicorn.access"]
        assert not [m for m in others if "/v1/sessions" in m or "healthz" in m], others
    access_logger.handlers, access_logger.propagate = saved

"""``gateway.server.serve`` in a real process: uvloop + httptools, redacted access log, SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import httpx
import pytest
import redis.asyncio as aioredis
from gateway.auth import mint_token

from shared.settings import Settings
from tests.gateway_server import wait_for
from tests.redis_server import free_port

_SERVE = (
    "import sys\n"
    "from shared.settings import Settings\n"
    "from gateway.server import serve\n"
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

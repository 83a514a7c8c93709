"""``GET /v1/tools`` and the ``allowedTools`` check: the gateway reads what the workers
registered from Redis (routes/tools.py), the only thing the two share."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import redis.asyncio as aioredis

from tests.gateway.test_auth import _bearer, _encode
from tests.gateway_server import LiveGateway
from tests.worker.test_pipeline import sample_registry
from turnbus.cli import main
from turnbus.client import AsyncClient
from turnbus.gateway.auth import mint_token
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings


async def test_the_tools_list_is_what_the_workers_registered(
    http: httpx.AsyncClient, redis: aioredis.Redis, keys: Keys
) -> None:
    registry = sample_registry()
    await registry.start()
    await registry.publish(redis, keys, "w-tools")
    tools = (await http.get("/v1/tools")).json()["tools"]
    names = [t["name"] for t in tools]
    assert names[:3] == ["working_notes_clear", "working_notes_get", "working_notes_update"]
    assert names[3:] == sorted(names[3:]) and "lookup" in names
    lookup = next(t for t in tools if t["name"] == "lookup")
    assert lookup["source"] == "python" and lookup["idempotent"] is True
    assert lookup["inputSchema"]["required"] == ["term"]
    charge = next(t for t in tools if t["name"] == "charge")
    assert charge["idempotent"] is False
    assert (await http.get("/v1/tools", headers={"authorization": ""})).status_code == 401
    # A worker that leaves takes its tools with it.
    await redis.hdel(keys.tools(), "w-tools")
    assert (await http.get("/v1/tools")).json()["tools"] == []


async def test_allowed_tools_must_name_registered_tools(
    http: httpx.AsyncClient, redis: aioredis.Redis, keys: Keys
) -> None:
    registry = sample_registry()
    await registry.start()
    await registry.publish(redis, keys, "w-tools")
    try:
        allowed = json.dumps(["lookup", "working_notes_get"])
        r = await http.post("/v1/sessions", json={"meta": {"allowedTools": allowed}})
        assert r.status_code == 201, r.text
        session = r.json()
        url = f"/v1/sessions/{session['sessionId']}/meta"
        bad = {
            "updatedAt": session["updatedAt"] + 1,
            "meta": {"allowedTools": '["lookup", "nope"]'},
        }
        r = await http.put(url, json=bad)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "unknown_tool" and "'nope'" in error["message"]
        assert error["field"] == "meta.allowedTools"
        r = await http.put(url, json={**bad, "meta": {"allowedTools": "lookup"}})
        assert r.status_code == 422 and r.json()["error"]["code"] == "unprocessable"
        # Nothing changed.
        got = (await http.get(f"/v1/sessions/{session['sessionId']}")).json()
        assert got["meta"]["allowedTools"] == allowed and got["updatedAt"] == session["updatedAt"]
        r = await http.post("/v1/sessions", json={"meta": {"allowedTools": '["ghost"]'}})
        assert r.status_code == 422 and "'ghost'" in r.json()["error"]["message"]
    finally:
        await redis.hdel(keys.tools(), "w-tools")


async def test_the_client_and_turnbus_tools_print_the_list(
    gw: LiveGateway,
    settings: Settings,
    redis: aioredis.Redis,
    keys: Keys,
    capsys: pytest.CaptureFixture[str],
) -> None:
    registry = sample_registry()
    await registry.start()
    await registry.publish(redis, keys, "w-tools")
    assert settings.jwt_secret is not None
    token = mint_token(settings.jwt_secret, "alice", 600)
    try:
        async with AsyncClient(gw.base_url, token) as client:
            tools = await client.tools()
        assert [t.name for t in tools][:3] == [
            "working_notes_clear",
            "working_notes_get",
            "working_notes_update",
        ]
        lookup = next(t for t in tools if t.name == "lookup")
        assert lookup.idempotent and lookup.source == "python"
        args = ["tools", "--url", gw.base_url, "--token", token]
        assert await asyncio.to_thread(main, args) == 0
        lines = capsys.readouterr().out.splitlines()
        assert any(line.split()[:3] == ["lookup", "python", "idempotent"] for line in lines)
        assert any(line.split()[:3] == ["charge", "python", "side-effecting"] for line in lines)
        assert await asyncio.to_thread(main, [*args, "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert [t["name"] for t in listed] == [t.name for t in tools]
    finally:
        await redis.hdel(keys.tools(), "w-tools")


async def test_a_tokens_tools_claim_narrows_the_list(
    gw: LiveGateway, settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    registry = sample_registry()
    await registry.start()
    await registry.publish(redis, keys, "w-tools")
    assert settings.jwt_secret is not None
    now = int(time.time())

    def token(**claims: object) -> dict[str, str]:
        body = {"sub": "alice", "iat": now, "exp": now + 600, **claims}
        return _bearer(_encode(body, settings.jwt_secret))

    try:
        async with httpx.AsyncClient(base_url=gw.base_url, timeout=10) as http:
            r = await http.get("/v1/tools", headers=token(tools=["lookup", "not_registered"]))
            names = [t["name"] for t in r.json()["tools"]]
            assert names == [
                "working_notes_clear",
                "working_notes_get",
                "working_notes_update",
                "lookup",
            ]
            r = await http.get("/v1/tools", headers=token(tools="lookup"))
            assert r.status_code == 401 and "'tools' claim" in r.json()["error"]["message"]
    finally:
        await redis.hdel(keys.tools(), "w-tools")

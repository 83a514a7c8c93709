"""A submit's webhook: refused with 422 outside the allow-list (nothing written), kept
on the turn record inside it."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis

from tests.gateway_server import live_gateway, signed_in
from tests.webhook_receiver import SECRET
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

ALLOW = ("hooks.example.com", "127.0.0.1:9000")


@pytest.fixture
async def client(settings: Settings, redis: aioredis.Redis) -> AsyncIterator[httpx.AsyncClient]:
    hooked = dataclasses.replace(settings, webhook_secret=SECRET, webhook_allow=ALLOW)
    async with live_gateway(hooked) as gw, signed_in(gw, hooked) as http:
        yield http


async def _nothing_written(redis: aioredis.Redis, keys: Keys, sid: str) -> None:
    assert await redis.exists(keys.turns("alice", sid), keys.active("alice", sid)) == 0
    assert await redis.zcard(keys.outbox("alice", sid)) == 0
    assert await redis.exists(keys.work(0)) == 0


@pytest.mark.parametrize(
    "url",
    [
        "https://evil.example.com/hook",
        "http://127.0.0.1:9001/hook",
        "http://169.254.169.254/latest/meta-data/",
        "http://[fe80::1]:9000/hook",
        "http://metadata.google.internal/",
        "file:///etc/passwd",
    ],
)
async def test_a_webhook_outside_the_allow_list_is_refused_and_nothing_is_written(
    client: httpx.AsyncClient, redis: aioredis.Redis, keys: Keys, url: str
) -> None:
    sid = (await client.post("/v1/sessions")).json()["sessionId"]
    r = await client.post(
        f"/v1/sessions/{sid}/turns", json={"message": "hi", "webhook": {"url": url}}
    )
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["code"], error["field"]) == ("webhook_not_allowed", "webhook.url")
    await _nothing_written(redis, keys, sid)


async def test_an_allowed_webhook_is_kept_on_the_record(client: httpx.AsyncClient) -> None:
    sid = (await client.post("/v1/sessions")).json()["sessionId"]
    url = "https://hooks.example.com/turns?tenant=7"
    r = await client.post(
        f"/v1/sessions/{sid}/turns", json={"message": "hi", "webhook": {"url": url}}
    )
    assert r.status_code == 202, r.text
    record = (await client.get(f"/v1/sessions/{sid}/turns/{r.json()['turnId']}")).json()
    # Queued with the terminal event: until then only its URL.
    assert record["webhook"] == {"url": url}
    r = await client.post(f"/v1/sessions/{sid}/turns", json={"message": "hi", "webhook": {}})
    assert r.status_code == 422


async def test_without_a_secret_no_submit_may_name_a_webhook(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    open_gateway = dataclasses.replace(settings, webhook_allow=ALLOW)
    async with live_gateway(open_gateway) as gw, signed_in(gw, open_gateway) as http:
        sid = (await http.post("/v1/sessions")).json()["sessionId"]
        body = {"message": "hi", "webhook": {"url": "https://hooks.example.com/"}}
        r = await http.post(f"/v1/sessions/{sid}/turns", json=body)
        assert r.status_code == 422
        assert r.json()["error"]["code"] == "webhook_not_allowed"
        await _nothing_written(redis, keys, sid)
        r = await http.post(f"/v1/sessions/{sid}/turns", json={"message": "hi"})
        assert r.status_code == 202
        record = (await http.get(f"/v1/sessions/{sid}/turns/{r.json()['turnId']}")).json()
        assert "webhook" not in record


async def test_the_deployment_default_goes_on_a_turn_that_names_none(
    settings: Settings, redis: aioredis.Redis
) -> None:
    default = "https://hooks.example.com/default"
    hooked = dataclasses.replace(
        settings, webhook_secret=SECRET, webhook_allow=ALLOW, webhook_url=default
    )
    async with live_gateway(hooked) as gw, signed_in(gw, hooked) as http:
        sid = (await http.post("/v1/sessions")).json()["sessionId"]
        r = await http.post(f"/v1/sessions/{sid}/turns", json={"message": "hi"})
        assert r.status_code == 202
        record = (await http.get(f"/v1/sessions/{sid}/turns/{r.json()['turnId']}")).json()
        assert record["webhook"] == {"url": default}


async def test_an_idempotent_replay_compares_the_webhook(client: httpx.AsyncClient) -> None:
    sid = (await client.post("/v1/sessions")).json()["sessionId"]
    headers = {"Idempotency-Key": "k1"}
    body = {"message": "hi", "webhook": {"url": "https://hooks.example.com/a"}}
    first = await client.post(f"/v1/sessions/{sid}/turns", json=body, headers=headers)
    again = await client.post(f"/v1/sessions/{sid}/turns", json=body, headers=headers)
    assert first.status_code == again.status_code == 202
    assert again.json()["turnId"] == first.json()["turnId"]
    body["webhook"] = {"url": "https://hooks.example.com/b"}
    other = await client.post(f"/v1/sessions/{sid}/turns", json=body, headers=headers)
    assert other.status_code == 409 and other.json()["error"]["code"] == "conflict"

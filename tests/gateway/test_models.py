"""GET /v1/models, and a selectedModel naming a provider nobody configured."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis

from tests.gateway_server import live_gateway, signed_in
from turnbus.shared.providers import Provider
from turnbus.shared.settings import Settings


@pytest.fixture
async def client(settings: Settings, redis: aioredis.Redis) -> AsyncIterator[httpx.AsyncClient]:
    providers = (
        Provider("scripted", "scripted"),
        Provider("openai", "openai", "sk-secret-key", None, "gpt-4.1-mini"),
        Provider("local", "openai", "local-secret", "http://10.0.0.9:8000/v1", "qwen3-32b"),
    )
    configured = dataclasses.replace(settings, model="openai", providers=providers)
    async with live_gateway(configured) as gw, signed_in(gw, configured) as http:
        yield http


async def test_models_lists_the_configured_providers_and_the_default(
    client: httpx.AsyncClient,
) -> None:
    r = await client.get("/v1/models")
    assert r.status_code == 200, r.text
    assert r.json() == {
        "default": "openai",
        "providers": [
            {"name": "scripted", "kind": "scripted", "defaultModel": None, "default": False},
            {"name": "openai", "kind": "openai", "defaultModel": "gpt-4.1-mini", "default": True},
            {"name": "local", "kind": "openai", "defaultModel": "qwen3-32b", "default": False},
        ],
    }
    assert "secret" not in r.text and "10.0.0.9" not in r.text


async def test_models_needs_a_token(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models", headers={"Authorization": ""})
    assert r.status_code == 401


async def test_an_unknown_provider_is_refused_at_put_meta_and_changes_nothing(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post("/v1/sessions", json={"meta": {"selectedModel": "local:qwen3-32b"}})
    assert r.status_code == 201, r.text
    created = r.json()
    sid, at = created["sessionId"], created["updatedAt"]
    r = await client.put(
        f"/v1/sessions/{sid}/meta",
        json={"updatedAt": at + 1, "meta": {"selectedModel": "mistral:large-2"}},
    )
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "unknown_provider"
    assert error["field"] == "meta.selectedModel"
    assert "'mistral'" in error["message"]
    assert (await client.get(f"/v1/sessions/{sid}")).json() == created
    # A bare name, and every configured provider, are taken.
    for at_, selected in enumerate(("gpt-4.1", "openai:gpt-4.1", "scripted:x", "local:qwen3:32b")):
        r = await client.put(
            f"/v1/sessions/{sid}/meta",
            json={"updatedAt": at + 2 + at_, "meta": {"selectedModel": selected}},
        )
        assert r.status_code == 200, (selected, r.text)


async def test_an_unknown_provider_is_refused_at_creation(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/sessions", json={"meta": {"selectedModel": "anthropic:claude"}})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "unknown_provider"

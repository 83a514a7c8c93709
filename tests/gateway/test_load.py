"""The gateway under load: a pool far below the clients makes calls wait, not fail."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
from redis.asyncio.connection import BlockingConnectionPool

from tests.gateway_server import live_gateway
from turnbus.gateway.auth import mint_token
from turnbus.shared.mux import MuxRedis
from turnbus.shared.settings import Settings

pytestmark = pytest.mark.timeout(120)


async def test_a_pool_of_two_connections_serves_many_concurrent_clients(
    settings: Settings,
) -> None:
    settings = dataclasses.replace(settings, gateway_redis_connections=2)
    assert settings.jwt_secret
    clients = 120
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with (
        live_gateway(settings) as gw,
        httpx.AsyncClient(base_url=gw.base_url, timeout=60, limits=limits) as http,
    ):
        pool = gw.gateway.redis.connection_pool
        assert isinstance(pool, BlockingConnectionPool)
        assert pool.max_connections == 2

        async def one_user(i: int) -> list[int]:
            auth = {"Authorization": f"Bearer {mint_token(settings.jwt_secret or '', f'u{i}')}"}
            created = await http.post("/v1/sessions", headers=auth)
            sid = created.json()["sessionId"]
            submitted = await http.post(
                f"/v1/sessions/{sid}/turns", json={"message": "hi"}, headers=auth
            )
            tid = submitted.json()["turnId"]
            record = await http.get(f"/v1/sessions/{sid}/turns/{tid}", headers=auth)
            return [created.status_code, submitted.status_code, record.status_code]

        statuses = await asyncio.gather(*(one_user(i) for i in range(clients)))
        # The calls share the process's multiplexed connection: none waits for the
        # pool of two, none fails, and the gateway opened one connection for them.
        assert statuses == [[201, 202, 200]] * clients
        assert isinstance(gw.gateway.redis, MuxRedis) and gw.gateway.redis.connects == 1

"""shared.muxclient: one interface over one Redis, a Redis Cluster and a plain client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from turnbus.shared.connect import connect, dedicated_link
from turnbus.shared.keys import Keys
from turnbus.shared.muxclient import mux_client
from turnbus.shared.redispy import link_settings
from turnbus.shared.settings import Settings

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    client = connect(settings, "status")
    yield client
    await client.aclose()


@pytest.mark.cluster
async def test_a_write_and_its_wait_go_on_a_link_of_their_own_at_the_key_s_master(
    client: aioredis.Redis, keys: Keys
) -> None:
    nodes = mux_client(client)
    key = keys.env("u1", "s1")
    master = await nodes.node_for_key(key)
    assert master in await nodes.masters()
    assert nodes.address_for_key(key) is not None

    pinned = nodes.pinned()
    try:
        await pinned.set(key, "written")
        # WAIT counts the writes of its own connection: no replica asked for, none owed.
        assert await pinned.execute_command("WAIT", 0, 100) == 0
    finally:
        await pinned.aclose()
    try:
        assert await master.get(key) == "written"
    finally:
        await client.delete(key)


@pytest.mark.cluster
async def test_only_a_dedicated_link_takes_call_into_and_listen(
    client: aioredis.Redis, settings: Settings
) -> None:
    nodes = mux_client(client)
    with pytest.raises(ValueError, match="dedicated"):
        await nodes.call_into(lambda reply: None, "PING")
    with pytest.raises(ValueError, match="dedicated"):
        await nodes.listen(lambda: None)

    address = nodes.address_for_key("k") if settings.redis_cluster else None
    link = dedicated_link(settings, address)
    replies: list[object] = []
    try:
        await mux_client(link).call_into(replies.append, "PING")
    finally:
        await link.aclose()
    assert replies == [b"PONG"]


async def test_a_plain_redis_py_client_answers_as_its_one_node(redis_url: str) -> None:
    plain = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        nodes = mux_client(plain)
        assert await nodes.masters() == [plain]
        assert await nodes.node_for_key("any") is plain
        assert nodes.node_clients == [plain]
        assert nodes.latency_ms == 0.0
        assert nodes.address_for_key("any") == link_settings(plain.connection_pool).address
        pinned = nodes.pinned()
        try:
            assert await pinned.ping() is True
        finally:
            await pinned.aclose()
        with pytest.raises(ValueError, match="dedicated"):
            await nodes.call_into(lambda reply: None, "PING")
    finally:
        await plain.aclose()


async def test_each_lost_subscription_takes_the_next_master_of_a_cluster(
    redis_cluster_url: str,
) -> None:
    cluster = connect(Settings(redis_url=redis_cluster_url, redis_cluster=True), "status")
    try:
        nodes = mux_client(cluster)
        masters = await nodes.masters()
        where = [link_settings(nodes.pubsub(n).connection_pool).where for n in range(len(masters))]
        assert len(set(where)) == len(masters) > 1
    finally:
        await cluster.aclose()

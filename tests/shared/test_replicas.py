"""``TURNBUS_WAIT_REPLICAS``: a write is acknowledged only once a replica has it."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from tests.gateway_server import live_gateway, signed_in
from tests.redis_server import private_redis_server, private_replica
from tests.worker_kit import running_worker, types_of, wait_terminal
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import Keys
from turnbus.shared.replicas import NotReplicated, ReplicaWait
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.scripted import ScriptedModel


@pytest.fixture(scope="module")
def primary_and_replica() -> Iterator[tuple[str, str]]:
    with private_redis_server() as primary, private_replica(primary) as replica:
        yield primary, replica


@pytest.fixture
async def clients(
    primary_and_replica: tuple[str, str],
) -> AsyncIterator[tuple[aioredis.Redis, aioredis.Redis]]:
    primary = aioredis.Redis.from_url(primary_and_replica[0], decode_responses=True)
    replica = aioredis.Redis.from_url(primary_and_replica[1], decode_responses=True)
    try:
        yield primary, replica
    finally:
        await primary.aclose()
        await replica.aclose()


async def test_what_a_client_is_told_is_on_the_replica_when_it_is_told(
    primary_and_replica: tuple[str, str], clients: tuple[aioredis.Redis, aioredis.Redis]
) -> None:
    primary, replica = clients
    prefix = "r" + uuid.uuid4().hex[:12]
    keys = Keys(prefix)
    settings = Settings(redis_url=primary_and_replica[0], prefix=prefix, wait_replicas=1)
    store = EnvelopeStore(primary, keys, replicas=ReplicaWait.from_settings(settings))
    turns = TurnStore(primary, keys, settings)
    await store.create("u1", "s1")
    assert await replica.exists(keys.env("u1", "s1"))  # read the moment create returned
    record, _, _ = await turns.submit_queued("u1", "s1", "remember the replica has it")
    assert await replica.hget(keys.turn("u1", "s1", record.turnId), "status") == "queued"

    async with running_worker(settings, ScriptedModel(settings)):
        events = await wait_terminal(primary, keys, "u1", "s1", record.turnId)
    assert types_of(events)[-1] == "turn.completed"
    assert await replica.hget(keys.turn("u1", "s1", record.turnId), "status") == "completed"
    notes = await replica.hget(keys.env("u1", "s1"), "workingNotes")
    assert notes is not None and "the replica has it" in notes


async def test_without_a_replica_nothing_is_acknowledged(
    redis: aioredis.Redis, keys: Keys, settings: Settings
) -> None:
    # The test server has no replica: WAIT times out with none.
    settings = dataclasses.replace(settings, wait_replicas=1, wait_replicas_timeout_ms=50)
    waiting = EnvelopeStore(redis, keys, replicas=ReplicaWait.from_settings(settings))
    with pytest.raises(NotReplicated, match="0 of 1 replica"):
        await waiting.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    with pytest.raises(NotReplicated):
        await turns.submit_queued("u1", "s1", "hi")


async def test_the_gateway_answers_503_not_replicated_and_a_retry_finds_the_turn(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("alice", "s1")
    waiting = dataclasses.replace(settings, wait_replicas=1, wait_replicas_timeout_ms=50)
    async with live_gateway(waiting) as gw, signed_in(gw, waiting) as http:
        url = "/v1/sessions/s1/turns"
        headers = {"Idempotency-Key": "k1"}
        r = await http.post(url, json={"message": "hi"}, headers=headers)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_replicated"
    # Once replicas confirm again (here: none asked for), the retry answers with that turn.
    async with live_gateway(settings) as gw, signed_in(gw, settings) as http:
        r = await http.post(url, json={"message": "hi"}, headers=headers)
        assert r.status_code == 202 and r.headers["Idempotent-Replayed"] == "true"

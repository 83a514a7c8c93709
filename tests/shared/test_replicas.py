"""``TURNBUS_WAIT_REPLICAS``: a write is acknowledged only once a replica has it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from harness.redis_server import private_redis_server, private_replica
from tests.gateway_server import live_gateway, signed_in
from tests.worker_kit import running_worker, turn_events, types_of, wait_terminal, wait_until
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


async def _entries_of(redis: aioredis.Redis, keys: Keys, turn_id: str) -> int:
    return sum(
        fields.get("turn") == turn_id for _, fields in await redis.xrange(keys.work(0)) or []
    )


async def test_a_replayed_submit_writes_the_work_entry_the_first_one_lost(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    # The first submit's entry went with a failed master of its work stream (deleted
    # here); the client's retry is answered as accepted, so the entry must be there.
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    first, _, _ = await turns.submit_queued("u1", "s1", "hi", idempotency_key="k1")
    await redis.xtrim(keys.work(0), maxlen=0)
    again, replayed, _ = await turns.submit_queued("u1", "s1", "hi", idempotency_key="k1")
    assert replayed and again.turnId == first.turnId
    assert await _entries_of(redis, keys, first.turnId) == 1


async def test_a_turn_refused_503_not_replicated_starts_at_once_when_its_retry_is_replayed(
    prefix: str,
) -> None:
    with contextlib.ExitStack() as stack:  # the primary, later its replica
        primary = stack.enter_context(private_redis_server())
        settings = Settings(
            redis_url=primary,
            prefix=prefix,
            jwt_secret="test-secret-" + prefix,
            wait_replicas=1,
            wait_replicas_timeout_ms=50,
        )
        keys = Keys(prefix)
        redis = aioredis.Redis.from_url(primary, decode_responses=True)
        try:
            await _refused_then_replayed(stack, primary, settings, keys, redis)
        finally:
            await redis.aclose()


async def _refused_then_replayed(
    stack: contextlib.ExitStack,
    primary: str,
    settings: Settings,
    keys: Keys,
    redis: aioredis.Redis,
) -> None:
    await EnvelopeStore(redis, keys).create("alice", "s1")
    async with live_gateway(settings) as gw, signed_in(gw, settings) as http:
        url, headers = "/v1/sessions/s1/turns", {"Idempotency-Key": "k1"}
        refused = await http.post(url, json={"message": "hi"}, headers=headers)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "not_replicated"
        # A replica joins (the failed master's was promoted, or one rejoined): the
        # retry's WAIT succeeds.
        await asyncio.to_thread(stack.enter_context, private_replica(primary))
        retried = await http.post(url, json={"message": "hi"}, headers=headers)
        assert retried.status_code == 202 and retried.headers["Idempotent-Replayed"] == "true"
        turn_id = retried.json()["turnId"]

        async def started() -> bool:
            events = await turn_events(redis, keys, "alice", "s1", turn_id)
            return "turn.started" in types_of(events)

        async with running_worker(settings, ScriptedModel(settings)):
            # Within 1 s, where the outbox sweep would have enqueued it after 30 s.
            await wait_until(started, 1.0)
            events = await wait_terminal(redis, keys, "alice", "s1", turn_id)
    assert types_of(events)[-1] == "turn.completed"


@pytest.mark.parametrize("retried", ["submit", "cancel"])
async def test_a_replayed_answer_waits_for_the_replica_like_the_first(
    primary_and_replica: tuple[str, str],
    clients: tuple[aioredis.Redis, aioredis.Redis],
    retried: str,
) -> None:
    # The replica stops acknowledging (a frozen node): the first call is refused, and so
    # is its retry on another connection, which writes nothing new: its WAIT counts
    # from where the primary is, past the first call's write (Redis 6.2 and 7 alike).
    primary, replica = clients
    prefix = "r" + uuid.uuid4().hex[:12]
    keys = Keys(prefix)
    settings = Settings(
        redis_url=primary_and_replica[0],
        prefix=prefix,
        wait_replicas=1,
        wait_replicas_timeout_ms=300,
    )
    await EnvelopeStore(primary, keys).create("u1", "s1")
    first_client = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
    # The turn the cancel is about, written while the replica still answers: its WAIT
    # has room for a busy machine (the 300 ms bound is for the frozen calls below).
    unhurried = dataclasses.replace(settings, wait_replicas_timeout_ms=10_000)
    try:
        record, _, _ = await TurnStore(first_client, keys, unhurried).submit_queued(
            "u1", "s1", "hi", idempotency_key="k1"
        )
    except BaseException:
        await first_client.aclose()
        raise

    async def call(client: aioredis.Redis) -> object:
        store = TurnStore(client, keys, settings)
        if retried == "submit":
            return await store.submit_queued(
                "u1", "s1", "hi", multitask="enqueue", idempotency_key="k2"
            )
        return await store.request_cancel("u1", "s1", record.turnId)

    pid = int((await replica.info("server"))["process_id"])
    os.kill(pid, signal.SIGSTOP)
    # The retry, on a connection of its own (another gateway process).
    again = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        with pytest.raises(NotReplicated):
            await call(first_client)
        with pytest.raises(NotReplicated):
            await call(again)
    finally:
        os.kill(pid, signal.SIGCONT)
        await again.aclose()
        await first_client.aclose()

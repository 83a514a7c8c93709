"""Capacity: hundreds of I/O-bound turns at once, waiting turns hold none, connections few."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import redis.asyncio as aioredis

from tests.worker_kit import (
    ProgramModel,
    running_worker,
    text_round,
    types_of,
    wait_terminal,
    wait_until,
)
from turnbus.shared.connect import MeteredPool
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import Keys
from turnbus.shared.mux import MuxRedis
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.base import ModelRequest, RoundResult, TextChunk

pytestmark = pytest.mark.timeout(120)


class Gate:
    """A model round that blocks until opened, counting the rounds waiting at it."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.inside = 0

    async def program(self, request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        self.inside += 1
        await self.open.wait()
        return text_round("ok")


async def test_one_worker_runs_200_gated_turns_at_once(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    turns = TurnStore(redis, keys, settings)
    gate = Gate()
    sessions = [f"s{i}" for i in range(200)]
    async with running_worker(settings, ProgramModel(gate.program)) as worker:
        submitted = []
        for session in sessions:
            await store.create("u1", session)
            record, _, _ = await turns.submit_queued("u1", session, "hi")
            submitted.append((session, record.turnId))

        async def all_inside() -> bool:
            return gate.inside == len(sessions)

        # Every turn is inside the model at the same time: none waits for a slot.
        await wait_until(all_inside, 60)
        assert worker.in_flight_count == len(sessions)
        gate.open.set()
        for session, tid in submitted:
            events = await wait_terminal(redis, keys, "u1", session, tid, within=60)
            assert types_of(events)[-1] == "turn.completed"


async def test_a_pool_far_below_the_concurrency_makes_calls_wait_not_fail(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, worker_redis_connections=4)
    turns = TurnStore(redis, keys, settings)
    gate = Gate()
    sessions = [f"s{i}" for i in range(60)]
    before = len(await redis.client_list())
    async with running_worker(settings, ProgramModel(gate.program), concurrency=100) as worker:
        submitted = []
        for session in sessions:
            await store.create("u1", session)
            record, _, _ = await turns.submit_queued("u1", session, "hi")
            submitted.append((session, record.turnId))

        async def all_inside() -> bool:
            return gate.inside == len(sessions)

        await wait_until(all_inside, 60)
        gate.open.set()  # 60 turns end at once over 4 connections
        for session, tid in submitted:
            events = await wait_terminal(redis, keys, "u1", session, tid, within=60)
            assert types_of(events)[-1] == "turn.completed"
        pool = worker.redis.connection_pool
        assert isinstance(pool, MeteredPool)
        assert pool.max_connections == 4
        # 60 turns' commands went over one multiplexed connection (the pool of 4 runs
        # the blocking reads): nothing failed for lack of a connection.
        assert isinstance(worker.redis, MuxRedis) and worker.redis.connects == 1
        assert len(await redis.client_list()) - before <= 1 + 4
        assert worker.metrics.abandoned._value.get() == 0


async def test_a_flooded_session_does_not_hold_back_another_sessions_turn(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "flood")
    await store.create("u1", "other")
    # A queue bound above the flood: this test is about run slots, not the bound.
    settings = dataclasses.replace(settings, session_queue_max=200)
    turns = TurnStore(redis, keys, settings)
    release = asyncio.Event()

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        if request.messages[-1]["content"][0].get("text") == "first":
            await release.wait()
        return text_round("ok")

    # Far more queued turns of one session than run slots: they all wait without one.
    async with running_worker(settings, ProgramModel(program), concurrency=8) as worker:
        await turns.submit_queued("u1", "flood", "first")
        queued = []
        for i in range(50):
            record, _, _ = await turns.submit_queued(
                "u1", "flood", f"queued {i}", multitask="enqueue"
            )
            queued.append(record.turnId)

        async def all_read() -> bool:
            return worker.waiting_count == len(queued)

        await wait_until(all_read, 30)
        record, _, _ = await turns.submit_queued("u1", "other", "me first")
        events = await wait_terminal(redis, keys, "u1", "other", record.turnId)
        assert types_of(events)[-1] == "turn.completed"
        still = await turns.get("u1", "flood", queued[0])
        assert still is not None and still.status == "queued"
        release.set()
        events = await wait_terminal(redis, keys, "u1", "flood", queued[-1], within=60)
        assert types_of(events)[-1] == "turn.completed"


async def test_a_saturated_worker_running_nothing_still_takes_turns_one_at_a_time(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    # A host so short of CPU that the event loop always counts as late: every check says
    # saturated. Refusing all work would leave every queued turn waiting forever.
    starved = dataclasses.replace(settings, worker_max_loop_lag_ms=-1)
    turns = TurnStore(redis, keys, settings)
    gate = Gate()
    most = 0

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        nonlocal most
        most = max(most, gate.inside + 1)
        try:
            return await gate.program(request, index)
        finally:
            gate.inside -= 1

    submitted = []
    for i in range(5):
        await store.create("u1", f"s{i}")
        record, _, _ = await turns.submit_queued("u1", f"s{i}", "hi")
        submitted.append((f"s{i}", record.turnId))
    async with running_worker(starved, ProgramModel(program)) as worker:

        async def one_inside() -> bool:
            return gate.inside == 1

        await wait_until(one_inside, 30)
        assert worker.metrics.saturated._value.get() == 1
        gate.open.set()
        for session, tid in submitted:
            events = await wait_terminal(redis, keys, "u1", session, tid, within=60)
            assert types_of(events)[-1] == "turn.completed"
    assert most == 1

"""The entry runner (``worker/entries.py``): the entry's one ack, and one lost; its cancel
subscription cut off, and through a failover of its node: logged once when lost and
once when back, and a cancel sent meanwhile still reaches the running turn."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from harness.fault_proxy import fault_proxy
from harness.local_cluster import cluster_binaries, local_cluster
from tests.worker_kit import (
    ProgramModel,
    no_pending,
    rounds,
    running_worker,
    text_round,
    types_of,
    wait_terminal,
    wait_until,
)
from turnbus.shared.cluster import ClusterMux
from turnbus.shared.connect import connect
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.base import ModelRequest, RoundResult, TextChunk
from turnbus.worker.workqueue import WorkQueue


def _held_model() -> ProgramModel:
    held = asyncio.Event()

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        await held.wait()  # runs until cancelled
        return []

    return ProgramModel(program)


def _about_the_subscription(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "cancel subscription" in r.getMessage()]


async def test_a_cancel_sent_while_the_subscription_is_cut_reaches_the_turn_when_it_is_back(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="turnbus.worker.entries")
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    async with fault_proxy(settings.redis_url) as proxy:
        via_proxy = dataclasses.replace(settings, redis_url=proxy.url)
        async with running_worker(via_proxy, _held_model()) as worker:
            record, _, _ = await turns.submit_queued("u1", "s1", "hello")

            async def running() -> bool:
                return bool(worker.metrics.running._value.get() == 1)

            await wait_until(running, 10)
            caplog.clear()
            await proxy.cut()  # the subscription is lost, and cannot come back yet

            async def said_lost() -> bool:
                return bool(_about_the_subscription(caplog))

            await wait_until(said_lost, 10)
            # Published while the worker hears nothing: only its record keeps it.
            await turns.request_cancel("u1", "s1", record.turnId)
            await proxy.start()
            events = await wait_terminal(redis, keys, "u1", "s1", record.turnId, within=10)
            assert types_of(events)[-1] == "turn.cancelled"
    about = _about_the_subscription(caplog)
    assert [r.levelname for r in about] == ["WARNING", "INFO"], [r.getMessage() for r in about]


async def test_a_failed_read_for_missed_cancels_is_logged_and_tried_again(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever the read for missed cancels raises (here the RuntimeError of a closed
    transport, not a Redis error), it is logged once, with its traceback, and tried
    again: the cancel sent while nothing listened still reaches the turn."""
    caplog.set_level(logging.INFO, logger="turnbus.worker.entries")
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    async with fault_proxy(settings.redis_url) as proxy:
        via_proxy = dataclasses.replace(settings, redis_url=proxy.url)
        async with running_worker(via_proxy, _held_model()) as worker:
            record, _, _ = await turns.submit_queued("u1", "s1", "hello")

            async def running() -> bool:
                return bool(worker.metrics.running._value.get() == 1)

            await wait_until(running, 10)
            pipeline = worker.redis.pipeline
            failed: list[str] = []

            def failing_once_in_the_read(*args: Any, **kwargs: Any) -> Any:
                task = asyncio.current_task()
                if not failed and task is not None and task.get_name() == "worker:missed":
                    failed.append(task.get_name())
                    raise RuntimeError("unable to perform operation: the handler is closed")
                return pipeline(*args, **kwargs)

            monkeypatch.setattr(worker.redis, "pipeline", failing_once_in_the_read)
            caplog.clear()
            await proxy.cut()

            async def said_lost() -> bool:
                return bool(_about_the_subscription(caplog))

            await wait_until(said_lost, 10)
            await turns.request_cancel("u1", "s1", record.turnId)
            await proxy.start()
            events = await wait_terminal(redis, keys, "u1", "s1", record.turnId, within=10)
            assert types_of(events)[-1] == "turn.cancelled"
    assert failed, "the read for missed cancels never ran"
    warned = [r for r in caplog.records if "missed cancels" in r.getMessage()]
    assert len(warned) == 1 and warned[0].exc_info, [r.getMessage() for r in warned]


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_cancel_sent_while_the_subscription_node_fails_over_reaches_the_turn(
    prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    if cluster_binaries() is None:
        pytest.skip("needs redis-server >= 7 and redis-cli on the PATH")
    caplog.set_level(logging.INFO, logger="turnbus.worker.entries")
    with local_cluster() as local:
        settings = Settings(
            redis_url=local.url, redis_cluster=True, prefix=prefix, redis_failover_wait_ms=30_000
        )
        keys = Keys(prefix)
        redis = connect(settings, "status")
        assert isinstance(redis, ClusterMux)
        try:
            async with running_worker(settings, _held_model()) as worker:

                def subscribed_on() -> list[int]:
                    return [
                        port
                        for port in local.masters()
                        if any(int(c.get("sub", 0)) for c in local.client(port).client_list())
                    ]

                async def one_subscription() -> bool:
                    return len(await asyncio.to_thread(subscribed_on)) == 1

                await wait_until(one_subscription, 10)
                victim = (await asyncio.to_thread(subscribed_on))[0]
                # A session served by another master: its cancel is accepted while the
                # subscription's node is down.
                await redis.masters()
                session = next(
                    s
                    for s in (f"s{uuid.uuid4().hex[:8]}" for _ in range(1000))
                    if redis.address_for_key(keys.env("u1", s)) != ("127.0.0.1", victim)
                )
                await EnvelopeStore(redis, keys).create("u1", session)
                turns = TurnStore(redis, keys, settings)
                record, _, _ = await turns.submit_queued("u1", session, "hello")

                async def running() -> bool:
                    return bool(worker.metrics.running._value.get() == 1)

                await wait_until(running, 20)
                caplog.clear()
                await asyncio.to_thread(local.kill, victim)
                await turns.request_cancel("u1", session, record.turnId)
                events = await wait_terminal(redis, keys, "u1", session, record.turnId, within=10)
                assert types_of(events)[-1] == "turn.cancelled"

                async def taken_over() -> bool:
                    return victim not in await asyncio.to_thread(local.masters) and bool(
                        await asyncio.to_thread(subscribed_on)
                    )

                await wait_until(taken_over, 30)
                # Past the failover (a replica promoted): the whole outage said twice.
                await asyncio.to_thread(local.wait_ok)
        finally:
            await redis.aclose()
    about = _about_the_subscription(caplog)
    assert [r.levelname for r in about] == ["WARNING", "INFO"], [r.getMessage() for r in about]
    assert f"127.0.0.1:{victim}" in about[0].getMessage()
    assert not any(r.exc_info for r in about)


async def test_an_ack_lost_to_redis_is_taken_back_and_dropped_without_running_the_turn_again(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A reclaim would take the entry back only after claim_idle_ms: not within this test.
    settings = dataclasses.replace(settings, claim_idle_ms=600_000)
    caplog.set_level(logging.WARNING, logger="turnbus.worker.entries")
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    ack = WorkQueue.ack
    lost: list[str] = []

    async def the_first_ack_lost(queue: WorkQueue, stream: str, entry_id: str) -> None:
        if not lost:
            lost.append(entry_id)
            raise RedisConnectionError("Connection lost")
        await ack(queue, stream, entry_id)

    monkeypatch.setattr(WorkQueue, "ack", the_first_ack_lost)
    model = ProgramModel(rounds(text_round("done")))
    async with running_worker(settings, model) as worker:
        record, _, _ = await turns.submit_queued("u1", "s1", "hello")
        events = await wait_terminal(redis, keys, "u1", "s1", record.turnId)
        await wait_until(lambda: no_pending(redis, keys), 5)
        assert worker.turns_finished == 1
    assert lost
    assert types_of(events).count("turn.completed") == 1
    assert len(model.requests) == 1  # the entry taken back found the turn ended
    said = [r.getMessage() for r in caplog.records if "ack of entry" in r.getMessage()]
    assert said and said[0].startswith(f"turn {record.turnId}:"), said


async def test_a_read_cut_short_leaves_no_entry_to_a_read_nobody_waits_for(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    # On one Redis the blocking read has a link of its own: a read cut short (the
    # intake's bound) closes it, or Redis would hand the next entry to that read, whose
    # reply nobody takes, and the next read would wait for nothing.
    client = connect(settings, "worker", concurrency=4)
    queue = WorkQueue(client, keys, settings, "w-cut")
    try:
        await queue.ensure_groups()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(queue.read(10, 5000), 0.05)
        await redis.xadd(keys.work(0), {"user": "u1", "session": "s1", "turn": "t_cut"})
        entries = await queue.read(10, 2000)
        assert [e.fields["turn"] for e in entries] in (["t_cut"], [b"t_cut"])
    finally:
        await queue.stop_reading()
        await client.aclose()

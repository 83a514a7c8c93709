"""Faults under load: a Redis blip, graceful restarts, live workers that only wait."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import uvloop

from harness.fault_proxy import fault_proxy
from harness.redis_server import redis_binary
from tests.worker_kit import (
    ProgramModel,
    rounds,
    running_worker,
    text_round,
    types_of,
    wait_terminal,
    wait_until,
)
from turnbus.chat import TurnPrinter
from turnbus.redis_local import PrivateRedis
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.events import Event, TurnStarted, UnknownEvent
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.consumer import GROUP, Worker
from turnbus.worker.models.base import ModelRequest, RoundResult, TextChunk

pytestmark = pytest.mark.timeout(90)


def held_first_round() -> tuple[asyncio.Event, asyncio.Event, ProgramModel]:
    """A model whose first round sets ``in_round`` and ends once ``go`` is set; each
    round answers "round N"."""
    in_round, go = asyncio.Event(), asyncio.Event()

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        if index == 0:
            in_round.set()
            await go.wait()
        return text_round(f"round {index + 1}")

    return in_round, go, ProgramModel(program)


async def turn_cut_mid_round(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    back_when: Callable[[Worker], bool],
    **overrides: int,
) -> tuple[list[Event | UnknownEvent], Worker]:
    """One turn whose first round ends while Redis is cut off from the worker (a
    network fault: the server itself untouched); Redis is back once ``back_when`` holds.
    The turn's events once it ended, and the (stopped) worker."""
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    in_round, go, model = held_first_round()

    async with fault_proxy(settings.redis_url) as proxy:
        via_proxy = dataclasses.replace(settings, redis_url=proxy.url, **overrides)
        async with running_worker(via_proxy, model) as worker:
            record, _, _ = await turns.submit_queued("u1", "s1", "hello")
            await asyncio.wait_for(in_round.wait(), 10)
            await proxy.cut()
            go.set()  # the round ends while Redis is unreachable
            await wait_until(lambda: _true(back_when(worker)), 20)
            await proxy.start()
            events = await wait_terminal(redis, keys, "u1", "s1", record.turnId, within=10)
    return events, worker


async def _true(value: bool) -> bool:
    return value


async def test_a_redis_blip_mid_turn_is_retried_in_process_not_abandoned(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    events, worker = await turn_cut_mid_round(
        redis,
        keys,
        settings,
        store,
        lambda w: bool(w.metrics.redis_retries._value.get() >= 2),
        redis_retry_ms=30_000,
    )
    assert worker.metrics.abandoned._value.get() == 0
    assert types_of(events)[-1] == "turn.completed"
    started = [e for e in events if isinstance(e, TurnStarted)]
    assert [s.attempt for s in started] == [1], "finished by the same attempt"


async def test_queued_turns_survive_four_graceful_restarts_and_complete(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, claim_idle_ms=300, heartbeat_ms=100)
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    # The session is held by a turn running elsewhere: both turns stay queued behind it.
    await redis.set(keys.lease("u1", "s1"), "elsewhere/attempt", px=120_000)
    first, _, _ = await turns.submit_queued("u1", "s1", "first")
    queued, _, _ = await turns.submit_queued("u1", "s1", "queued", multitask="enqueue")
    model = ProgramModel(rounds())
    for restart in range(4):
        async with running_worker(settings, model, name=f"w{restart}") as worker:

            async def both_waiting(w: object = worker) -> bool:
                return getattr(w, "waiting_count", 0) == 2

            await wait_until(both_waiting, 20)
        # Stopped gracefully: the entries stay pending for the next worker.
    info = await redis.xpending(keys.work(0), GROUP)
    assert int(info["pending"]) == 2
    await redis.delete(keys.lease("u1", "s1"))  # the other turn ended
    async with running_worker(settings, model, name="last"):
        for record in (first, queued):
            events = await wait_terminal(redis, keys, "u1", "s1", record.turnId, within=20)
            assert types_of(events)[-1] == "turn.completed"
            started = [e for e in events if isinstance(e, TurnStarted)]
            assert [s.attempt for s in started] == [1]


async def test_a_live_worker_blocked_in_xreadgroup_is_never_forgotten(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(
        settings, claim_idle_ms=200, heartbeat_ms=100, worker_forget_after_ms=300
    )
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    model = ProgramModel(rounds())
    async with (
        running_worker(settings, model, name="a") as a,
        running_worker(settings, model, name="b") as b,
    ):
        # A delivery makes the consumer known to the group; then nothing is delivered
        # for many forget passes, each past the 300 ms threshold (on Redis 7.0 XINFO's
        # idle grows while a consumer is blocked in XREADGROUP).
        record, _, _ = await turns.submit_queued("u1", "s1", "first")
        await wait_terminal(redis, keys, "u1", "s1", record.turnId)
        known = {c["name"] for c in await redis.xinfo_consumers(keys.work(0), GROUP)}
        assert known and known <= {"a", "b"}
        passes = (a.forget_passes, b.forget_passes)

        async def many_passes() -> bool:
            return a.forget_passes >= passes[0] + 10 and b.forget_passes >= passes[1] + 10

        await wait_until(many_passes, 30)
        consumers = {c["name"] for c in await redis.xinfo_consumers(keys.work(0), GROUP)}
        assert consumers >= known
        assert set(await redis.hkeys(keys.workers())) == {"a", "b"}
        record, _, _ = await turns.submit_queued("u1", "s1", "still served")
        events = await wait_terminal(redis, keys, "u1", "s1", record.turnId)
        assert types_of(events)[-1] == "turn.completed"


async def test_a_turn_abandoned_for_a_long_outage_is_taken_back_when_redis_answers(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    # Redis gone longer than the in-turn retries: the attempt stops and its entry stays
    # pending on this worker, which takes it back once Redis answers and the dead
    # attempt's lease lapses, not after claim_idle_ms (30 s here).
    events, _ = await turn_cut_mid_round(
        redis,
        keys,
        settings,
        store,
        lambda w: w.in_flight_count == 0,  # it gave up
        redis_retry_ms=300,
        lease_ms=1000,
        heartbeat_ms=300,
    )
    assert types_of(events)[-1] == "turn.completed"
    started = [e for e in events if isinstance(e, TurnStarted)]
    assert [s.attempt for s in started] == [1, 2]
    # The new attempt names why it runs: this worker lost Redis, no worker was lost.
    assert (started[0].after, started[1].after) == ("", "redis_lost")
    assert started[1].redisLostMs >= 300  # at least the retries it gave up after


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_long_redis_pause_mid_turn_names_redis_not_a_lost_worker(
    settings: Settings, tmp_path: Path
) -> None:
    # A Redis of its own, paused (SIGSTOP) until the attempt stops. A link that has
    # answered nothing for 3 s here (TURNBUS_REDIS_REPLY_TIMEOUT_MS) is closed at its
    # watchdog's next look (every 1.5 s), so the call waiting on it fails within 4.5 s,
    # past the in-turn retries (2 s here): the attempt stops, and the round plays again
    # once Redis answers.
    server = PrivateRedis(tmp_path, tmp_path / "redis.log", binary=redis_binary(), aof=False)
    server.start()
    try:
        own = dataclasses.replace(
            settings,
            redis_url=server.url,
            lease_ms=3000,
            redis_reply_timeout_ms=3000,
            redis_retry_ms=2000,
        )
        client = aioredis.Redis.from_url(server.url, decode_responses=True)
        keys = Keys(own.prefix)
        await EnvelopeStore(client, keys).create("u1", "s1")
        in_round, go, model = held_first_round()

        async with running_worker(own, model) as worker:
            record, _, _ = await TurnStore(client, keys, own).submit_queued("u1", "s1", "hello")
            await asyncio.wait_for(in_round.wait(), 10)
            assert server.child is not None
            server.child.signal(signal.SIGSTOP)
            try:
                go.set()  # the round ends while Redis answers nothing
                # The fault lasts until the attempt has stopped for it.
                await wait_until(lambda: _true(not worker.slots.in_flight), 20)
            finally:
                server.child.signal(signal.SIGCONT)
            events = await wait_terminal(client, keys, "u1", "s1", record.turnId, within=30)
        await client.aclose()
    finally:
        server.stop()
    assert types_of(events)[-1] == "turn.completed"
    started = [e for e in events if isinstance(e, TurnStarted)]
    assert [(s.attempt, s.after) for s in started] == [(1, ""), (2, "redis_lost")]
    assert started[0].worker == started[1].worker  # no worker was lost
    # The label the console and `turnbus chat` show for it names Redis.
    said: list[str] = []
    printer = TurnPrinter(lambda text="", end="\n": said.append(text + end))
    for event in events:
        printer.show(event)
    label = next(line for line in said if "attempt 2" in line)
    lost = r"attempt 2: the worker lost Redis for [4-9] s; the round it was"
    assert re.search(lost, label), label
    assert "worker was lost" not in "".join(said)


def test_a_worker_on_uvloop_outlives_its_links_dying_under_the_blocking_read(
    keys: Keys, settings: Settings
) -> None:
    """On uvloop, as the services run, a write to a transport that died meanwhile fails
    with RuntimeError ("the handler is closed"), not an OSError: it once ended the read
    loop, and with it the worker. Every way of losing the links, then a turn runs."""
    uvloop.run(_links_die_under_the_read(keys, settings))


async def _links_die_under_the_read(keys: Keys, settings: Settings) -> None:
    redis = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
    turns = TurnStore(redis, keys, settings)
    gate = asyncio.Event()

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        await gate.wait()
        return text_round(f"turn {index}")

    async def blocked_in_read() -> bool:
        return any(
            c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "")
            for c in await redis.client_list()
        )

    async def reading_again() -> bool:
        return not await blocked_in_read()

    async def one_turn(session: str) -> None:
        record, _, _ = await turns.submit_queued("u1", session, "hello")
        events = await wait_terminal(redis, keys, "u1", session, record.turnId, within=15)
        assert types_of(events)[-1] == "turn.completed"

    try:
        store = EnvelopeStore(redis, keys)
        async with fault_proxy(settings.redis_url) as proxy:
            via_proxy = dataclasses.replace(settings, redis_url=proxy.url)
            # One run slot: while a turn holds it the read link lies idle in its pool,
            # where a reset leaves it for the next read to write on.
            async with running_worker(via_proxy, ProgramModel(program), concurrency=1) as worker:

                async def reset_while_idle() -> None:
                    gate.clear()
                    record, _, _ = await turns.submit_queued("u1", "idle", "hold the slot")
                    await wait_until(lambda: _true(worker.in_flight_count == 1))
                    await wait_until(reading_again)
                    await proxy.reset()
                    gate.set()
                    await wait_terminal(redis, keys, "u1", "idle", record.turnId, within=15)

                async def closed_by_redis() -> None:
                    await wait_until(blocked_in_read)
                    await redis.client_kill_filter(_type="normal", skipme=True)

                async def reset_during_a_write() -> None:
                    await wait_until(blocked_in_read)
                    proxy.stall()  # the next read is written, never read by Redis
                    await wait_until(reading_again)
                    await proxy.reset()
                    proxy.stall(False)

                async def reset_under_the_read() -> None:
                    await wait_until(blocked_in_read)
                    await proxy.reset()

                gate.set()
                faults = [reset_under_the_read, reset_while_idle, closed_by_redis]
                faults.append(reset_during_a_write)
                for session in ["idle", *(f"s{n}" for n in range(len(faults)))]:
                    await store.create("u1", session)
                for n, fault in enumerate(faults):
                    await fault()
                    await one_turn(f"s{n}")
                    assert worker.running, fault.__name__
    finally:
        await redis.aclose()

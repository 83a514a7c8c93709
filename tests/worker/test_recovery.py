"""Redelivery: a dead consumer's entries are reclaimed, resumed, or failed past the cap."""

from __future__ import annotations

import dataclasses
import json

import pytest
import redis.asyncio as aioredis
from redis import exceptions as redis_exceptions

from tests.turn_kit import end_turn, start_turn, turn_commit
from tests.worker_kit import (
    ProgramModel,
    rounds,
    running_worker,
    text_round,
    turn_events,
    types_of,
    wait_terminal,
    wait_until,
)
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.events import (
    TextDelta,
    TurnFailed,
    TurnStarted,
    Usage,
    decode_event,
    encode_event,
)
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.consumer import GROUP
from turnbus.worker.lease import SessionLease, new_lease_token
from turnbus.worker.models.base import ModelRequest, RoundResult, TextChunk

# Runs on one Redis and on the local Redis Cluster.
pytestmark = pytest.mark.cluster


async def ghost_takes(redis: aioredis.Redis, keys: Keys, consumer: str = "ghost") -> None:
    """A consumer that reads the entry and dies without acking it."""
    await redis.xgroup_create(keys.work(0), GROUP, id="0", mkstream=True)
    await redis.xreadgroup(GROUP, consumer, {keys.work(0): ">"})


THINKING = {"type": "thinking", "thinking": "my private reasoning", "signature": "sig"}
TOOL_USE = {"type": "tool_use", "id": "toolu_a", "name": "working_notes_get", "input": {}}


async def ghost_commits_a_tool_round_with_thinking(
    redis: aioredis.Redis, keys: Keys, tid: str, prompt: str
) -> None:
    """What a dead attempt of ``tid`` left: its prompt and a tool round with thinking
    (which round commits keep while the turn runs)."""
    committed = [
        {"role": "user", "content": [{"type": "text", "text": prompt}], "turnId": tid,
         "round": 0, "kind": "prompt"},
        {"role": "assistant", "content": [THINKING, TOOL_USE], "turnId": tid, "round": 1,
         "kind": "assistant", "stopReason": "tool_use"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a",
         "content": "(empty)"}], "turnId": tid, "round": 1, "kind": "tool_results"},
    ]  # fmt: skip
    await redis.rpush(keys.messages("u1", "s1"), *[json.dumps(r) for r in committed])


async def ghost_left_a_tool_round(
    redis: aioredis.Redis, keys: Keys, turns: TurnStore, store: EnvelopeStore
) -> str:
    """A turn of session s1 that a dead worker ("ghost") took, started and left with a
    committed tool round with thinking; its id."""
    await store.create("u1", "s1")
    record, _, _ = await turns.submit_queued("u1", "s1", "continue me")
    tid = record.turnId
    await ghost_takes(redis, keys)
    await start_turn(turns, "u1", "s1", tid, "ghost")
    await ghost_commits_a_tool_round_with_thinking(redis, keys, tid, "continue me")
    return tid


async def pending(redis: aioredis.Redis, keys: Keys) -> int:
    return int((await redis.xpending(keys.work(0), GROUP))["pending"])


async def no_pending(redis: aioredis.Redis, keys: Keys) -> bool:
    return await pending(redis, keys) == 0


async def test_a_reclaimed_turn_resumes_from_its_last_committed_round(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, claim_idle_ms=200, heartbeat_ms=100)
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    record, _, _ = await turns.submit_queued("u1", "s1", "continue me")
    tid = record.turnId
    await ghost_takes(redis, keys)
    await start_turn(turns, "u1", "s1", tid, "ghost")
    committed = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "continue me"}],
            "turnId": tid,
            "round": 0,
            "kind": "prompt",
        },
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_a", "name": "working_notes_get", "input": {}}
            ],
            "turnId": tid,
            "round": 1,
            "kind": "assistant",
            "stopReason": "tool_use",
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": "(empty)"}],
            "turnId": tid,
            "round": 1,
            "kind": "tool_results",
        },
    ]
    await redis.rpush(keys.messages("u1", "s1"), *[json.dumps(r) for r in committed])
    await redis.hset(keys.turn("u1", "s1", tid), "usage", json.dumps({"inputTokens": 7}))

    model = ProgramModel(rounds(text_round("resumed")))
    async with running_worker(settings, model, name="rescuer"):
        events = await wait_terminal(redis, keys, "u1", "s1", tid)
        await wait_until(lambda: no_pending(redis, keys))
    assert types_of(events)[-1] == "turn.completed"
    assert len(model.requests) == 1
    assert [m["role"] for m in model.requests[0].messages] == ["user", "assistant", "user"]
    started = [e for e in events if isinstance(e, TurnStarted)]
    # The ghost's start announced its attempt and round 1; the rescuer's resumes at round 2.
    assert [(s.attempt, s.worker) for s in started] == [(1, "ghost"), (2, "rescuer")]
    assert [e.round for e in events if e.__class__.__name__ == "RoundStarted"] == [1, 2]
    final = await turns.get("u1", "s1", tid)
    assert final is not None and final.usage is not None
    assert final.usage.inputTokens == 17  # the first attempt's usage is kept


@pytest.mark.parametrize("after", [3, 150])
async def test_a_resumed_turn_counts_its_usage_on_from_its_last_usage_event(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore, after: int
) -> None:
    # The start script finds the last usage event among the turn's last 100 events; one
    # older than those is found by the worker, reading on from where the script stopped.
    settings = dataclasses.replace(settings, claim_idle_ms=200, heartbeat_ms=100)
    turns = TurnStore(redis, keys, settings)
    tid = await ghost_left_a_tool_round(redis, keys, turns, store)
    stream = keys.turn_events("u1", "s1", tid)
    await redis.xadd(stream, {"data": encode_event(Usage(turnId=tid, inputTokens=5))})
    for i in range(after):
        delta = TextDelta(turnId=tid, round=2, text=f"{i} ")
        await redis.xadd(stream, {"data": encode_event(delta)})
    await redis.hset(keys.turn("u1", "s1", tid), "usage", json.dumps({"inputTokens": 7}))

    model = ProgramModel(rounds(text_round("resumed")))
    async with running_worker(settings, model, name="rescuer"):
        await wait_terminal(redis, keys, "u1", "s1", tid)
        await wait_until(lambda: no_pending(redis, keys))
    final = await turns.get("u1", "s1", tid)
    assert final is not None and final.usage is not None
    assert final.usage.inputTokens == 15  # the usage event's, not the record's


@pytest.mark.parametrize(("after", "found"), [(98, True), (99, False)])
async def test_a_resumed_start_answers_the_usage_event_among_the_last_100_events(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore,
    after: int, found: bool,
) -> None:  # fmt: skip
    # The 100 are counted with the start's own turn.started, the newest of them: a usage
    # event 98 events below it is answered; one 99 below is not, and the reply names the
    # oldest event read (the worker reads on from there).
    turns = TurnStore(redis, keys, settings)
    tid = await ghost_left_a_tool_round(redis, keys, turns, store)
    stream = keys.turn_events("u1", "s1", tid)
    usage_id = await redis.xadd(stream, {"data": encode_event(Usage(turnId=tid, inputTokens=5))})
    for _ in range(after):
        await redis.xadd(stream, {"data": encode_event(TextDelta(turnId=tid, round=2, text="x"))})
    lease = SessionLease(
        redis, keys, user="u1", session="s1", turn_id=tid,
        token=new_lease_token("rescuer", tid), lease_ms=settings.lease_ms,
        heartbeat_ms=settings.heartbeat_ms,
    )  # fmt: skip
    reply = await turn_commit(turns, "rescuer").start("u1", "s1", tid, lease)
    newest = await redis.xrevrange(stream, count=100)
    assert isinstance(decode_event(newest[0][1]["data"]), TurnStarted)
    ids = [i.decode() if isinstance(i, bytes) else i for i in reply.last_usage or []]
    assert ids[:1] == ([usage_id] if found else [newest[-1][0]])
    assert len(ids) == (2 if found else 1)


async def test_a_resumed_tool_loop_gets_its_thinking_back_then_it_is_dropped(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    # A dead attempt committed a tool round with thinking (kept while the turn runs):
    # the resumed attempt sends it back, as the Messages API needs to continue a tool
    # loop, and the finish stores the turn without it.
    settings = dataclasses.replace(settings, claim_idle_ms=200, heartbeat_ms=100)
    turns = TurnStore(redis, keys, settings)
    tid = await ghost_left_a_tool_round(redis, keys, turns, store)

    model = ProgramModel(rounds(text_round("resumed")))
    async with running_worker(settings, model, name="rescuer"):
        events = await wait_terminal(redis, keys, "u1", "s1", tid)
        await wait_until(lambda: no_pending(redis, keys))
    assert types_of(events)[-1] == "turn.completed"
    assert model.requests[0].messages[1] == {"role": "assistant", "content": [THINKING, TOOL_USE]}
    stored = await redis.lrange(keys.messages("u1", "s1"), 0, -1)
    assert [json.loads(r)["kind"] for r in stored] == [
        "prompt", "assistant", "tool_results", "assistant"
    ]  # fmt: skip
    assert all("private reasoning" not in r for r in stored)
    assert json.loads(stored[1])["content"] == [TOOL_USE]


async def test_past_the_attempt_cap_the_turn_fails_worker_lost(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, claim_idle_ms=100, heartbeat_ms=100, max_deliveries=1)
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    record, _, _ = await turns.submit_queued("u1", "s1", "doomed")
    await ghost_takes(redis, keys)
    await start_turn(turns, "u1", "s1", record.turnId, "ghost")  # it started, then died
    model = ProgramModel(rounds())
    async with running_worker(settings, model):
        events = await wait_terminal(redis, keys, "u1", "s1", record.turnId)
        await wait_until(lambda: no_pending(redis, keys))
    last = events[-1]
    assert isinstance(last, TurnFailed) and last.reason == "worker_lost"
    assert "started 1 times (the limit is 1)" in last.message
    assert model.requests == []
    assert await turns.active_turns("u1", "s1") == []
    # The envelope says how the turn ended, not that its dead attempt still runs.
    envelope = await store.read("u1", "s1")
    assert envelope is not None
    assert (envelope.meta.turnRunId, envelope.meta.turnStatus) == (record.turnId, "failed")


async def test_a_turn_ended_worker_lost_leaves_no_thinking_for_the_next_turn(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, claim_idle_ms=100, heartbeat_ms=100, max_deliveries=1)
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    record, _, _ = await turns.submit_queued("u1", "s1", "think hard")
    tid = record.turnId
    await ghost_takes(redis, keys)
    await start_turn(turns, "u1", "s1", tid, "ghost")
    # The dead attempt committed a tool round with thinking (kept while the turn runs).
    await ghost_commits_a_tool_round_with_thinking(redis, keys, tid, "think hard")
    after, _, _ = await turns.submit_queued("u1", "s1", "and now?", multitask="enqueue")

    model = ProgramModel(rounds(text_round("fresh")))
    async with running_worker(settings, model):
        lost = await wait_terminal(redis, keys, "u1", "s1", tid)
        await wait_terminal(redis, keys, "u1", "s1", after.turnId)
    last = lost[-1]
    assert isinstance(last, TurnFailed) and last.reason == "worker_lost"
    # The lost turn's end stored its rows without thinking...
    stored = await redis.lrange(keys.messages("u1", "s1"), 0, -1)
    assert all("private reasoning" not in r for r in stored)
    assert json.loads(stored[1])["content"] == [TOOL_USE]
    # ...so the next turn's first round does not resend it.
    (first_round,) = model.requests
    assert "private reasoning" not in json.dumps(first_round.messages)
    assert first_round.messages[1] == {"role": "assistant", "content": [TOOL_USE]}


async def test_a_reclaimed_entry_of_an_ended_turn_is_only_acked(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, claim_idle_ms=100, heartbeat_ms=100)
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    record, _, _ = await turns.submit_queued("u1", "s1", "already over")
    await ghost_takes(redis, keys)
    await start_turn(turns, "u1", "s1", record.turnId, "ghost")
    await end_turn(turns, "u1", "s1", record.turnId, "failed", reason="internal")
    before = types_of(await turn_events(redis, keys, "u1", "s1", record.turnId))
    model = ProgramModel(rounds())
    async with running_worker(settings, model):
        await wait_until(lambda: no_pending(redis, keys))
    assert types_of(await turn_events(redis, keys, "u1", "s1", record.turnId)) == before
    assert model.requests == []


async def test_a_restarted_worker_takes_its_own_pending_entries_first(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    # claim_idle_ms stays at its 30 s default: only the own-pending path can pick it up.
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    record, _, _ = await turns.submit_queued("u1", "s1", "before the restart")
    await ghost_takes(redis, keys, consumer="w-stable")
    model = ProgramModel(rounds(text_round("after the restart")))
    async with running_worker(settings, model, name="w-stable"):
        events = await wait_terminal(redis, keys, "u1", "s1", record.turnId)
        await wait_until(lambda: no_pending(redis, keys))
    assert types_of(events)[-1] == "turn.completed"
    info = await redis.xinfo_consumers(keys.work(0), GROUP)
    assert [c["name"] for c in info] == ["w-stable"]


async def test_a_deleted_work_entry_is_acked_on_both_redis_versions(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, claim_idle_ms=100, heartbeat_ms=100)
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    record, _, _ = await turns.submit_queued("u1", "s1", "trimmed away")
    await ghost_takes(redis, keys)
    entry_id = (await redis.xrange(keys.work(0)))[0][0]
    await redis.xdel(keys.work(0), entry_id)
    async with running_worker(settings, ProgramModel(rounds())):
        # Redis 7 drops it from the PEL inside XAUTOCLAIM; on 6.2 the worker acks it.
        await wait_until(lambda: no_pending(redis, keys))
    assert (await turns.get("u1", "s1", record.turnId)) is not None


async def test_acked_work_entries_are_trimmed(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, claim_idle_ms=200, heartbeat_ms=100)
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    async with running_worker(settings, ProgramModel(rounds())):
        for i in range(5):
            record, _, _ = await turns.submit_queued("u1", "s1", f"m{i}")
            await wait_terminal(redis, keys, "u1", "s1", record.turnId)

        async def trimmed() -> bool:
            return await redis.xlen(keys.work(0)) == 1  # the last delivered entry stays

        await wait_until(trimmed)
        groups = await redis.xinfo_groups(keys.work(0))
        assert groups[0]["pending"] == 0


async def test_a_turn_interrupted_by_redis_is_redelivered_not_failed(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, claim_idle_ms=200, heartbeat_ms=100)
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        if index == 0:
            raise redis_exceptions.ConnectionError("Connection reset by peer")
        return text_round("second attempt")

    async with running_worker(settings, ProgramModel(program)):
        record, _, _ = await turns.submit_queued("u1", "s1", "flaky")
        events = await wait_terminal(redis, keys, "u1", "s1", record.turnId)
    assert types_of(events)[-1] == "turn.completed"
    assert [e.attempt for e in events if isinstance(e, TurnStarted)] == [1, 2]


async def test_dead_consumers_and_worker_records_are_forgotten(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, claim_idle_ms=100, heartbeat_ms=100)
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    # A consumer that is gone, and owes nothing: it acked what it read.
    await turns.submit_queued("u1", "s1", "done long ago")
    await ghost_takes(redis, keys, consumer="long-gone")
    [(done_id, _)] = await redis.xrange(keys.work(0))
    await redis.xack(keys.work(0), GROUP, done_id)
    await redis.hset(keys.workers(), "long-gone", "1")  # its last heartbeat, long ago
    async with running_worker(settings, ProgramModel(rounds()), name="alive") as worker:
        worker.dead_after_ms = 300

        async def forgotten() -> bool:
            consumers = await redis.xinfo_consumers(keys.work(0), GROUP)
            alive = await redis.hkeys(keys.workers())
            return consumers == [] and alive == ["alive"]

        await wait_until(forgotten)

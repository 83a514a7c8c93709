from __future__ import annotations

import asyncio
import hashlib
import json

import msgspec
import pytest
import redis.asyncio as aioredis

from tests.turn_kit import end_turn, start_turn
from turnbus.shared.envelope import EnvelopeStore, SessionNotFound
from turnbus.shared.events import (
    ToolResult,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnQueued,
    decode_event,
    encode_event,
)
from turnbus.shared.keys import Keys
from turnbus.shared.records import PendingCall
from turnbus.shared.settings import Settings
from turnbus.shared.tool_specs import truncate_tool_result
from turnbus.shared.turns import (
    ActionAnswer,
    ActionsInvalid,
    IdempotencyMismatch,
    SessionBusy,
    TurnNotFound,
    TurnStore,
)

# Runs on one Redis and on the local Redis Cluster.
pytestmark = pytest.mark.cluster

U, S = "bob", "s_1"


@pytest.fixture
async def turns(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> TurnStore:
    await store.create(U, S)
    return TurnStore(redis, keys, settings)


async def events_of(redis: aioredis.Redis, key: str) -> list[object]:
    return [decode_event(f["data"]) for _, f in await redis.xrange(key)]


async def test_submit_writes_record_event_and_work_entry_together(
    turns: TurnStore, redis: aioredis.Redis, keys: Keys
) -> None:
    record, replayed, _ = await turns.submit_queued(U, S, "hello")
    assert not replayed
    assert record.status == "queued"
    assert await turns.get(U, S, record.turnId) == record
    assert await turns.active_turns(U, S) == [record.turnId]
    queued = await events_of(redis, keys.turn_events(U, S, record.turnId))
    assert queued == [TurnQueued(turnId=record.turnId, sessionId=S, at=record.createdAt)]
    work = await redis.xrange(keys.work(0))
    assert [fields for _, fields in work] == [{"user": U, "session": S, "turn": record.turnId}]


async def test_submit_to_a_missing_session_writes_nothing(
    turns: TurnStore, redis: aioredis.Redis, keys: Keys
) -> None:
    with pytest.raises(SessionNotFound):
        await turns.submit_queued(U, "s_missing", "hello")
    assert await redis.xlen(keys.work(0)) == 0


async def test_idempotency_replays_and_refuses_a_different_body(
    turns: TurnStore, redis: aioredis.Redis, keys: Keys
) -> None:
    first, _, _ = await turns.submit_queued(U, S, "hello", idempotency_key="k1")
    again, replayed, _ = await turns.submit_queued(U, S, "hello", idempotency_key="k1")
    assert replayed and again.turnId == first.turnId
    with pytest.raises(IdempotencyMismatch) as info:
        await turns.submit_queued(U, S, "other", idempotency_key="k1")
    assert info.value.turn_id == first.turnId
    assert await redis.xlen(keys.work(0)) == 1


async def test_busy_session_refuses_unless_enqueue(turns: TurnStore) -> None:
    first, _, _ = await turns.submit_queued(U, S, "one")
    with pytest.raises(SessionBusy) as info:
        await turns.submit_queued(U, S, "two")
    assert info.value.active_turn_id == first.turnId
    second, _, _ = await turns.submit_queued(U, S, "two", multitask="enqueue")
    assert await turns.active_turns(U, S) == [first.turnId, second.turnId]


async def test_five_racing_submits_accept_exactly_one(
    turns: TurnStore, redis: aioredis.Redis, keys: Keys
) -> None:
    results = await asyncio.gather(
        *(turns.submit_queued(U, S, f"m{i}") for i in range(5)), return_exceptions=True
    )
    accepted = [r for r in results if not isinstance(r, BaseException)]
    assert len(accepted) == 1
    assert all(isinstance(r, SessionBusy) for r in results if isinstance(r, BaseException))
    assert await redis.xlen(keys.work(0)) == 1


async def test_exactly_one_terminal_event_however_many_finalizers(
    turns: TurnStore, redis: aioredis.Redis, keys: Keys
) -> None:
    record, _, _ = await turns.submit_queued(U, S, "hello")
    started = await start_turn(turns, U, S, record.turnId, "w1")
    assert started is not None and started.status == "running" and started.attempt == 1
    again = await start_turn(turns, U, S, record.turnId, "w2")  # a redelivery after a crash
    assert again is not None and again.attempt == 2 and again.worker == "w2"
    assert again.startedAt == started.startedAt  # the turn's clock runs from its first start
    ids = await asyncio.gather(
        end_turn(turns, U, S, record.turnId, "completed"),
        end_turn(turns, U, S, record.turnId, "failed", reason="internal"),
        turns.request_cancel(U, S, record.turnId),
    )
    assert sum(1 for i in ids[:2] if i is not None) == 1
    events = await events_of(redis, keys.turn_events(U, S, record.turnId))
    assert sum(type(e) in (TurnCompleted, TurnFailed, TurnCancelled) for e in events) == 1
    assert await turns.active_turns(U, S) == []
    assert (
        await start_turn(turns, U, S, record.turnId, "w2") is None
    )  # a late redelivery runs nothing
    assert await redis.ttl(keys.turn_events(U, S, record.turnId)) > 0


async def test_cancel_of_a_queued_turn_ends_it_at_once(
    turns: TurnStore, redis: aioredis.Redis, keys: Keys
) -> None:
    record, _, _ = await turns.submit_queued(U, S, "hello")
    cancelled = await turns.request_cancel(U, S, record.turnId)
    assert cancelled.status == "cancelled"
    events = await events_of(redis, keys.turn_events(U, S, record.turnId))
    assert isinstance(events[-1], TurnCancelled)
    log = await events_of(redis, keys.log(U, S))
    assert isinstance(log[-1], TurnCancelled)
    # The session is free again.
    await turns.submit_queued(U, S, "next")


async def test_cancel_of_a_running_turn_is_announced(
    turns: TurnStore, redis: aioredis.Redis, keys: Keys
) -> None:
    record, _, _ = await turns.submit_queued(U, S, "hello")
    await start_turn(turns, U, S, record.turnId, "w1")
    pubsub = redis.pubsub()
    await pubsub.subscribe(keys.cancel_channel())
    try:
        await pubsub.get_message(timeout=1.0)  # the subscribe confirmation
        after = await turns.request_cancel(U, S, record.turnId)
        assert after.status == "running" and after.cancelRequested
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2.0)
        assert message is not None
        assert json.loads(message["data"]) == {"user": U, "session": S, "turn": record.turnId}
    finally:
        await pubsub.aclose()


async def test_cancel_of_an_unknown_turn(turns: TurnStore) -> None:
    with pytest.raises(TurnNotFound):
        await turns.request_cancel(U, S, "t_nope")


async def test_a_stale_active_head_never_blocks_the_session(
    turns: TurnStore, redis: aioredis.Redis, keys: Keys
) -> None:
    record, _, _ = await turns.submit_queued(U, S, "hello")
    await redis.hset(keys.turn(U, S, record.turnId), "status", "failed")  # ended without LREM
    second, _, _ = await turns.submit_queued(U, S, "next")
    assert await turns.active_turns(U, S) == [second.turnId]


async def test_delete_takes_turns_and_idempotency_keys_along(
    turns: TurnStore, store: EnvelopeStore, redis: aioredis.Redis, prefix: str
) -> None:
    record, _, _ = await turns.submit_queued(U, S, "hello", idempotency_key="k")
    await end_turn(turns, U, S, record.turnId, "completed")
    assert await store.delete(U, S)
    # Its turn's mark in the slot's outbox went with it; the work stream is not the session's.
    left = [k async for k in redis.scan_iter(match=f"{prefix}:{{*")]
    assert left == [Keys(prefix).work(0)]


async def test_finished_turns_expire_and_leave_the_indexes(
    turns: TurnStore, redis: aioredis.Redis, keys: Keys
) -> None:
    record, _, _ = await turns.submit_queued(U, S, "hello", idempotency_key="k")
    await end_turn(turns, U, S, record.turnId, "completed")
    # Both the record and its events are kept for the events TTL, then expire.
    assert 0 < await redis.ttl(keys.turn(U, S, record.turnId)) <= turns.settings.events_ttl_s
    # Once they have expired, the next submit drops them from the session's indexes.
    # Expiry is played by deleting the keys and ageing the entries past their TTLs (an
    # entry younger than its TTL cannot have expired, so a submit does not look at it).
    digest = hashlib.sha256(b"k").hexdigest()
    await redis.delete(keys.turn(U, S, record.turnId), keys.turn_events(U, S, record.turnId))
    await redis.delete(keys.idempotency(U, S, digest))
    old = record.createdAt - 1000 * max(
        turns.settings.events_ttl_s, turns.settings.idempotency_ttl_s
    )
    await redis.zadd(keys.turns(U, S), {record.turnId: old - 1})
    await redis.zadd(keys.idempotency_index(U, S), {digest: old - 1})
    second, _, _ = await turns.submit_queued(U, S, "next")
    assert await redis.zrange(keys.turns(U, S), 0, -1) == [second.turnId]
    assert await redis.zcard(keys.idempotency_index(U, S)) == 0


async def test_an_answer_checked_by_its_script_writes_the_events_a_checked_one_would(
    turns: TurnStore, redis: aioredis.Redis, keys: Keys
) -> None:
    """Results alone go to the script unchecked: it fills in each event's round and
    tool name, and the bytes are those the gateway encodes when it checks them itself
    (an output that looks like the stand-ins included)."""
    record, _, _ = await turns.submit_queued(U, S, "hello")
    tid = record.turnId
    calls = [
        PendingCall(callId="c/1", name="pick_file", input={}),
        PendingCall(callId="c2", name="confirm", input={"q": "é"}),
    ]
    outputs = ['"round":0, and ,"name":"\\u0000name\\u0000" é', "x" * 70_000]
    await redis.hset(
        keys.turn(U, S, tid),
        mapping={"status": "requires_action", "pendingCalls": msgspec.json.encode(calls)},
    )
    await redis.hset(keys.turn_calls(U, S, tid), "round", "3")
    answers = [ActionAnswer(c.callId, out) for c, out in zip(calls, outputs, strict=True)]
    answered, replayed = await turns.submit_actions(U, S, tid, answers[::-1])
    assert (answered.status, answered.pendingCalls, replayed) == ("queued", None, False)
    raw = [f["data"] for _, f in await redis.xrange(keys.turn_events(U, S, tid))][-2:]
    expected = []
    for answer, call in zip(answers[::-1], calls[::-1], strict=True):
        output, truncated = truncate_tool_result(answer.output)
        expected.append(
            encode_event(
                ToolResult(
                    turnId=tid,
                    round=3,
                    callId=call.callId,
                    name=call.name,
                    output=output,
                    truncated=truncated,
                )
            )
        )
    assert raw == [e.decode() for e in expected]
    assert truncate_tool_result(outputs[1])[1]  # the long one was cut


async def test_an_unchecked_answer_that_misses_a_call_is_refused_and_writes_nothing(
    turns: TurnStore, redis: aioredis.Redis, keys: Keys
) -> None:
    record, _, _ = await turns.submit_queued(U, S, "hello")
    tid = record.turnId
    calls = [
        PendingCall(callId="c1", name="a", input={}),
        PendingCall(callId="c2", name="b", input={}),
    ]
    await redis.hset(
        keys.turn(U, S, tid),
        mapping={"status": "requires_action", "pendingCalls": msgspec.json.encode(calls)},
    )
    before = await redis.xlen(keys.turn_events(U, S, tid))
    for answers, code in (
        ([ActionAnswer("c1", "x")], "missing_call"),
        ([ActionAnswer("c1", "x"), ActionAnswer("c1", "y")], "duplicate_call"),
        ([ActionAnswer("c1", "x"), ActionAnswer("c3", "y")], "unknown_call"),
    ):
        with pytest.raises(ActionsInvalid) as caught:
            await turns.submit_actions(U, S, tid, answers)
        assert caught.value.code == code
    assert await redis.hget(keys.turn(U, S, tid), "status") == "requires_action"
    assert await redis.xlen(keys.turn_events(U, S, tid)) == before
    assert not await redis.exists(keys.turn_calls(U, S, tid))

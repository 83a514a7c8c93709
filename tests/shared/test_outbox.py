"""A submit is two calls (the session's script, then the work entry on the shard's
stream): a turn is never lost between them, and never runs twice because of them."""

from __future__ import annotations

import dataclasses

import redis.asyncio as aioredis

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
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.events import TurnStarted, is_terminal
from turnbus.shared.keys import Keys, key_slot
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore, outboxes_due
from turnbus.worker.consumer import GROUP, Worker


async def test_a_turn_whose_work_entry_was_not_written_is_swept_and_runs_once(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, outbox_grace_ms=300)
    turns = TurnStore(redis, keys, settings)
    await store.create("u1", "s1")
    # The second call fails for real: the work stream's name holds a string.
    await redis.set(keys.work(0), "not a stream")
    record, _, _ = await turns.submit_queued("u1", "s1", "hi")
    assert record.status == "queued"
    outbox = keys.outbox("u1", "s1")
    assert await redis.zrange(outbox, 0, -1) == [f"u1:s1:{record.turnId}"]
    await redis.delete(keys.work(0))

    async with running_worker(settings, ProgramModel(rounds(text_round("answer")))):
        events = await wait_terminal(redis, keys, "u1", "s1", record.turnId)
        await wait_until(lambda: no_pending(redis, keys))
    assert types_of(events)[-1] == "turn.completed"
    assert sum(isinstance(e, TurnStarted) for e in events) == 1
    assert sum(is_terminal(e) for e in events) == 1
    # Only the sweeper could have written its entry.
    assert await redis.xlen(keys.work(0)) <= 1
    ended = await turns.get("u1", "s1", record.turnId)
    assert ended is not None and (ended.status, ended.attempt) == ("completed", 1)
    assert await redis.exists(outbox) == 0
    assert await turns.sweep_outboxes(range(key_slot("u1:s1"), key_slot("u1:s1") + 1)) == []


async def test_a_turn_enqueued_twice_runs_once(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    turns = TurnStore(redis, keys, settings)
    await store.create("u1", "s1")
    record, _, _ = await turns.submit_queued("u1", "s1", "hi")
    # The sweeper's entry, as if the submit's own had been slow to land.
    await turns.enqueue("u1", "s1", record.turnId)
    model = ProgramModel(rounds(text_round("answer")), delay_s=0.01)
    async with running_worker(settings, model):
        events = await wait_terminal(redis, keys, "u1", "s1", record.turnId)
        await wait_until(lambda: no_pending(redis, keys))
    assert sum(isinstance(e, TurnStarted) for e in events) == 1
    assert sum(is_terminal(e) for e in events) == 1
    assert len(model.requests) == 1
    groups = await redis.xinfo_groups(keys.work(0))
    assert groups[0]["last-delivered-id"] == (await redis.xrange(keys.work(0)))[-1][0]


async def test_the_sweeper_leaves_a_turn_a_worker_has_seen_and_drops_ended_ones(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, outbox_grace_ms=100)
    turns = TurnStore(redis, keys, settings)
    await store.create("u1", "s1")
    slot = range(key_slot("u1:s1"), key_slot("u1:s1") + 1)
    first, _, _ = await turns.submit_queued("u1", "s1", "hi")
    await turns.request_cancel("u1", "s1", first.turnId)  # ended while queued
    second, _, _ = await turns.submit_queued("u1", "s1", "again")
    outbox = keys.outbox("u1", "s1")
    # Both marks are old; only the queued turn is enqueued again (and its mark renewed).
    await redis.zadd(outbox, {f"u1:s1:{first.turnId}": 0, f"u1:s1:{second.turnId}": 0})
    assert await turns.sweep_outboxes(slot) == [second.turnId]
    assert await redis.zrange(outbox, 0, -1) == [f"u1:s1:{second.turnId}"]
    assert await redis.xlen(keys.work(0)) == 3
    assert await turns.sweep_outboxes(slot) == []  # renewed: not due again yet
    # Deleting the session takes its marks along.
    await store.delete("u1", "s1")
    assert await redis.exists(outbox) == 0


async def test_entries_under_the_old_stream_name_still_run_after_an_upgrade(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    turns = TurnStore(redis, keys, settings)
    await store.create("u1", "s1")
    # An entry queued by the previous version, on the stream name without a hash tag.
    old = keys.legacy_work(0)
    await redis.xgroup_create(old, GROUP, id="0", mkstream=True)
    record, _, _ = await turns.submit_queued("u1", "s1", "hi")
    [(entry_id, fields)] = await redis.xrange(keys.work(0))
    await redis.xdel(keys.work(0), entry_id)
    await redis.xadd(old, fields)
    async with running_worker(settings, ProgramModel(rounds(text_round("answer")))) as worker:
        events = await wait_terminal(redis, keys, "u1", "s1", record.turnId)
        assert types_of(events)[-1] == "turn.completed"
        # Drained and deleted by the operator: the worker reads on without it.
        await wait_until(lambda: _drained(redis, old))
        await redis.delete(old)
        await wait_until(lambda: _not_reading(worker, old))
        second, _, _ = await turns.submit_queued("u1", "s1", "again")
        events = await wait_terminal(redis, keys, "u1", "s1", second.turnId)
        assert types_of(events)[-1] == "turn.completed"


async def _drained(redis: aioredis.Redis, stream: str) -> bool:
    return int((await redis.xpending(stream, GROUP))["pending"]) == 0


async def _not_reading(worker: Worker, stream: str) -> bool:
    return stream not in worker.queue.streams


async def test_a_sweep_of_one_redis_without_marks_asks_once_per_2048_outboxes(
    redis: aioredis.Redis, keys: Keys, settings: Settings
) -> None:
    # Every worker's sweeper runs every half grace period, on an idle service too.
    turns = TurnStore(redis, keys, settings)

    def calls(stats: dict[str, dict[str, int]], command: str) -> int:
        return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))

    before = await redis.info("commandstats")
    assert await turns.sweep_outboxes() == []
    after = await redis.info("commandstats")
    assert calls(after, "zcount") == calls(before, "zcount")
    assert calls(after, "exists") - calls(before, "exists") == 16384 // 2048


async def test_a_sweep_of_one_redis_with_marks_in_every_batch_asks_once_per_batch(
    redis: aioredis.Redis, keys: Keys
) -> None:
    # Paused turns keep their marks until their deadlines, so with many of them every
    # batch of outboxes holds one: a batch is still one command, and only the outboxes
    # with a mark due are named.
    now = 10_000_000
    later = [keys.slot_outbox(slot) for slot in range(0, 16384, 1000)]
    due = [keys.slot_outbox(slot) for slot in (5, 4100, 16383)]
    for key in later:
        await redis.zadd(key, {"u:s:later": now + 60_000})
    for key in due:
        await redis.zadd(key, {"u:s:due": now - 1})
    outboxes = [keys.slot_outbox(slot) for slot in range(16384)]

    before = await redis.info("commandstats")
    found = await outboxes_due(redis, outboxes, now, cluster=False)
    after = await redis.info("commandstats")

    assert found == due
    scripts_run = after["cmdstat_evalsha"]["calls"] - before.get("cmdstat_evalsha", {}).get(
        "calls", 0
    )
    assert 16384 // 2048 <= scripts_run <= 16384 // 2048 + 1  # + 1: loaded at the first
    # The cluster's way (one count per outbox) names the same ones.
    assert await outboxes_due(redis, outboxes, now, cluster=True) == due

from __future__ import annotations

import asyncio
import hashlib
import random

import msgspec
import pytest
import redis.asyncio as aioredis

from turnbus.shared import caps
from turnbus.shared.envelope import (
    ClockAhead,
    EnvelopeConflict,
    EnvelopeStore,
    SessionExists,
    SessionNotFound,
)
from turnbus.shared.events import EnvelopePatched, decode_event
from turnbus.shared.keys import Keys
from turnbus.shared.meta import WORKER_META_KEYS, Meta, MetaInvalid, MetaTooLarge
from turnbus.shared.scripts import load_lua

# Runs on one Redis and on the local Redis Cluster.
pytestmark = pytest.mark.cluster

U, S = "alice", "s_1"


async def log_entries(redis: aioredis.Redis, keys: Keys) -> list[EnvelopePatched]:
    entries = await redis.xrange(keys.log(U, S))
    events = [decode_event(fields["data"]) for _, fields in entries]
    assert all(isinstance(e, EnvelopePatched) for e in events)
    return events  # type: ignore[return-value]


async def test_create_read_and_duplicate_create(store: EnvelopeStore) -> None:
    created = await store.create(U, S, Meta(title="first"))
    assert created.meta == Meta(title="first")
    assert created.updatedAt == created.createdAt > 0
    assert await store.read(U, S) == created
    assert await store.read(U, "s_other") is None
    with pytest.raises(SessionExists):
        await store.create(U, S)


async def test_stale_and_equal_updated_at_rejected_newer_applied(
    store: EnvelopeStore, redis: aioredis.Redis, keys: Keys
) -> None:
    env = await store.create(U, S, Meta(title="v1"))
    with pytest.raises(EnvelopeConflict) as stale:
        await store.host_replace(U, S, env.updatedAt - 1, Meta(title="stale"))
    assert stale.value.current == env
    with pytest.raises(EnvelopeConflict):
        await store.host_replace(U, S, env.updatedAt, Meta(title="equal"))
    assert (await store.read(U, S)) == env
    assert len(await log_entries(redis, keys)) == 1  # only the create

    newer = await store.host_replace(U, S, env.updatedAt + 1, Meta(title="v2"))
    assert newer.meta.title == "v2"
    assert newer.updatedAt == env.updatedAt + 1
    entries = await log_entries(redis, keys)
    assert [e.origin for e in entries] == ["create", "host"]
    assert entries[-1].set == {"title": "v2"}
    assert entries[-1].updatedAt == newer.updatedAt


async def test_host_replace_clears_absent_host_keys(store: EnvelopeStore) -> None:
    env = await store.create(U, S, Meta(title="t", personaId="p", selectedModel="m"))
    after = await store.host_replace(U, S, env.updatedAt + 1, Meta(personaId="p2"))
    assert after.meta == Meta(personaId="p2")


async def test_notes_copied_forward_when_a_host_replace_omits_them(store: EnvelopeStore) -> None:
    await store.create(U, S)
    clock = await store.worker_overlay(U, S, {"workingNotes": "the build is green"})
    after = await store.host_replace(U, S, clock + 1, Meta(title="renamed"))
    assert after.meta.workingNotes == "the build is green"
    assert after.meta.title == "renamed"


async def test_notes_cleared_by_a_present_empty_string(
    store: EnvelopeStore, redis: aioredis.Redis, keys: Keys
) -> None:
    await store.create(U, S)
    clock = await store.worker_overlay(U, S, {"workingNotes": "keep me?"})
    after = await store.host_replace(U, S, clock + 1, Meta(workingNotes=""))
    assert after.meta.workingNotes is None
    assert "workingNotes" not in await redis.hgetall(keys.env(U, S))
    assert (await log_entries(redis, keys))[-1].unset == ["workingNotes"]


async def test_worker_overlay_never_touches_a_host_key(
    store: EnvelopeStore, redis: aioredis.Redis, keys: Keys
) -> None:
    env = await store.create(U, S, Meta(title="mine", personaId="p"))
    with pytest.raises(MetaInvalid, match="title"):
        await store.worker_overlay(U, S, {"title": "hijacked"})
    clock = await store.worker_overlay(U, S, {"turnStatus": "running", "workingNotes": "n"})
    after = await store.read(U, S)
    assert after is not None
    assert (after.meta.title, after.meta.personaId) == ("mine", "p")
    assert after.meta.turnStatus == "running"
    assert clock > env.updatedAt
    assert (await log_entries(redis, keys))[-1].keys == ["turnStatus", "workingNotes"]


async def test_worker_clock_is_strictly_newer_than_a_future_host_clock(
    store: EnvelopeStore,
) -> None:
    env = await store.create(U, S)
    future = env.updatedAt + 10 * 60 * 1000  # a host clock ten minutes ahead
    await store.host_replace(U, S, future, Meta(title="from the future"))
    clock = await store.worker_overlay(U, S, {"statusSlot": "thinking"})
    assert clock == future + 1


SAFE_MAX = 2**53 - 1  # 9007199254740991
DAY_MS = 24 * 60 * 60 * 1000


async def _server_ms(redis: aioredis.Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_a_host_clock_far_ahead_of_the_server_is_refused(
    store: EnvelopeStore, redis: aioredis.Redis
) -> None:
    assert caps.UPDATED_AT_MAX_AHEAD_MS == DAY_MS
    env = await store.create(U, S)
    now = await _server_ms(redis)
    for bad in (now + DAY_MS + 60_000, SAFE_MAX):
        with pytest.raises(ClockAhead) as refused:
            await store.host_replace(U, S, bad, Meta(title="from the far future"))
        assert refused.value.updated_at == bad
        assert now <= refused.value.server_ms < bad
    assert await store.read(U, S) == env
    # Within the window (a host clock some hours fast) is fine.
    ahead = now + DAY_MS - 60_000
    assert (await store.host_replace(U, S, ahead, Meta(title="fast"))).updatedAt == ahead


async def test_worker_clocks_stay_at_most_2_to_the_53_minus_1(
    store: EnvelopeStore, redis: aioredis.Redis, keys: Keys
) -> None:
    assert caps.UPDATED_AT_MAX == SAFE_MAX
    assert f"CLOCK_MAX = '{SAFE_MAX}'" in load_lua("clock.lua")  # the scripts' copy
    await store.create(U, S)
    # A clock left just below the cap (written around the API): counted exactly to it.
    await redis.hset(keys.env(U, S), "updatedAt", str(SAFE_MAX - 2))
    clocks = [await store.worker_overlay(U, S, {"statusSlot": str(i)}) for i in range(3)]
    assert clocks == [SAFE_MAX - 1, SAFE_MAX, SAFE_MAX]
    assert await redis.hget(keys.env(U, S), "updatedAt") == "9007199254740991"
    assert [e.updatedAt for e in (await log_entries(redis, keys))[-3:]] == clocks


async def test_the_scripts_clock_helpers_count_exactly(redis: aioredis.Redis) -> None:
    # clock_of and clock_inc (lua/clock.lua) against Python's integers: their short
    # paths (a clock without leading zeros, a last digit below 9) and the long ones.
    raw = ["0", "000", "007", "10", "1796481060818", "0001796481060818", "", "12a", " 1", "-5"]
    counted = ["0", "1", "8", "9", "19", "99", "1099", "1796481060818", "9007199254740990"]

    async def each(call: str, values: list[str]) -> list[str]:
        script = load_lua("clock.lua") + (
            f"local out = {{}} for i, v in ipairs(ARGV) do out[i] = {call}(v) end return out"
        )
        replies = await redis.eval(script, 1, "clock-helpers", *values)  # type: ignore[misc]
        return [r.decode() if isinstance(r, bytes) else r for r in replies]

    digits = [v if v and v.isdigit() else "" for v in raw]
    assert await each("clock_of", raw) == [str(int(v)) if v else "0" for v in digits]
    assert await each("clock_inc", counted) == [str(int(v) + 1) for v in counted]


async def test_a_host_is_not_locked_out_by_a_clock_left_far_ahead(
    store: EnvelopeStore, redis: aioredis.Redis, keys: Keys
) -> None:
    await store.create(U, S)
    for relic in (SAFE_MAX, 2**63):
        # What a host clock at 2^53 - 1 left before the window existed (or a writer
        # around the API): the worker does not push it further, and the host's next
        # write within the window replaces it.
        await redis.hset(keys.env(U, S), "updatedAt", str(relic))
        assert await store.worker_overlay(U, S, {"statusSlot": "x"}) == SAFE_MAX
        now = await _server_ms(redis)
        env = await store.host_replace(U, S, now, Meta(title=str(relic)))
        assert (env.updatedAt, env.meta.title) == (now, str(relic))
        assert await store.worker_overlay(U, S, {"statusSlot": "y"}) > now
        with pytest.raises(EnvelopeConflict):
            await store.host_replace(U, S, now, Meta(title="stale"))


async def test_a_host_clock_beyond_2_to_the_53_minus_1_is_refused(store: EnvelopeStore) -> None:
    env = await store.create(U, S)
    for bad in (SAFE_MAX + 1, SAFE_MAX + 2, 2**63, -1):
        with pytest.raises(MetaInvalid) as refused:
            await store.host_replace(U, S, bad, Meta(title="x"))
        assert refused.value.key == "updatedAt"
    assert await store.read(U, S) == env


async def test_writes_to_a_missing_session_fail_and_write_nothing(
    store: EnvelopeStore, redis: aioredis.Redis, keys: Keys
) -> None:
    with pytest.raises(SessionNotFound):
        await store.worker_overlay(U, S, {"workingNotes": "x"})
    with pytest.raises(SessionNotFound):
        await store.host_replace(U, S, 1, Meta(title="x"))
    assert not await redis.exists(keys.env(U, S), keys.log(U, S))


async def test_meta_budget_enforced_with_nothing_written(
    store: EnvelopeStore, redis: aioredis.Redis, keys: Keys
) -> None:
    env = await store.create(U, S)
    half = "p" * caps.PERSONA_SNAPSHOT_MAX_BYTES
    env = await store.host_replace(
        U,
        S,
        env.updatedAt + 1,
        Meta(personaSnapshot=half, attachedSkills='"' + "s" * 500_000 + '"'),
    )
    before_hash = await redis.hgetall(keys.env(U, S))
    before_log = await redis.xlen(keys.log(U, S))
    with pytest.raises(MetaTooLarge) as info:
        await store.worker_overlay(U, S, {"workingNotes": "n" * caps.WORKING_NOTES_MAX_BYTES})
    assert info.value.size > caps.HARNESS_SESSION_MAX_META_BYTES
    with pytest.raises(MetaTooLarge):
        await store.host_replace(
            U,
            S,
            env.updatedAt + 1,
            Meta(
                personaSnapshot=half,
                attachedSkills='"' + "s" * (caps.PERSONA_SNAPSHOT_MAX_BYTES - 2) + '"',
            ),
        )
    assert await redis.hgetall(keys.env(U, S)) == before_hash
    assert await redis.xlen(keys.log(U, S)) == before_log


async def test_poison_written_raw_reads_back_as_unset(
    store: EnvelopeStore, redis: aioredis.Redis, keys: Keys
) -> None:
    await store.create(U, S, Meta(title="ok"))
    # Bytes written around the API: what no API would write.
    await redis.hset(
        keys.env(U, S),
        mapping={
            "workingNotes": b"n" * (caps.WORKING_NOTES_MAX_BYTES + 1),
            "statusSlot": b"\xff\xfe not utf-8",
            "turnCursor": b"",
            "personaSnapshot": b"   ",
            "notAKey": b"whatever",
        },
    )
    env = await store.read(U, S)
    assert env is not None
    assert env.meta == Meta(title="ok", personaSnapshot="   ")
    assert env.meta.workingNotes is None


async def test_whitespace_only_notes_in_the_hash_read_as_unset(
    store: EnvelopeStore, redis: aioredis.Redis, keys: Keys
) -> None:
    await store.create(U, S)
    await redis.hset(keys.env(U, S), "workingNotes", " \n\t ")
    env = await store.read(U, S)
    assert env is not None and env.meta.workingNotes is None


async def test_script_reloaded_after_a_script_flush(
    store: EnvelopeStore, redis: aioredis.Redis
) -> None:
    await store.create(U, S)
    await redis.script_flush()
    assert await store.worker_overlay(U, S, {"statusSlot": "after flush"}) > 0
    env = await store.read(U, S)
    assert env is not None and env.meta.statusSlot == "after flush"


async def test_delete_removes_every_key_of_the_session(
    store: EnvelopeStore, redis: aioredis.Redis, keys: Keys, prefix: str
) -> None:
    await store.create(U, S)
    await store.create(U, "s_2")
    await store.worker_overlay(U, S, {"workingNotes": "x"})
    assert await store.delete(U, S) is True
    assert await store.delete(U, S) is False
    remaining = [k async for k in redis.scan_iter(match=f"{prefix}:*")]
    index = keys.user_sessions(U)
    assert remaining and all("{alice:s_2}" in k for k in remaining if k != index)
    # The user's sessions index keeps only the session still there.
    assert [m.split(":")[1] for m in await redis.zrange(index, 0, -1)] == ["s_2"]


def replay(entries: list[EnvelopePatched]) -> tuple[dict[str, str], int]:
    """The meta the log describes; the notes as their sha256 (the log never has their text)."""
    meta: dict[str, str] = {}
    clock = 0
    for entry in entries:
        for key in entry.unset:
            meta.pop(key, None)
        meta.update(entry.set)
        assert "workingNotes" not in entry.set
        if entry.notes is not None:
            meta["workingNotes"] = entry.notes.sha256
        assert entry.updatedAt > clock, "the log's clock only moves forward"
        clock = entry.updatedAt
    return meta, clock


@pytest.mark.timeout(30)
async def test_fifty_mixed_writers_log_replays_to_the_envelope(
    store: EnvelopeStore, redis: aioredis.Redis, keys: Keys
) -> None:
    env = await store.create(U, S, Meta(title="start"))
    rng = random.Random(7)
    worker_written: dict[str, int] = {}
    outcomes: list[str] = []

    async def host(i: int) -> None:
        # A host client's loop: read, write strictly newer, retry on a conflict.
        meta = Meta(title=f"host {i}", personaId=f"p{i}" if i % 2 else None)
        for _ in range(100):
            current = await store.read(U, S)
            assert current is not None
            try:
                await store.host_replace(U, S, current.updatedAt + 1 + rng.randrange(3), meta)
                outcomes.append("host")
                return
            except EnvelopeConflict:
                outcomes.append("conflict")
        raise AssertionError("a host writer never got through")

    async def worker(i: int) -> None:
        key = WORKER_META_KEYS[i % len(WORKER_META_KEYS)]
        value = "running" if key == "turnStatus" else f"w{i}"
        await store.worker_overlay(U, S, {key: value})
        worker_written[key] = worker_written.get(key, 0) + 1
        outcomes.append("worker")

    writers = [host(i) if i % 2 else worker(i) for i in range(50)]
    rng.shuffle(writers)
    await asyncio.gather(*writers)

    entries = await log_entries(redis, keys)
    applied = outcomes.count("host") + outcomes.count("worker")
    assert len(entries) == 1 + applied  # the create, then one entry per applied write
    replayed, clock = replay(entries)
    stored = await redis.hgetall(keys.env(U, S))
    assert int(stored.pop("updatedAt")) == clock
    stored.pop("createdAt")
    if "workingNotes" in stored:
        stored["workingNotes"] = hashlib.sha256(stored["workingNotes"].encode()).hexdigest()
    assert replayed == stored
    # No worker key is ever lost to a host replace that omitted it.
    assert set(worker_written) <= set(stored)
    final = await store.read(U, S)
    assert final is not None and final.updatedAt > env.updatedAt
    assert msgspec.structs.asdict(final.meta)["title"].startswith("host")

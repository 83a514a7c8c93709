"""Session lifetimes (``TURNBUS_SESSION_TTL_DAYS``) and erasing a user (shared/purge.py,
``DELETE /v1/users/me``, ``turnbus purge``), on one Redis and on the local cluster."""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
import pytest
import redis.asyncio as aioredis

from tests.gateway_server import live_gateway, signed_in, wait_for
from tests.worker_kit import running_worker, wait_terminal
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import Keys
from turnbus.shared.purge import UserPurge
from turnbus.shared.scripts import LuaScript
from turnbus.shared.settings import Settings, SettingsError
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.scripted import ScriptedModel

pytestmark = pytest.mark.cluster

_DAY_S = 86_400


def _ttl_days(seconds: float) -> float:
    return seconds / _DAY_S


def test_the_lifetime_setting_takes_decimal_days_and_refuses_the_rest() -> None:
    assert Settings.from_env({}).session_ttl_ms == 0
    assert Settings.from_env({"TURNBUS_SESSION_TTL_DAYS": "0.5"}).session_ttl_ms == 43_200_000
    assert Settings.from_env({"TURNBUS_SESSION_TTL_DAYS": "0.00002"}).session_ttl_ms == 1728
    for bad in ("soon", "-1", "nan", "inf", "4000", "1e-12"):
        with pytest.raises(SettingsError, match="TURNBUS_SESSION_TTL_DAYS"):
            Settings.from_env({"TURNBUS_SESSION_TTL_DAYS": bad})


async def _user_keys(redis: aioredis.Redis, keys: Keys, user: str) -> list[str]:
    found = [k async for k in redis.scan_iter(match=f"{keys.prefix}:{{{user}:*", count=1000)]
    found += [k async for k in redis.scan_iter(match=f"{keys.prefix}:user:{user}:*", count=1000)]
    return found


@pytest.mark.timeout(30)
async def test_an_idle_session_expires_answers_404_and_leaves_the_list(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    settings = dataclasses.replace(settings, session_ttl_days=_ttl_days(1.5))
    async with live_gateway(settings) as gw, signed_in(gw, settings) as http:
        r = await http.post("/v1/sessions", json={"meta": {"title": "short-lived"}})
        assert r.status_code == 201, r.text
        sid = r.json()["sessionId"]
        assert 0 < await redis.pttl(keys.env("alice", sid)) <= 1500
        assert 0 < await redis.pttl(keys.log("alice", sid)) <= 1500
        assert [s["sessionId"] for s in (await http.get("/v1/sessions")).json()["sessions"]] == [
            sid
        ]

        async def gone() -> bool:
            return (await http.get(f"/v1/sessions/{sid}")).status_code == 404

        await wait_for(gone, 10, "the session to expire")
        r = await http.post(f"/v1/sessions/{sid}/turns", json={"message": "hello"})
        assert r.status_code == 404
        assert (await http.get("/v1/sessions")).json() == {"sessions": [], "nextCursor": None}
        # The listing dropped the expired session's entry; nothing of it is left.
        assert await redis.zcard(keys.user_sessions("alice")) == 0
        assert await _user_keys(redis, keys, "alice") == []


@pytest.mark.timeout(30)
async def test_a_turn_starts_the_lifetime_again_at_submit_and_at_its_end(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    ttl_ms = 20_000
    settings = dataclasses.replace(settings, session_ttl_days=ttl_ms / 1000 / _DAY_S)
    store = EnvelopeStore(redis, keys, session_ttl_ms=settings.session_ttl_ms)
    turns = TurnStore(redis, keys, settings)
    await store.create("u1", "s1")
    fixed = [keys.env("u1", "s1"), keys.log("u1", "s1")]
    # Time passes: what is left of the lifetime shrinks.
    for key in fixed:
        await redis.pexpire(key, 1_000)
    record, _, _ = await turns.submit_queued(
        "u1", "s1", "remember the lifetime", idempotency_key="k1"
    )
    for key in [
        *fixed,
        keys.turns("u1", "s1"),
        keys.active("u1", "s1"),
        keys.idempotency_index("u1", "s1"),
    ]:
        assert 1_000 < await redis.pttl(key) <= ttl_ms, key
    # The turn's own keys (their expiries are their own) live no longer than the session.
    for key in (
        keys.turn("u1", "s1", record.turnId),
        keys.turn_events("u1", "s1", record.turnId),
    ):
        assert 0 < await redis.pttl(key) <= ttl_ms, key
    for key in fixed:
        await redis.pexpire(key, 1_000)
    async with running_worker(settings, ScriptedModel(settings)):
        await wait_terminal(redis, keys, "u1", "s1", record.turnId)
    # The end started it again, the history written during the turn included.
    for key in [*fixed, keys.messages("u1", "s1")]:
        assert 1_000 < await redis.pttl(key) <= ttl_ms, key
    assert 0 < await redis.pttl(keys.turn("u1", "s1", record.turnId)) <= ttl_ms


async def test_without_a_lifetime_nothing_of_a_session_expires(
    settings: Settings, redis: aioredis.Redis, keys: Keys, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    record, _, _ = await TurnStore(redis, keys, settings).submit_queued("u1", "s1", "hi")
    for key in (keys.env("u1", "s1"), keys.log("u1", "s1"), keys.turn("u1", "s1", record.turnId)):
        assert await redis.pttl(key) == -1, key


async def _create_sessions(
    redis: aioredis.Redis, keys: Keys, user: str, count: int, chunk: int = 1000
) -> None:
    """``count`` sessions of ``user`` as ``POST /v1/sessions`` makes them (the envelope
    script, then the index entry), pipelined a chunk at a time."""
    create = LuaScript(redis, "envelope_write.lua")
    await EnvelopeStore(redis, keys).create(user, "s-first")  # loads the script
    payload = msgspec.json.encode({"set": {"title": "t"}})
    for start in range(1, count, chunk):
        names = [f"s-{i}" for i in range(start, min(start + chunk, count))]
        async with redis.pipeline(transaction=False) as pipe:
            for name in names:
                script_keys = [keys.env(user, name), keys.log(user, name)]
                args = ["create", "0", "1048576", "100", payload, name]
                pipe.execute_command("EVALSHA", create.sha, 2, *script_keys, *args)
            await pipe.execute()
        async with redis.pipeline(transaction=False) as pipe:
            for i, name in enumerate(names):
                pipe.zadd(keys.user_sessions(user), {f"{start + i:016d}:{name}": 0})
            await pipe.execute()


@pytest.mark.timeout(120)
async def test_a_purge_of_ten_thousand_sessions_leaves_nothing_and_holds_one_batch(
    settings: Settings, redis: aioredis.Redis, keys: Keys, store: EnvelopeStore
) -> None:
    await _create_sessions(redis, keys, "heavy", 10_000)
    # Some sessions with turns (their records, events, outbox marks), one queued.
    turns = TurnStore(redis, keys, settings)
    queued = []
    for i in range(1, 6):
        record, _, _ = await turns.submit_queued(
            "heavy", f"s-{i}", "hello", idempotency_key=f"k{i}"
        )
        queued.append(record)
    # A session the index lost (its entry missed), and another user's session.
    unlisted = await store.create("heavy", "unlisted")
    await redis.zrem(keys.user_sessions("heavy"), f"{unlisted.createdAt:016d}:unlisted")
    await store.create("other", "kept")
    await turns.submit_queued("other", "kept", "hello")
    other_before = sorted(await _user_keys(redis, keys, "other"))

    purge = UserPurge(redis, keys, "heavy", batch=500)
    while await purge.index_batch():
        pass
    # The index walk held 500 names at a time, 20 batches for 10,000 sessions.
    assert purge.counts.sessions == 10_000
    assert purge.counts.batches == 20
    assert purge.counts.largest_batch == 500
    assert purge.counts.turns_cancelled == 5
    left = await _user_keys(redis, keys, "heavy")
    assert left and all(":unlisted}" in k for k in left)
    await purge.sweep()
    assert purge.counts.sessions == 10_001
    assert purge.counts.largest_batch <= 500
    assert await _user_keys(redis, keys, "heavy") == []
    # The turns' outbox marks went with them; the other user's keys are intact.
    for record in queued:
        outbox = keys.outbox("heavy", record.sessionId)
        assert await redis.zscore(outbox, f"heavy:{record.sessionId}:{record.turnId}") is None
    assert sorted(await _user_keys(redis, keys, "other")) == other_before
    assert await store.read("other", "kept") is not None


@pytest.mark.timeout(60)
async def test_erasing_me_needs_the_confirmation_then_deletes_everything(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    # A quota on: the user's counters are theirs too, and go with them.
    settings = dataclasses.replace(settings, quota_running_turns=10)
    async with live_gateway(settings) as gw, signed_in(gw, settings) as http:
        sessions = []
        for _ in range(3):
            r = await http.post("/v1/sessions")
            sessions.append(r.json()["sessionId"])
        r = await http.post(f"/v1/sessions/{sessions[0]}/turns", json={"message": "hello"})
        assert r.status_code == 202
        assert await redis.exists(keys.user_quota("alice"))
        async with signed_in(gw, settings, user="bob") as bob:
            kept = (await bob.post("/v1/sessions")).json()["sessionId"]

            for body in (None, {}, {"confirm": "bob"}, {"confirm": ""}):
                r = await http.request("DELETE", "/v1/users/me", json=body)
                assert r.status_code == 422, r.text
                assert r.json()["error"]["code"] == "confirmation_required"
                assert r.json()["error"]["field"] == "confirm"
            r = await http.request("DELETE", "/v1/users/me", json={"confirm": "alice", "x": 1})
            assert r.status_code == 422
            listed = (await http.get("/v1/sessions")).json()["sessions"]
            assert len(listed) == 3  # nothing was deleted

            r = await http.request("DELETE", "/v1/users/me", json={"confirm": "alice"})
            assert r.status_code == 200, r.text
            assert r.json() == {"done": True, "sessionsDeleted": 3, "turnsCancelled": 1}
            assert (await http.get(f"/v1/sessions/{sessions[0]}")).status_code == 404
            assert (await http.get("/v1/sessions")).json()["sessions"] == []
            assert await _user_keys(redis, keys, "alice") == []
            assert (await bob.get(f"/v1/sessions/{kept}")).status_code == 200
            # Again: nothing left, done at once.
            r = await http.request("DELETE", "/v1/users/me", json={"confirm": "alice"})
            assert r.json() == {"done": True, "sessionsDeleted": 0, "turnsCancelled": 0}


@pytest.mark.timeout(60)
async def test_turnbus_purge_prints_progress_and_leaves_nothing(
    settings: Settings,
    redis: aioredis.Redis,
    keys: Keys,
    store: EnvelopeStore,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from turnbus.cli import main

    await _create_sessions(redis, keys, "carol", 45)
    await store.create("dave", "kept")
    monkeypatch.setenv("TURNBUS_PREFIX", keys.prefix)
    monkeypatch.setenv("TURNBUS_REDIS_CLUSTER", "1" if settings.redis_cluster else "0")
    argv = ["purge", "--user", "carol", "--batch", "10", "--redis-url", settings.redis_url]
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("sessions index:") for line in out) == 5
    assert out[-1].startswith("done: 45 session(s) deleted")
    assert await _user_keys(redis, keys, "carol") == []
    assert await store.read("dave", "kept") is not None


def test_turnbus_purge_refuses_an_impossible_user(capsys: pytest.CaptureFixture[str]) -> None:
    from turnbus.cli import main

    assert main(["purge", "--user", "a:b", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert "user" in capsys.readouterr().err


async def test_a_purge_matches_the_user_id_literally(
    redis: aioredis.Redis, keys: Keys, store: EnvelopeStore
) -> None:
    # A user id may hold SCAN's glob characters: the sweep matches it, and only it.
    for user in ("a*", "ab", "a[b]", "a\\b"):
        await store.create(user, "s1")
    purge = UserPurge(redis, keys, "a*", batch=10)
    await redis.delete(keys.user_sessions("a*"))  # the sweep alone finds the session
    await purge.sweep()
    assert purge.counts.sessions == 1
    assert await store.read("a*", "s1") is None
    for user in ("ab", "a[b]", "a\\b"):
        assert await store.read(user, "s1") is not None, user

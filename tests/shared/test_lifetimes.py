"""Session lifetimes (``TURNBUS_SESSION_TTL_DAYS``), on one Redis and on the local cluster."""

from __future__ import annotations

import dataclasses

import pytest
import redis.asyncio as aioredis

from tests.gateway_server import live_gateway, signed_in, wait_for
from tests.worker_kit import running_worker, wait_terminal
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import Keys
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

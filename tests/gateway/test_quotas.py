"""Per-user quotas at submit: each limit's 429, its Retry-After, nothing written on a
refusal, two gateways sharing the counts, the token's ``quotas`` claim."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jwt
import pytest
import redis.asyncio as aioredis

from harness.waits import poll
from tests.gateway_server import LiveGateway, live_gateway, signed_in
from tests.turn_kit import end_turn
from turnbus.shared import quotas
from turnbus.shared.keys import Keys
from turnbus.shared.quotas import QuotaLimits
from turnbus.shared.scripts import text
from turnbus.shared.settings import Settings

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]


@contextlib.asynccontextmanager
async def client_with_claims(
    gw: LiveGateway, settings: Settings, user: str = "alice", **claims: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """A client whose token carries extra claims (``quotas=…``)."""
    assert settings.jwt_secret
    now = int(time.time())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jwt.warnings.InsecureKeyLengthWarning)
        token = jwt.encode(
            {"sub": user, "iat": now, "exp": now + 600, **claims}, settings.jwt_secret, "HS256"
        )
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=gw.base_url, headers=headers, timeout=10) as client:
        yield client


async def _sessions(http: httpx.AsyncClient, n: int) -> list[str]:
    return [str((await http.post("/v1/sessions")).json()["sessionId"]) for _ in range(n)]


async def _submit(http: httpx.AsyncClient, sid: str, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"message": "hello"}
    headers = extra.pop("headers", None)
    body.update(extra)
    return await http.post(f"/v1/sessions/{sid}/turns", json=body, headers=headers)


def _quota_error(r: httpx.Response, field: str) -> tuple[dict[str, Any], int]:
    assert r.status_code == 429, r.text
    error: dict[str, Any] = r.json()["error"]
    assert error["code"] == "quota_exceeded"
    assert error["field"] == field
    return error, int(r.headers["Retry-After"])


async def _keys_of(redis: aioredis.Redis, keys: Keys) -> list[str]:
    return sorted([text(k) async for k in redis.scan_iter(match=f"{keys.prefix}:*")])


async def _redis_ms(redis: aioredis.Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_running_turns_refused_nothing_written_then_admitted_after_an_end(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    settings = dataclasses.replace(settings, quota_running_turns=2)
    async with live_gateway(settings) as gw, signed_in(gw, settings) as http:
        s1, s2, s3 = await _sessions(http, 3)
        t1 = (await _submit(http, s1)).json()["turnId"]
        assert (await _submit(http, s2)).status_code == 202
        before = await _keys_of(redis, keys)

        r = await _submit(http, s3, headers={"Idempotency-Key": "k3"})
        error, retry_after = _quota_error(r, "runningTurns")
        assert 1 <= retry_after <= 5
        assert "(2;" in error["message"]
        # Nothing written: no turn, no active entry, no key, the counters as they were.
        assert await redis.zcard(keys.turns("alice", s3)) == 0
        assert await redis.llen(keys.active("alice", s3)) == 0
        assert await _keys_of(redis, keys) == before
        assert text(await redis.hget(keys.user_quota("alice"), "running")) == "2"

        # A turn's end (as the worker gives its count back) frees a running turn.
        await end_turn(gw.gateway.turns, "alice", s1, t1, "completed")
        await gw.gateway.turns.quotas.turn_ended("alice", s1)
        assert (await _submit(http, s3)).status_code == 202


async def test_a_lost_release_is_recounted_from_the_sessions_active_lists(
    settings: Settings, redis: aioredis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quotas, "RECOUNT_INTERVAL_MS", 0)
    settings = dataclasses.replace(settings, quota_running_turns=1)
    async with live_gateway(settings) as gw, signed_in(gw, settings) as http:
        s1, s2 = await _sessions(http, 2)
        t1 = (await _submit(http, s1)).json()["turnId"]
        _quota_error(await _submit(http, s2), "runningTurns")
        # The turn ends and its release is lost (the worker died after its finish).
        await end_turn(gw.gateway.turns, "alice", s1, t1, "completed")
        assert (await _submit(http, s2)).status_code == 202
        _quota_error(await _submit(http, s1), "runningTurns")


async def test_queued_turns_count_turns_behind_a_running_one(settings: Settings) -> None:
    settings = dataclasses.replace(settings, quota_running_turns=5, quota_queued_turns=2)
    async with live_gateway(settings) as gw, signed_in(gw, settings) as http:
        s1, s2 = await _sessions(http, 2)
        assert (await _submit(http, s1)).status_code == 202  # running
        assert (await _submit(http, s1, multitask="enqueue")).status_code == 202
        assert (await _submit(http, s2)).status_code == 202  # running, on its own session
        assert (await _submit(http, s2, multitask="enqueue")).status_code == 202
        _, retry_after = _quota_error(await _submit(http, s1, multitask="enqueue"), "queuedTurns")
        assert 1 <= retry_after <= 5
        # A reject-mode submit to a busy session is the session's 409, not a quota's.
        r = await _submit(http, s1)
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy"
        # That refusal gave back what it counted: the user's counts are as before.
        counts = await gw.gateway.redis.hmget(
            gw.gateway.keys.user_quota("alice"), "running", "queued"
        )
        assert [text(c) for c in counts] == ["2", "2"]


async def test_turns_per_minute_retry_after_is_the_minutes_remainder(
    settings: Settings, redis: aioredis.Redis
) -> None:
    settings = dataclasses.replace(settings, quota_turns_per_minute=3)
    # Start early in a minute of Redis's clock, so the window does not turn mid-test.
    await poll(
        lambda: _early_in_minute(redis), within=50, interval=0.2, what="the start of a minute"
    )
    async with live_gateway(settings) as gw, signed_in(gw, settings) as http:
        sessions = await _sessions(http, 4)
        for sid in sessions[:3]:
            assert (await _submit(http, sid)).status_code == 202
        r = await _submit(http, sessions[3])
        now = await _redis_ms(redis)
        _, retry_after = _quota_error(r, "turnsPerMinute")
        expected = (60_000 - now % 60_000) / 1000
        assert abs(retry_after - expected) <= 2, (retry_after, expected)


async def _early_in_minute(redis: aioredis.Redis) -> bool:
    # The test takes a second or two: a minute with 5 s left is early enough.
    return await _redis_ms(redis) % 60_000 < 55_000


async def test_tokens_per_day_retry_after_is_the_days_remainder(
    settings: Settings, redis: aioredis.Redis
) -> None:
    settings = dataclasses.replace(settings, quota_tokens_per_day=1000)
    async with live_gateway(settings) as gw, signed_in(gw, settings) as http:
        (sid,) = await _sessions(http, 1)
        await gw.gateway.turns.quotas.add_tokens("alice", 999)
        assert (await _submit(http, sid)).status_code == 202
        await gw.gateway.turns.quotas.add_tokens("alice", 1)  # the day's 1,000th token
        r = await _submit(http, sid, multitask="enqueue")
        now = await _redis_ms(redis)
        _, retry_after = _quota_error(r, "tokensPerDay")
        expected = (86_400_000 - now % 86_400_000) / 1000
        assert abs(retry_after - expected) <= 2, (retry_after, expected)
        # Another user's day is their own.
        async with signed_in(gw, settings, "bob") as bob:
            (other,) = await _sessions(bob, 1)
            assert (await _submit(bob, other)).status_code == 202


async def test_two_gateways_share_one_users_counts(settings: Settings) -> None:
    settings = dataclasses.replace(settings, quota_running_turns=2, quota_turns_per_minute=50)
    async with (
        live_gateway(settings) as one,
        live_gateway(settings) as two,
        signed_in(one, settings) as http_one,
        signed_in(two, settings) as http_two,
    ):
        s1, s2, s3 = await _sessions(http_one, 3)
        assert (await _submit(http_one, s1)).status_code == 202
        assert (await _submit(http_two, s2)).status_code == 202
        _quota_error(await _submit(http_one, s3), "runningTurns")
        _quota_error(await _submit(http_two, s3), "runningTurns")


async def test_a_claim_lowers_a_limit_and_is_capped_by_the_deployment(settings: Settings) -> None:
    settings = dataclasses.replace(settings, quota_running_turns=2)
    async with live_gateway(settings) as gw:
        async with client_with_claims(gw, settings, quotas={"runningTurns": 1}) as http:
            s1, s2 = await _sessions(http, 2)
            assert (await _submit(http, s1)).status_code == 202
            error, _ = _quota_error(await _submit(http, s2), "runningTurns")
            assert "(1;" in error["message"]
        # A claim above the deployment's cap gets the cap.
        async with client_with_claims(gw, settings, "bob", quotas={"runningTurns": 10}) as http:
            s1, s2, s3 = await _sessions(http, 3)
            assert (await _submit(http, s1)).status_code == 202
            assert (await _submit(http, s2)).status_code == 202
            error, _ = _quota_error(await _submit(http, s3), "runningTurns")
            assert "(2;" in error["message"]
        # A limit the deployment leaves off is the claim's.
        claim = {"turnsPerMinute": 1}
        async with client_with_claims(gw, settings, "carol", quotas=claim) as http:
            s1, s2 = await _sessions(http, 2)
            assert (await _submit(http, s1)).status_code == 202
            _quota_error(await _submit(http, s2), "turnsPerMinute")
        # A malformed claim is refused like any bad token.
        for bad in ({"runningTurns": 0}, {"runTurns": 1}, ["runningTurns"]):
            async with client_with_claims(gw, settings, "dave", quotas=bad) as http:
                r = await http.post("/v1/sessions")
                assert r.status_code == 401, bad
                assert "quotas" in r.json()["error"]["message"]


async def test_a_retry_of_an_accepted_submit_replays_at_the_limit(settings: Settings) -> None:
    settings = dataclasses.replace(settings, quota_running_turns=1)
    async with live_gateway(settings) as gw, signed_in(gw, settings) as http:
        (sid,) = await _sessions(http, 1)
        first = await _submit(http, sid, headers={"Idempotency-Key": "k1"})
        assert first.status_code == 202
        again = await _submit(http, sid, headers={"Idempotency-Key": "k1"})
        assert again.status_code == 202 and again.headers["Idempotent-Replayed"] == "true"
        assert again.json()["turnId"] == first.json()["turnId"]


def test_limits_from_settings_and_claim() -> None:
    caps = Settings(quota_running_turns=3, quota_tokens_per_day=100)
    assert QuotaLimits.of(caps) == QuotaLimits(running_turns=3, tokens_per_day=100)
    lowered = QuotaLimits.of(caps, {"runningTurns": 1, "tokensPerDay": 500, "queuedTurns": 4})
    assert lowered == QuotaLimits(running_turns=1, queued_turns=4, tokens_per_day=100)
    assert not QuotaLimits.of(Settings()).any
    assert QuotaLimits(running_turns=1, tokens_per_day=5).record_value() == "active tokens"
    assert QuotaLimits(turns_per_minute=5).record_value() is None

"""The worker's side of the quotas: a turn's end gives back its running count, and each
round's tokens are added to its user's day."""

from __future__ import annotations

import dataclasses

import pytest
import redis.asyncio as aioredis

from tests.worker_kit import running_worker, wait_until
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import Keys
from turnbus.shared.quotas import QuotaLimits
from turnbus.shared.scripts import text
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.scripted import ScriptedModel

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]


async def test_a_turns_end_gives_back_its_count_and_its_rounds_count_tokens(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, quota_running_turns=1, quota_tokens_per_day=10**9)
    limits = QuotaLimits.of(settings)
    turns = TurnStore(redis, keys, settings)
    await store.create("u1", "s1")
    await store.create("u1", "s2")
    quota = keys.user_quota("u1")
    async with running_worker(settings, ScriptedModel(settings)):
        record, _, _ = await turns.submit_queued("u1", "s1", "remember the plan", limits=limits)
        assert record.quotas == "active tokens"

        async def ended() -> bool:
            stored = await turns.get("u1", "s1", record.turnId)
            return stored is not None and stored.status == "completed"

        await wait_until(ended, 20)
        stored = await turns.get("u1", "s1", record.turnId)
        assert stored is not None and stored.usage is not None
        u = stored.usage
        spent = u.inputTokens + u.outputTokens + u.cacheReadTokens + u.cacheWriteTokens
        assert spent > 0

        async def given_back() -> bool:
            return text(await redis.hget(quota, "running")) == "0"

        await wait_until(given_back, 10)
        assert await redis.hget(quota, "s:s1") is None
        assert int(text(await redis.hget(quota, "tokens"))) == spent
        # The running turn's place is free again: another session's turn is admitted.
        again, _, _ = await turns.submit_queued("u1", "s2", "hello", limits=limits)
        await wait_until(lambda: _ended(turns, "s2", again.turnId), 20)


async def _ended(turns: TurnStore, session: str, turn_id: str) -> bool:
    stored = await turns.get("u1", session, turn_id)
    return stored is not None and stored.terminal


async def test_cancelling_a_queued_turn_gives_back_its_count(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, quota_running_turns=1, quota_queued_turns=1)
    limits = QuotaLimits.of(settings)
    turns = TurnStore(redis, keys, settings)
    await store.create("u1", "s1")
    first, _, _ = await turns.submit_queued("u1", "s1", "one", limits=limits)
    second, _, _ = await turns.submit_queued("u1", "s1", "two", multitask="enqueue", limits=limits)
    quota = keys.user_quota("u1")
    assert [text(v) for v in await redis.hmget(quota, "running", "queued", "s:s1")] == [
        "1",
        "1",
        "2",
    ]
    await turns.request_cancel("u1", "s1", second.turnId)
    await turns.request_cancel("u1", "s1", second.turnId)  # a second cancel gives back nothing
    assert [text(v) for v in await redis.hmget(quota, "running", "queued", "s:s1")] == [
        "1",
        "0",
        "1",
    ]
    await turns.request_cancel("u1", "s1", first.turnId)
    assert await redis.hget(quota, "s:s1") is None
    assert text(await redis.hget(quota, "running")) == "0"

"""worker.lease: a lease is renewed and let go only by the attempt whose token it holds."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from turnbus.shared.keys import Keys
from turnbus.worker.lease import SessionLease, new_lease_token

pytestmark = pytest.mark.timeout(30)


def _lease(redis: aioredis.Redis, keys: Keys, token: str) -> SessionLease:
    return SessionLease(
        redis,
        keys,
        user="u1",
        session="s1",
        turn_id="t1",
        token=token,
        lease_ms=60_000,
        heartbeat_ms=20_000,
    )


@pytest.mark.cluster
async def test_the_holder_renews_and_releases_its_lease(redis: aioredis.Redis, keys: Keys) -> None:
    token = new_lease_token("w1", "t1")
    lease = _lease(redis, keys, token)
    await redis.set(lease.key, token, px=1_000)

    assert await lease.renew() is True
    assert await redis.pttl(lease.key) > 1_000  # pushed on to lease_ms

    lease.held = True
    await lease.release()
    assert await redis.exists(lease.key) == 0


@pytest.mark.cluster
async def test_an_attempt_never_renews_nor_frees_a_lease_another_holds(
    redis: aioredis.Redis, keys: Keys
) -> None:
    lease = _lease(redis, keys, new_lease_token("w1", "t1"))
    other = new_lease_token("w2", "t1")
    await redis.set(lease.key, other, px=5_000)

    assert await lease.renew() is False
    assert await redis.pttl(lease.key) <= 5_000

    lease.held = True
    await lease.release()
    assert await redis.get(lease.key) == other

    await redis.delete(lease.key)
    assert await lease.renew() is False  # expired: nothing to renew, nothing written
    assert await redis.exists(lease.key) == 0


async def _calls(redis: aioredis.Redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {name: int(stat["calls"]) for name, stat in stats.items()}


async def test_each_attempt_s_renewal_is_one_call_once_the_script_is_loaded(
    redis: aioredis.Redis, keys: Keys
) -> None:
    await redis.script_flush()
    first = _lease(redis, keys, new_lease_token("w1", "t1"))
    await redis.set(first.key, first.token)
    assert await first.renew() is True  # loads the script (on Redis 6.2, its plain text)

    second = _lease(redis, keys, new_lease_token("w1", "t2"))
    await redis.set(second.key, second.token)
    before = await _calls(redis)
    assert await second.renew() is True
    after = await _calls(redis)
    ran = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    ran.pop("cmdstat_info", None)
    assert ran == {"cmdstat_evalsha": 1, "cmdstat_get": 1, "cmdstat_pexpire": 1}

"""The hot path's budget: what one "remember" turn costs Redis, counted, not timed.

A "remember" turn of the scripted model takes 2 rounds and writes the notes once. Its
cost is counted on the server (INFO commandstats, so the commands run inside scripts
count) and on the wire (every send of the worker's connections is one round trip). The
worker's own idle reads (XREADGROUP) are left out but the one that delivered the turn;
the submit's cost is measured on its own and taken off.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool, Connection

from tests.worker_kit import running_worker, turn_events, types_of, wait_until
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import Keys
from turnbus.shared.mux import MuxRedis
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.scripted import ScriptedModel

MAX_COMMANDS = 42
MAX_ROUND_TRIPS = 12
_IDLE = frozenset({"xreadgroup", "info", "subscribe", "ping"})


class CountingConnection(Connection):
    """A connection that counts its sends (one per command, one per pipeline)."""

    sends: dict[str, int] = {}  # noqa: RUF012 (one tally for the test)

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        first = command[0] if isinstance(command, list) else command
        name = bytes(first).split(b"\r\n", 3)[2].decode().lower() if first else "?"
        self.sends[name] = self.sends.get(name, 0) + 1
        await super().send_packed_command(command, check_health)


async def command_counts(redis: aioredis.Redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    out: dict[str, int] = {}
    for key, value in stats.items():
        name = key.removeprefix("cmdstat_").lower()
        out[name] = int(value["calls"])
    return out


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    out = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {k: v for k, v in out.items() if v}


# A session lifetime (TURNBUS_SESSION_TTL_DAYS) costs these, inside the scripts only.
_LIFETIME = frozenset({"pexpire", "pttl"})


@pytest.mark.parametrize("lifetime_days", [0.0, 30.0], ids=["no-lifetime", "lifetime"])
async def test_a_remember_turn_stays_within_its_redis_budget(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    prefix: str,
    lifetime_days: float,
) -> None:
    # No timer fires during the turn: no heartbeat, keepalive or reclaim pass.
    settings = dataclasses.replace(
        settings,
        heartbeat_ms=60_000,
        lease_ms=120_000,
        claim_idle_ms=600_000,
        session_ttl_days=lifetime_days,
    )
    turns = TurnStore(redis, keys, settings)
    await store.create("u1", "s1")
    # What one submit costs, measured on a session nobody consumes, in the same state as
    # the measured turn's (one earlier turn, ended).
    other = TurnStore(redis, Keys(prefix + "x"), settings)
    await EnvelopeStore(redis, Keys(prefix + "x")).create("u1", "s1")
    earlier, _, _ = await other.submit_queued("u1", "s1", "remember the earlier turn")
    await other.request_cancel("u1", "s1", earlier.turnId)
    before = await command_counts(redis)
    await other.submit_queued("u1", "s1", "remember the submit's cost")
    submit_cost = delta(await command_counts(redis), before)
    submit_cost.pop("info", None)

    pool = BlockingConnectionPool.from_url(
        settings.redis_url, decode_responses=True, connection_class=CountingConnection
    )
    # The worker's own client: commands multiplexed on one connection, whose sends are
    # counted as its round trips; blocking reads go through the counting pool.
    client = MuxRedis(pool)
    try:
        async with running_worker(settings, ScriptedModel(settings), redis_client=client) as w:
            # Twice: the first turn loads the scripts (SCRIPT LOAD is paid once per server).
            for n in (1, 2):
                CountingConnection.sends.clear()
                mux_sends = client.sends
                before = await command_counts(redis)
                record, _, _ = await turns.submit_queued("u1", "s1", f"remember the budget {n}")
                await wait_until(lambda n=n: _finished(w, n), 10)
                spent = delta(await command_counts(redis), before)
                mux_sends = client.sends - mux_sends
            sends = dict(CountingConnection.sends)
    finally:
        await client.aclose()

    for name, calls in submit_cost.items():
        spent[name] = spent.get(name, 0) - calls
    spent["xreadgroup"] = 1
    commands = {k: v for k, v in spent.items() if (v and k not in _IDLE) or k == "xreadgroup"}
    trips = {k: v for k, v in sends.items() if k not in _IDLE}
    trips["multiplexed"] = mux_sends
    trips["xreadgroup"] = 1
    total_commands = sum(commands.values())
    total_trips = sum(trips.values())
    print(f"submit: {sorted(submit_cost.items())}")
    print(f"remember turn: {total_commands} commands {sorted(commands.items())}")
    print(f"remember turn: {total_trips} round trips {sorted(trips.items())}")

    events = await turn_events(redis, keys, "u1", "s1", record.turnId)
    kinds = types_of(events)
    assert kinds[-1] == "turn.completed"
    assert kinds.count("round.started") == 2 and "working_notes" in kinds
    lifetime = sum(v for k, v in commands.items() if k in _LIFETIME)
    if not lifetime_days:
        assert lifetime == 0, commands
    assert total_commands - lifetime <= MAX_COMMANDS, commands
    assert total_trips <= MAX_ROUND_TRIPS, trips


async def _finished(worker: Any, n: int) -> bool:
    # In-process state only: polling Redis would add to the counts.
    return bool(worker.turns_finished >= n and not worker.in_flight_count)

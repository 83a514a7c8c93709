"""A turn's whole life touches one cluster slot per call.

The server is a one-node Redis Cluster that owns every slot (harness/redis_server.py):
the services talk to it as to any cluster (``TURNBUS_REDIS_CLUSTER=1``), and Redis 7
refuses, as a real cluster would, a multi-key command across slots (CROSSSLOT) or a
script that touches keys of two slots.
Any such access fails a call here, and is counted in the server's error stats.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from harness.redis_server import single_slot_cluster_node
from tests.gateway_server import live_gateway, signed_in
from tests.worker_kit import running_worker, types_of, wait_terminal, wait_until
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.events import TurnCompleted, TurnStarted, decode_event
from turnbus.shared.keys import Keys, key_slot
from turnbus.shared.meta import Meta
from turnbus.shared.quotas import QuotaLimits
from turnbus.shared.scripts import LuaScript
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.scripted import ScriptedModel

U = "u1"


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    with single_slot_cluster_node() as url:
        if url is None:
            pytest.skip("Redis 7 checks a script's slots; this redis-server is older")
        yield url


@pytest.fixture
async def node(cluster_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(cluster_url, decode_responses=True)
    await client.config_resetstat()
    try:
        yield client
    finally:
        await client.aclose()


async def test_a_turn_s_whole_life_stays_in_its_slot(
    node: aioredis.Redis, cluster_url: str
) -> None:
    prefix = "c" + uuid.uuid4().hex[:12]
    keys = Keys(prefix)
    settings = Settings(
        redis_url=cluster_url,
        redis_cluster=True,
        prefix=prefix,
        shards=3,
        outbox_grace_ms=200,
        scripted_delay_ms=0,
        # The quotas' calls (the user's own key, another slot) on the way.
        quota_running_turns=100,
        quota_tokens_per_day=10**9,
    )
    store = EnvelopeStore(node, keys)
    turns = TurnStore(node, keys, settings)
    limits = QuotaLimits.of(settings)
    slow = dataclasses.replace(settings, scripted_delay_ms=50)
    created = await store.create(U, "s1", Meta(title="first"))
    await store.host_replace(U, "s1", created.updatedAt + 1, Meta(title="second"))
    await store.create(U, "s2")

    # A turn accepted while no worker runs, its mark made old: the sweeper enqueues it
    # a second time; it still runs once.
    early, _, _ = await turns.submit_queued(U, "s2", "hello", limits=limits)
    await node.zadd(keys.outbox(U, "s2"), {keys.outbox_member(U, "s2", early.turnId): 0})
    slot = key_slot(f"{U}:s2")
    assert await turns.sweep_outboxes(range(slot, slot + 1)) == [early.turnId]

    async with running_worker(slow, ScriptedModel(slow)) as worker:
        remember, _, _ = await turns.submit_queued(
            U, "s1", "remember the cluster has one slot per call", limits=limits
        )
        events = await wait_terminal(node, keys, U, "s1", remember.turnId)
        assert types_of(events)[-1] == "turn.completed" and "working_notes" in types_of(events)
        events = await wait_terminal(node, keys, U, "s2", early.turnId)
        assert sum(isinstance(e, TurnStarted) for e in events) == 1

        # Cancel: a running turn (told through pub/sub) and a queued one behind it.
        running, _, _ = await turns.submit_queued(U, "s1", "what did we conclude?", limits=limits)
        queued, _, _ = await turns.submit_queued(
            U, "s1", "and then?", multitask="enqueue", limits=limits
        )

        async def started() -> bool:
            record = await turns.get(U, "s1", running.turnId)
            return record is not None and record.status == "running"

        await wait_until(started)
        await turns.request_cancel(U, "s1", queued.turnId)
        await turns.request_cancel(U, "s1", running.turnId)
        for turn in (running, queued):
            events = await wait_terminal(node, keys, U, "s1", turn.turnId)
            assert types_of(events)[-1] == "turn.cancelled"
        await wait_until(lambda: _idle(worker))

    envelope = await store.read(U, "s1")
    assert envelope is not None and "one slot per call" in (envelope.meta.workingNotes or "")
    # An SSE catch-up page of the finished turn.
    page = LuaScript(node, "sse_page.lua", read_only=True)
    first, entries, last = await page(
        keys=[keys.turn_events(U, "s1", remember.turnId)], args=["(0-0", "+", "100"]
    )
    assert isinstance(decode_event(entries[-1][1][1]), TurnCompleted)
    assert first[0][0] == entries[0][0] and last[0][0] == entries[-1][0]
    # The session's keys go in one call.
    assert await store.delete(U, "s1") and await store.delete(U, "s2")
    assert [k async for k in node.scan_iter(match=f"{prefix}:{{{U}:*")] == []

    # The worker's first read over the three shard streams is refused (CROSSSLOT) once;
    # it then reads one stream per call.
    await _nothing_refused(node, reads_refused=1)


async def test_the_gateway_s_calls_stay_in_their_slots(
    node: aioredis.Redis, cluster_url: str
) -> None:
    prefix = "c" + uuid.uuid4().hex[:12]
    settings = Settings(
        redis_url=cluster_url,
        redis_cluster=True,
        prefix=prefix,
        jwt_secret="s-" + prefix,
        quota_running_turns=100,
        quota_queued_turns=100,
        quota_turns_per_minute=100,
        quota_tokens_per_day=10**9,
    )
    async with live_gateway(settings) as gw, signed_in(gw, settings) as http:
        created = (await http.post("/v1/sessions", json={"meta": {"title": "a"}})).json()
        sid = created["sessionId"]
        r = await http.put(
            f"/v1/sessions/{sid}/meta",
            json={"updatedAt": created["updatedAt"] + 1, "meta": {"title": "b"}},
        )
        assert r.status_code == 200
        assert (await http.get("/v1/sessions")).json()["sessions"][0]["sessionId"] == sid
        r = await http.post(f"/v1/sessions/{sid}/turns", json={"message": "hi"})
        assert r.status_code == 202
        tid = r.json()["turnId"]
        assert (await http.post(f"/v1/sessions/{sid}/turns/{tid}/cancel")).status_code == 202
        record = (await http.get(f"/v1/sessions/{sid}/turns/{tid}")).json()
        assert record["status"] == "cancelled"
        for path in ("notes", "system", "messages"):
            assert (await http.get(f"/v1/sessions/{sid}/{path}")).status_code == 200
        assert (await http.delete(f"/v1/sessions/{sid}")).status_code == 204
    await _nothing_refused(node, reads_refused=0)


async def _nothing_refused(node: aioredis.Redis, *, reads_refused: int) -> None:
    """No command or script was refused or failed on the node (a script's first run finds
    it not loaded: NOSCRIPT), but ``reads_refused`` XREADGROUPs."""
    stats = await node.info("commandstats")
    refused = {
        name: (stat["rejected_calls"], stat["failed_calls"])
        for name, stat in stats.items()
        if stat["rejected_calls"] or stat["failed_calls"]
    }
    reads = refused.pop("cmdstat_xreadgroup", (reads_refused, 0))
    assert reads == (reads_refused, 0)
    refused.pop("cmdstat_client|setinfo", None)  # redis-py asks; 7.0 does not know it
    errors = await node.info("errorstats")
    not_loaded = errors.get("errorstat_NOSCRIPT", {}).get("count", 0)
    assert refused.pop("cmdstat_evalsha", (0, not_loaded)) == (0, not_loaded)
    assert refused == {}, refused


async def _idle(worker: object) -> bool:
    return not getattr(worker, "in_flight_count", 0)

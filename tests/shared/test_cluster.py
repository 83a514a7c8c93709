"""shared.cluster on a real 3-master Redis Cluster: routing, redirects, a failover."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator, Callable

import pytest
import redis.exceptions
from redis.crc import key_slot

from harness.local_cluster import LocalCluster, cluster_binaries, local_cluster
from tests.gateway_server import wait_for
from turnbus.gateway.hub import CAUGHT_UP, SseHub, StreamEntry
from turnbus.gateway.hub_readers import BlockingReaders
from turnbus.shared.cluster import Address, ClusterMux, TooManyRedirects, command_keys
from turnbus.shared.connect import connect
from turnbus.shared.keys import Keys
from turnbus.shared.mux import LinkStateError
from turnbus.shared.settings import Settings


@pytest.fixture
async def cluster(redis_cluster_url: str, prefix: str) -> AsyncIterator[ClusterMux]:
    client = connect(Settings(redis_url=redis_cluster_url, redis_cluster=True), "gateway")
    assert isinstance(client, ClusterMux)
    try:
        yield client
    finally:
        async for key in client.scan_iter(match=f"{prefix}*"):
            await client.unlink(key)
        await client.aclose()


async def _keys_on_each_master(client: ClusterMux, prefix: str) -> list[str]:
    """One key per master (keys whose slots each master serves)."""
    masters = await client.masters()
    found: dict[int, str] = {}
    n = 0
    while len(found) < len(masters):
        key = f"{prefix}:{{{n}}}:k"
        found.setdefault(masters.index(await client.node_for_key(key)), key)
        n += 1
    return [found[i] for i in range(len(masters))]


def test_command_keys_finds_the_keys_of_the_commands_turnbus_sends() -> None:
    assert command_keys(("EVALSHA", "sha", 2, "a", "b", "x")) == ("EVALSHA", ["a", "b"])
    assert command_keys(("XREADGROUP", "GROUP", "g", "c", "BLOCK", 5, "STREAMS", "s", ">")) == (
        "XREADGROUP",
        ["s"],
    )
    assert command_keys(("XINFO GROUPS", "s")) == ("XINFO GROUPS", ["s"])
    assert command_keys(("XGROUP", "CREATE", "s", "g", "0")) == ("XGROUP CREATE", ["s"])
    assert command_keys(("SCRIPT LOAD", "return 1")) == ("SCRIPT LOAD", None)
    assert command_keys(("PUBLISH", "ch", "m")) == ("PUBLISH", None)


async def test_commands_pipelines_and_scripts_reach_every_master(
    cluster: ClusterMux, redis_cluster: LocalCluster, prefix: str
) -> None:
    keys = await _keys_on_each_master(cluster, prefix)
    assert len(keys) == 3
    async with cluster.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.hset(key, "f", key)
            pipe.hget(key, "f")
        assert await pipe.execute() == [1, keys[0], 1, keys[1], 1, keys[2]]
    # Each value sits on the master that serves its slot, nowhere else.
    for key in keys:
        slot = key_slot(key.encode())
        holders = [
            p
            for p in redis_cluster.masters()
            if redis_cluster.client(p).cluster("COUNTKEYSINSLOT", slot)
        ]
        assert len(holders) == 1
    script = cluster.register_script("return redis.call('HGET', KEYS[1], 'f')")
    assert [await script(keys=[k]) for k in keys] == keys
    assert sorted([k async for k in cluster.scan_iter(match=f"{prefix}*")]) == sorted(keys)
    assert await cluster.exists(*keys) == 3
    assert await cluster.delete(*keys) == 3
    with pytest.raises(redis.exceptions.ClusterCrossSlotError):
        await cluster.execute_command("MGET", *keys)


def _start_moving(
    local: LocalCluster, slot: int, src: tuple[str, int], dst: tuple[str, int]
) -> Callable[[list[str]], None]:
    """Mark ``slot`` as moving from ``src`` to ``dst``; the function returned moves the
    keys named and hands the slot to ``dst`` (what ``redis-cli --cluster reshard`` does)."""
    src_node, dst_node = local.client(src[1]), local.client(dst[1])
    src_id, dst_id = src_node.cluster("MYID"), dst_node.cluster("MYID")
    dst_node.cluster("SETSLOT", slot, "IMPORTING", src_id)
    src_node.cluster("SETSLOT", slot, "MIGRATING", dst_id)

    def finish(keys: list[str]) -> None:
        src_node.execute_command("MIGRATE", dst[0], dst[1], "", 0, 5000, "KEYS", *keys)
        for node in (dst_node, src_node):
            node.cluster("SETSLOT", slot, "NODE", dst_id)

    return finish


async def test_a_slot_moved_to_another_master_is_followed_without_a_restart(
    cluster: ClusterMux, redis_cluster: LocalCluster, prefix: str
) -> None:
    old_key, other = (await _keys_on_each_master(cluster, prefix))[:2]
    await cluster.set(old_key, "before")
    slot = key_slot(old_key.encode())
    src = cluster.address_for_key(old_key)
    dst = cluster.address_for_key(other)
    assert src is not None and dst is not None
    finish = _start_moving(redis_cluster, slot, src, dst)
    # Mid-migration a key the source does not hold is answered with ASK: written on dst.
    new_key = f"{prefix}:{{{old_key.split('{')[1].split('}')[0]}}}:new"
    assert key_slot(new_key.encode()) == slot
    await cluster.set(new_key, "asked")
    assert cluster.redirects == 1
    finish([old_key])
    # The client's map still says src: src answers MOVED, the client follows.
    assert await cluster.get(old_key) == "before"
    assert await cluster.get(new_key) == "asked"
    assert cluster.address_for_key(old_key) == dst
    assert cluster.redirects >= 2


@pytest.mark.timeout(90)
async def test_a_killed_master_is_replaced_by_its_replica_without_a_restart(prefix: str) -> None:
    if cluster_binaries() is None:
        pytest.skip("needs redis-server >= 7 and redis-cli on the PATH")
    with local_cluster() as local:
        settings = Settings(redis_url=local.url, redis_cluster=True, redis_failover_wait_ms=15_000)
        client = connect(dataclasses.replace(settings), "worker")
        assert isinstance(client, ClusterMux)
        hub = SseHub(settings, client, Keys(prefix))
        await hub.start()
        try:
            keys = await _keys_on_each_master(client, prefix)
            for key in keys:
                await client.xadd(key + ":s", {"data": "before"})
            victim = client.address_for_key(keys[0] + ":s")
            assert victim is not None
            # A follower of a stream on the master that dies (through client tracking).
            items = hub.stream(keys[0] + ":s", None, lambda e: True)
            assert [await anext(items), await anext(items)][1] is CAUGHT_UP
            following = asyncio.ensure_future(anext(items))
            await wait_for(lambda: hub.followers == 1 and hub.tracked_reads > 0, what="a read")
            local.wait_replicated(victim[1])
            local.kill(victim[1])
            # A command for every master, sent while the dead one is still in the slot
            # map, answers once its replica has taken over: the dead node is dropped,
            # not retried until the failover wait runs out.
            script = b"return 'after the failover'"
            assert await client.script_load(script) == hashlib.sha1(script).hexdigest()
            # A read of the lost master's slots waits for its replica, then goes on (a
            # write in flight when the master died would fail: whether it ran is unknown).
            assert len(await client.xrange(keys[0] + ":s")) == 1
            await client.xadd(keys[0] + ":s", {"data": "after"})
            entries = await client.xrange(keys[0] + ":s")
            assert [e[1]["data"] for e in entries][-1] == "after"
            assert client.address_for_key(keys[0]) != victim
            # The follower reads on from its cursor on the new master: the entry, once.
            got = await asyncio.wait_for(following, 30)
            assert isinstance(got, StreamEntry) and got.data == "after"
            assert hub.tracking
            # The other masters were never in doubt.
            for key in keys[1:]:
                assert [e[1]["data"] for e in await client.xrange(key + ":s")] == ["before"]
            await items.aclose()
        finally:
            await hub.close()
            await client.aclose()


async def test_a_blocking_read_does_not_hold_the_shared_link(
    cluster: ClusterMux, prefix: str
) -> None:
    key = f"{prefix}:{{b}}:s"
    first = await cluster.xadd(key, {"data": "0"})
    blocked = asyncio.ensure_future(cluster.xread({key: first}, block=20_000))
    # Ordinary commands to the same node answer while the read waits.
    for n in range(20):
        assert await cluster.set(f"{prefix}:{{b}}:x", n)
    assert not blocked.done()
    await cluster.xadd(key, {"data": "1"})
    reply = await asyncio.wait_for(blocked, 10)
    assert reply[0][1][0][1] == {"data": "1"}


@pytest.mark.parametrize("tracking", [True, False], ids=["tracking", "blocking-reads"])
async def test_the_sse_hub_follows_a_moved_stream_from_its_cursor(
    cluster: ClusterMux, redis_cluster: LocalCluster, prefix: str, tracking: bool
) -> None:
    key, other = (await _keys_on_each_master(cluster, prefix))[:2]
    key += ":events"
    ids = [await cluster.xadd(key, {"data": f'{{"type":"text.delta","n":{i}}}'}) for i in range(2)]
    hub = SseHub(
        Settings(redis_url=redis_cluster.url, redis_cluster=True),
        cluster,
        Keys(prefix),
        block_ms=200,
        tracking=tracking,
    )
    await hub.start()
    items = hub.stream(key, None, lambda e: True)
    try:
        got = []
        async for item in items:
            if item is CAUGHT_UP:
                break
            got.append(item)
        assert [e.id for e in got if isinstance(e, StreamEntry)] == ids
        following = asyncio.ensure_future(anext(items))
        await wait_for(
            lambda: hub.readers == (0 if tracking else 1) and hub.followers == 1,
            what="the follower",
        )
        src, dst = cluster.address_for_key(key), cluster.address_for_key(other)
        assert src is not None and dst is not None
        _start_moving(redis_cluster, key_slot(key.encode()), src, dst)(
            [key, *[k for k in _wake_keys(hub)]]
        )
        # Written on the new master: the hub's read met MOVED, moved, and read on.
        more = [
            await cluster.xadd(key, {"data": f'{{"type":"text.delta","n":{i}}}'}) for i in (2, 3)
        ]
        seen = [await asyncio.wait_for(following, 20)]
        while len(seen) < 2:
            seen.append(await asyncio.wait_for(anext(items), 20))
        assert [e.id for e in seen if isinstance(e, StreamEntry)] == more
        assert cluster.address_for_key(key) == dst
    finally:
        await items.aclose()
        await hub.close()


def _wake_keys(hub: SseHub) -> list[str]:
    reader = hub._followed.reader
    return reader.wake_keys() if isinstance(reader, BlockingReaders) else []


async def test_a_pinned_link_sends_a_write_and_its_wait_on_the_key_s_master(
    cluster: ClusterMux, prefix: str
) -> None:
    for key in await _keys_on_each_master(cluster, prefix):
        link = cluster.pinned()
        try:
            await link.set(key, "v")
            # WAIT counts this connection's writes: its replica has the one just made.
            assert await link.wait(1, 5000) == 1
            assert await link.get(key) == "v"
        finally:
            await link.aclose()
    with pytest.raises(redis.exceptions.DataError, match="WAIT"):
        await cluster.wait(1, 10)


async def _connections_received(client: ClusterMux) -> int:
    """Connections the masters have accepted so far."""
    total = 0
    for node in await client.masters():
        total += int((await node.info("stats"))["total_connections_received"])
    return total


async def test_the_sse_hub_reuses_reader_links_from_turn_to_turn(
    cluster: ClusterMux, redis_cluster: LocalCluster, prefix: str
) -> None:
    # With blocking reads (Redis refusing client tracking), a slot's reader ends when its
    # last follower leaves: about one per turn. Its link goes back to its node for the
    # next reader there, not closed.
    hub = SseHub(
        Settings(redis_url=redis_cluster.url, redis_cluster=True),
        cluster,
        Keys(),
        block_ms=200,
        tracking=False,
    )
    await hub.start()
    turns = 30
    queued = '{"type":"turn.queued"}'
    before = await _connections_received(cluster)
    try:
        for turn in range(turns):
            key = f"{prefix}:{{s{turn}}}:events"
            first = await cluster.xadd(key, {"data": queued})
            items = hub.stream(key, None, lambda e: True)
            try:
                assert await anext(items) == StreamEntry(first, "turn.queued", queued)
                assert await anext(items) is CAUGHT_UP
                following = asyncio.ensure_future(anext(items))
                await wait_for(lambda: hub.readers == 1, what="the slot's reader")
                written = [
                    await cluster.xadd(key, {"data": f'{{"type":"text.delta","n":{i}}}'})
                    for i in range(3)
                ]
                got = [await asyncio.wait_for(following, 20)]
                while len(got) < 3:
                    got.append(await asyncio.wait_for(anext(items), 20))
                assert [e.id for e in got if isinstance(e, StreamEntry)] == written
            finally:
                await items.aclose()
        await wait_for(lambda: hub.readers == 0, what="the last reader to end")
    finally:
        await hub.close()
    opened = await _connections_received(cluster) - before
    # A reader link or two per master, and the hub's wake-up link per master: never one
    # a turn.
    assert hub.links_opened <= 2 * len(await cluster.masters()), hub.links_opened
    assert opened <= turns // 3, opened


async def test_commands_about_the_whole_cluster_are_answered_by_every_master(
    cluster: ClusterMux, redis_cluster: LocalCluster, prefix: str
) -> None:
    keys = await _keys_on_each_master(cluster, prefix)
    for key in keys:
        await cluster.set(key, "v")
    # DBSIZE is every master's count summed, KEYS every master's keys: never one node's.
    per_node = [await node.dbsize() for node in await cluster.masters()]
    assert await cluster.dbsize() == sum(per_node) >= 3
    assert sorted(await cluster.keys(f"{prefix}*")) == sorted(keys)
    assert await cluster.randomkey() is not None
    # A script loaded on one master only does not exist for the cluster.
    body = f"return '{prefix}'"
    sha = await (await cluster.masters())[0].script_load(body)
    assert await cluster.script_exists(sha) == [False]
    assert await cluster.script_load(body) == sha
    assert await cluster.script_exists(sha) == [True]
    # What describes one node is refused by name, not answered by any one of them.
    with pytest.raises(redis.exceptions.DataError, match="CONFIG GET"):
        await cluster.config_get("maxmemory")
    with pytest.raises(redis.exceptions.DataError, match="SLOWLOG GET"):
        await cluster.slowlog_get()


async def test_commands_that_would_change_a_shared_link_are_refused(
    cluster: ClusterMux, prefix: str
) -> None:
    key = (await _keys_on_each_master(cluster, prefix))[0]
    await cluster.set(key, "v")
    refused = [
        (("SELECT", 1), "SELECT"),
        (("CLIENT REPLY", "OFF"), "CLIENT REPLY"),
        (("CLIENT", "REPLY", "SKIP"), "CLIENT REPLY"),
        (("HELLO", 3), "HELLO"),
        (("RESET",), "RESET"),
        (("SUBSCRIBE", "ch"), "pubsub"),
        (("MULTI",), "MULTI"),
        (("WATCH", key), "WATCH"),
    ]
    for args, named in refused:
        with pytest.raises(LinkStateError, match=named):
            await cluster.execute_command(*args)
    with pytest.raises(LinkStateError, match="MONITOR"):
        cluster.pipeline(transaction=False).execute_command("MONITOR")
    # Nothing was sent: every caller's replies are still its own.
    values = await asyncio.gather(*(cluster.get(key) for _ in range(20)), cluster.echo("mine"))
    assert values == ["v"] * 20 + ["mine"]


async def _two_masters(cluster: ClusterMux, prefix: str) -> tuple[str, str, Address, Address]:
    """A key, its hash tag, the master serving it and another master."""
    key, other = (await _keys_on_each_master(cluster, prefix))[:2]
    src, dst = cluster.address_for_key(key), cluster.address_for_key(other)
    assert src is not None and dst is not None
    return key, key.split("{")[1].split("}")[0], src, dst


def _errors(local: LocalCluster, port: int, code: str) -> int:
    stats = local.client(port).info("errorstats")
    return int(stats.get(f"errorstat_{code}", {}).get("count", 0))


async def test_a_multi_key_read_during_a_slot_migration_waits_out_tryagain(
    cluster: ClusterMux, redis_cluster: LocalCluster, prefix: str
) -> None:
    key, tag, src, dst = await _two_masters(cluster, prefix)
    first, second = f"{prefix}:{{{tag}}}:a", f"{prefix}:{{{tag}}}:b"
    await cluster.mset({first: "1", second: "2"})
    finish = _start_moving(redis_cluster, key_slot(key.encode()), src, dst)
    # One of the two keys has moved: the source answers the pair with TRYAGAIN.
    redis_cluster.client(src[1]).execute_command(
        "MIGRATE", dst[0], dst[1], "", 0, 5000, "KEYS", second
    )
    before = _errors(redis_cluster, src[1], "TRYAGAIN")
    read = asyncio.ensure_future(cluster.mget(first, second))
    await wait_for(lambda: _errors(redis_cluster, src[1], "TRYAGAIN") > before, what="TRYAGAIN")
    assert not read.done()
    finish([first])
    # Once the slot has moved the read is sent again, follows MOVED, and answers whole.
    assert await asyncio.wait_for(read, 10) == ["1", "2"]
    assert cluster.address_for_key(first) == dst


async def test_a_pipeline_asked_elsewhere_mid_reshard_keeps_its_order(
    cluster: ClusterMux, redis_cluster: LocalCluster, prefix: str
) -> None:
    key, tag, src, dst = await _two_masters(cluster, prefix)
    staying, moving = f"{prefix}:{{{tag}}}:stays", f"{prefix}:{{{tag}}}:list"
    await cluster.set(staying, "here")
    finish = _start_moving(redis_cluster, key_slot(key.encode()), src, dst)
    before = cluster.redirects
    # The list is not on the source: each push is answered ASK, and sent again to the
    # importing node in the pipeline's order, beside commands answered at once.
    async with cluster.pipeline(transaction=False) as pipe:
        for n in range(1, 6):
            pipe.rpush(moving, n)
            pipe.get(staying if n % 2 else f"{prefix}:absent")
        replies = await pipe.execute()
    assert replies[::2] == [1, 2, 3, 4, 5]
    assert replies[1::2] == ["here", None, "here", None, "here"]
    assert cluster.redirects - before == 5
    finish([staying])
    assert await cluster.lrange(moving, 0, -1) == ["1", "2", "3", "4", "5"]


async def test_redirections_are_followed_a_bounded_number_of_times(
    cluster: ClusterMux, redis_cluster: LocalCluster, prefix: str
) -> None:
    key, _, src, dst = await _two_masters(cluster, prefix)
    slot = key_slot(key.encode())
    # The source says ASK (the slot is migrating), the target, not importing it, says
    # MOVED back: a loop no client can leave by following it.
    source = redis_cluster.client(src[1])
    source.cluster("SETSLOT", slot, "MIGRATING", redis_cluster.client(dst[1]).cluster("MYID"))
    try:
        redirects, reads = cluster.redirects, cluster.refreshes
        with pytest.raises(TooManyRedirects, match="redirections"):
            await cluster.get(key)
        assert cluster.redirects - redirects == 16
        # A storm of them (50 callers, hundreds of MOVED replies) reads the slot map a
        # bounded number of times, not once per MOVED.
        redirects = cluster.redirects
        storm = await asyncio.gather(*(cluster.get(key) for _ in range(50)), return_exceptions=True)
        assert all(isinstance(r, TooManyRedirects) for r in storm)
        assert cluster.redirects - redirects == 50 * 16
        assert cluster.refreshes - reads <= 3
        pipe = cluster.pipeline(transaction=False)
        pipe.get(key)
        with pytest.raises(TooManyRedirects):
            await pipe.execute()
    finally:
        source.cluster("SETSLOT", slot, "STABLE")
    assert await cluster.get(key) is None

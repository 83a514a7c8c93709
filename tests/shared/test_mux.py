"""``shared.mux.MuxRedis``: many callers, one pipelined connection, failures kept to their callers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from harness.fault_proxy import fault_proxy
from tests.worker_kit import wait_until
from turnbus.shared.connect import connect
from turnbus.shared.mux import KEEPALIVE, LinkStateError, MuxRedis
from turnbus.shared.scripts import LuaScript
from turnbus.shared.settings import Settings

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def mux(redis_url: str) -> AsyncIterator[MuxRedis]:
    client = MuxRedis(BlockingConnectionPool.from_url(redis_url, decode_responses=True))
    try:
        yield client
    finally:
        await client.aclose()


async def blocked_in(redis: aioredis.Redis, command: str, client_id: str | None = None) -> bool:
    """Whether a client (``client_id``, else any) is blocked in ``command`` right now."""
    return any(
        c.get("cmd") == command and (client_id is None or c.get("id") == client_id)
        for c in await redis.client_list()
    )


def dedicated(redis_url: str, reply_timeout_s: float = 10.0) -> MuxRedis:
    pool = BlockingConnectionPool.from_url(redis_url, max_connections=1)
    return MuxRedis(pool, reply_timeout_s=reply_timeout_s, dedicated=True)


async def test_many_callers_share_one_connection_and_few_writes(
    mux: MuxRedis, redis: aioredis.Redis, prefix: str
) -> None:
    await mux.set(f"{prefix}k", "v")
    before = mux.sends
    values = await asyncio.gather(*(mux.get(f"{prefix}k") for _ in range(200)))
    assert values == ["v"] * 200
    assert mux.connects == 1
    assert mux.sends - before <= 2  # one write for all 200 (issued in one pass)
    # Replies are parsed as redis-py parses them; a pipeline is one write too.
    await mux.hset(f"{prefix}h", mapping={"a": "1"})
    before = mux.sends
    async with mux.pipeline(transaction=False) as pipe:
        pipe.hgetall(f"{prefix}h")
        pipe.xadd(f"{prefix}s", {"data": "x"})
        pipe.exists(f"{prefix}k", f"{prefix}h")
        got, entry_id, exists = await pipe.execute()
    assert got == {"a": "1"} and isinstance(entry_id, str) and exists == 2
    assert mux.sends - before == 1


async def test_an_error_reply_reaches_only_its_caller(
    mux: MuxRedis, redis: aioredis.Redis, prefix: str
) -> None:
    await mux.hset(f"{prefix}h", mapping={"a": "1"})
    results = await asyncio.gather(
        mux.incr(f"{prefix}h"), mux.ping(), mux.hget(f"{prefix}h", "a"), return_exceptions=True
    )
    assert isinstance(results[0], ResponseError)
    assert "WRONGTYPE" in str(results[0])
    assert results[1:] == [True, "1"]
    # NOSCRIPT arrives as redis-py's NoScriptError: a script reloads itself.
    await redis.script_flush()
    script = LuaScript(mux, "sse_page.lua")
    reply = await script(keys=[f"{prefix}none"], args=["", "+", 10])
    assert reply is not None
    # In a pipeline, the error is that command's result.
    async with mux.pipeline(transaction=False) as pipe:
        pipe.incr(f"{prefix}h")
        pipe.get(f"{prefix}missing")
        errored, missing = await pipe.execute(raise_on_error=False)
    assert isinstance(errored, ResponseError) and missing is None


async def test_blocking_reads_do_not_hold_the_shared_connection(
    mux: MuxRedis, redis: aioredis.Redis, prefix: str
) -> None:
    read = asyncio.create_task(mux.xread({f"{prefix}stream": "$"}, block=5000))
    await wait_until(lambda: blocked_in(redis, "xread"))
    # The blocked XREAD runs on a pooled connection: other commands go on at once.
    assert await mux.ping()
    assert not read.done()
    await mux.xadd(f"{prefix}stream", {"data": "x"})
    reply = await asyncio.wait_for(read, 5)
    assert reply and reply[0][1][0][1] == {"data": "x"}


async def test_a_lost_connection_fails_what_is_in_flight_and_the_next_call_reconnects(
    redis_url: str, redis: aioredis.Redis, prefix: str
) -> None:
    client = dedicated(redis_url)
    try:
        link_id = await client.call("CLIENT", "ID")
        waiting = asyncio.create_task(client.call("BLPOP", f"{prefix}never", 10))
        await wait_until(lambda: blocked_in(redis, "blpop", str(link_id)))
        await redis.client_kill_filter(_id=link_id)
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(waiting, 5)
        assert await client.call("PING") == b"PONG"
        assert client.connects == 2
    finally:
        await client.aclose()


async def test_a_silent_connection_times_out_and_the_next_call_reconnects(
    redis_url: str, prefix: str
) -> None:
    client = dedicated(redis_url, reply_timeout_s=0.4)
    try:
        with pytest.raises(RedisTimeoutError):
            await asyncio.wait_for(client.call("BLPOP", f"{prefix}never", 5), 5)
        assert await client.call("PING") == b"PONG"
        assert client.connects == 2
    finally:
        await client.aclose()


async def test_a_cancelled_caller_leaves_the_replies_in_step(
    redis_url: str, redis: aioredis.Redis, prefix: str
) -> None:
    client = dedicated(redis_url)
    try:
        waiting = asyncio.create_task(client.call("BLPOP", f"{prefix}never", 1))
        await wait_until(lambda: blocked_in(redis, "blpop"))
        waiting.cancel()
        # The cancelled BLPOP's reply (nil, a second later) is read and dropped: the
        # next caller gets its own reply, not that one.
        assert await client.call("ECHO", "mine") == b"mine"
        assert client.connects == 1
    finally:
        await client.aclose()


async def test_a_shared_client_refuses_to_block_its_connection(mux: MuxRedis) -> None:
    with pytest.raises(ValueError, match="would block"):
        await mux.call("BLPOP", "k", 1)


async def test_a_reply_handed_over_as_read_reaches_the_handler_before_its_caller(
    redis_url: str, mux: MuxRedis, prefix: str
) -> None:
    client = dedicated(redis_url)
    try:
        await client.call("RPUSH", f"{prefix}l", "a", "b")
        seen: list[object] = []
        assert await client.call_into(seen.append, "LRANGE", f"{prefix}l", 0, -1) is None
        assert seen == [[b"a", b"b"]]  # the raw reply, already handled when the call returns

        # The handler's error is raised where the caller waits; an error reply is
        # raised without calling the handler; the link stays in step.
        def broken(_reply: object) -> None:
            raise RuntimeError("handler broke")

        with pytest.raises(RuntimeError, match="handler broke"):
            await client.call_into(broken, "PING")
        with pytest.raises(ResponseError):
            await client.call_into(seen.append, "LPUSH", f"{prefix}l")
        assert len(seen) == 1
        assert await client.call("ECHO", "mine") == b"mine"
        assert client.connects == 1
    finally:
        await client.aclose()
    # A shared client's one user is not alone on its link: it may not hand replies over.
    with pytest.raises(ValueError, match="dedicated"):
        await mux.call_into(print, "PING")


async def test_commands_that_would_change_the_shared_connection_are_refused(
    mux: MuxRedis, redis_url: str, prefix: str
) -> None:
    await mux.set(f"{prefix}k", "v")
    for args, named in [
        (("SELECT", 1), "SELECT"),
        (("CLIENT REPLY", "OFF"), "CLIENT REPLY"),
        (("client", "reply", "skip"), "CLIENT REPLY"),
        (("HELLO", 3), "HELLO"),
        (("AUTH", "someone", "else"), "AUTH"),
        (("RESET",), "RESET"),
        (("QUIT",), "QUIT"),
        (("MONITOR",), "MONITOR"),
        (("SUBSCRIBE", "ch"), "pubsub"),
        (("PSUBSCRIBE", "ch*"), "pubsub"),
        (("MULTI",), "MULTI"),
        (("WATCH", f"{prefix}k"), "WATCH"),
    ]:
        with pytest.raises(LinkStateError, match=named):
            await mux.execute_command(*args)
        with pytest.raises(LinkStateError, match=named):
            await mux.call(*args)
        with pytest.raises(LinkStateError, match=named):
            mux.pipeline(transaction=False).execute_command(*args)
    # The database it is on already is no change; the link stayed in step.
    assert await mux.execute_command("SELECT", 0)
    assert await asyncio.gather(mux.get(f"{prefix}k"), mux.echo("mine")) == ["v", "mine"]
    assert mux.connects == 1
    # What they are for still works, each on a connection of its own.
    async with mux.pipeline(transaction=True) as pipe:
        await pipe.watch(f"{prefix}k")
        pipe.multi()
        pipe.set(f"{prefix}k", "w")
        assert await pipe.execute() == [True]
    pubsub = mux.pubsub()
    await pubsub.subscribe(f"{prefix}ch")
    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
    # A dedicated link's one user may (the SSE hub subscribes and tracks on its own).
    link = dedicated(redis_url)
    try:
        assert await link.call("SUBSCRIBE", f"{prefix}ch") == [
            b"subscribe",
            f"{prefix}ch".encode(),
            1,
        ]
    finally:
        await link.aclose()


async def test_in_flight_commands_are_capped_and_the_rest_wait_for_room(
    redis_url: str, prefix: str
) -> None:
    async with fault_proxy(redis_url) as proxy:
        # TURNBUS_REDIS_MAX_IN_FLIGHT=8
        client = connect(Settings(redis_url=proxy.url, redis_max_in_flight=8), "status")
        assert isinstance(client, MuxRedis)
        try:
            assert await client.ping()
            proxy.delay(0.2, replies_only=True)  # a slow server: replies come late
            written = client.commands
            counts = asyncio.gather(*(client.incr(f"{prefix}n") for _ in range(40)))
            await wait_until(lambda: _true(client.in_flight == 8))
            # 8 in flight, 8 written: the other 32 wait for room, not written, not failed.
            assert client.commands - written == 8
            assert sorted(await asyncio.wait_for(counts, 20)) == list(range(1, 41))
            assert client.commands - written == 40
            # A pipeline longer than the cap goes out whole, adjacent, once room is made.
            async with client.pipeline(transaction=False) as pipe:
                for _ in range(20):
                    pipe.incr(f"{prefix}n")
                assert await pipe.execute() == list(range(41, 61))
        finally:
            await client.aclose()


async def test_the_shared_connection_keeps_tcp_keepalive(mux: MuxRedis) -> None:
    assert await mux.ping()
    link = mux._link
    assert link is not None and link._transport is not None
    sock = link._transport.get_extra_info("socket")
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    if hasattr(socket, "TCP_KEEPIDLE"):
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE["idle_s"]
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == KEEPALIVE["count"]


async def _true(value: bool) -> bool:
    return value


async def test_commands_wait_while_the_transport_has_paused_writing(
    redis_url: str, prefix: str
) -> None:
    async with fault_proxy(redis_url) as proxy:
        client = MuxRedis(BlockingConnectionPool.from_url(proxy.url, decode_responses=True))
        try:
            assert await client.ping()
            link = client._link
            assert link is not None
            proxy.stall()  # Redis's side reads nothing: the writes back up in the transport
            value = "x" * (1 << 20)
            first = asyncio.gather(*(client.set(f"{prefix}:a{n}", value) for n in range(20)))
            await wait_until(lambda: _true(link._paused))
            # Written only once the transport takes writes again: queued, not failed.
            written = client.commands
            second = asyncio.gather(*(client.set(f"{prefix}:b{n}", value) for n in range(20)))
            await wait_until(lambda: _true(len(link._room_waiters) == 20))
            assert client.commands == written
            proxy.stall(False)
            assert await asyncio.wait_for(first, 20) == [True] * 20
            assert await asyncio.wait_for(second, 20) == [True] * 20
            assert client.commands == written + 20
        finally:
            await client.aclose()

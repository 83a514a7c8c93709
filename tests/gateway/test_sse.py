from __future__ import annotations

import asyncio
import dataclasses
import urllib.parse

import aiohttp
import httpx
import pytest
import redis.asyncio as aioredis

from tests.gateway_server import (
    LiveGateway,
    Reader,
    SseEvent,
    live_gateway,
    session_and_turn,
    wait_for,
)
from tests.turn_kit import append_events, end_turn
from turnbus.gateway.auth import mint_token
from turnbus.gateway.hub import CAUGHT_UP, FollowerDropped, SseHub, StreamEntry
from turnbus.shared.events import (
    Resync,
    RoundStarted,
    TextDelta,
    TurnStarted,
    Usage,
    encode_event,
)
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.sse import iter_sse


@pytest.fixture
def token(settings: Settings) -> str:
    assert settings.jwt_secret
    return mint_token(settings.jwt_secret, "alice")


def _types(events: list[SseEvent]) -> list[str]:
    return [e.event for e in events]


@pytest.mark.cluster
async def test_play_the_worker_follow_resume_resync_and_close(
    http: httpx.AsyncClient, gw: LiveGateway, redis: aioredis.Redis, keys: Keys
) -> None:
    sid, tid = await session_and_turn(http)
    store = gw.gateway.turns
    url = f"/v1/sessions/{sid}/turns/{tid}/events"
    first = Reader(http, url)
    await first.count(1)
    assert first.status == 200

    await append_events(store, "alice", sid, tid, TurnStarted(turnId=tid, attempt=1, worker="w1"))
    await append_events(store, "alice", sid, tid, RoundStarted(turnId=tid, round=1))
    for i in range(4):
        await append_events(store, "alice", sid, tid, TextDelta(turnId=tid, round=1, text=f"t{i}"))
    await first.count(7)
    middle = first.events[3].id
    assert middle is not None
    # Two resuming clients join mid-turn: one by Last-Event-ID, one by ?after=.
    by_header = Reader(http, url, {"Last-Event-ID": middle})
    by_query = Reader(http, f"{url}?after={middle}")
    await by_header.count(3)
    await by_query.count(3)

    for i in range(4, 8):
        await append_events(store, "alice", sid, tid, TextDelta(turnId=tid, round=1, text=f"t{i}"))
    await append_events(store, "alice", sid, tid, Usage(turnId=tid, inputTokens=5, outputTokens=7))
    terminal_id = await end_turn(store, "alice", sid, tid, "completed", stop_reason="end_turn")
    assert terminal_id is not None

    stored = await redis.xrange(keys.turn_events("alice", sid, tid))
    all_ids = [entry_id for entry_id, _ in stored]
    assert len(all_ids) == 13

    events = await first.closed()  # the server ends the stream after the terminal event
    assert [e.id for e in events] == all_ids
    assert [e.data for e in events] == [f["data"] for _, f in stored]
    assert _types(events)[0] == "turn.queued"
    assert _types(events)[-1] == "turn.completed"
    assert [e.json()["text"] for e in events if e.event == "text.delta"] == [
        f"t{i}" for i in range(8)
    ]
    rest = all_ids[all_ids.index(middle) + 1 :]
    assert [e.id for e in await by_header.closed()] == rest
    assert [e.id for e in await by_query.closed()] == rest

    # Reconnecting after the terminal event: 204, which tells EventSource to stop.
    r = await http.get(url, headers={"Last-Event-ID": terminal_id})
    assert r.status_code == 204
    # A finished turn replays to a new follower and closes.
    assert [e.id for e in await Reader(http, url).closed()] == all_ids

    # Trim the stream: a cursor older than what it holds gets resync, then the rest.
    await redis.xtrim(keys.turn_events("alice", sid, tid), maxlen=3, approximate=False)
    events = await Reader(http, url, {"Last-Event-ID": all_ids[1]}).closed()
    assert _types(events)[0] == "resync"
    assert events[0].id is None
    assert events[0].json() == {
        "type": "resync",
        "requested": all_ids[1],
        "earliest": all_ids[-3],
    }
    assert [e.id for e in events[1:]] == all_ids[-3:]
    # A cursor inside what the stream still holds: no resync.
    events = await Reader(http, url, {"Last-Event-ID": all_ids[-3]}).closed()
    assert [e.id for e in events] == all_ids[-2:]
    assert gw.app.state.metrics.sse_resyncs._value.get() == 1
    assert gw.gateway.hub.followers == 0


@pytest.mark.cluster
async def test_a_submit_that_asks_for_the_stream_gets_the_turns_events(
    http: httpx.AsyncClient, gw: LiveGateway, redis: aioredis.Redis, keys: Keys
) -> None:
    sid = (await http.post("/v1/sessions")).json()["sessionId"]
    url = f"/v1/sessions/{sid}/turns"
    sse = {"Accept": "text/event-stream", "Idempotency-Key": "k1"}
    live = Reader(http, url, sse, expect=200, json={"message": "hi"})
    await live.count(1)
    assert live.headers is not None
    tid = live.headers["x-turn-id"]
    assert live.headers["location"] == f"/v1/sessions/{sid}/turns/{tid}"
    assert live.headers["content-type"].startswith("text/event-stream")
    assert live.events[0].json() == {
        "type": "turn.queued",
        "turnId": tid,
        "sessionId": sid,
        "at": live.events[0].json()["at"],
    }

    # Errors stay JSON: the session has an active turn.
    busy = await http.post(url, headers={"Accept": "text/event-stream"}, json={"message": "two"})
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "session_busy"

    store = gw.gateway.turns
    await append_events(store, "alice", sid, tid, TurnStarted(turnId=tid, attempt=1, worker="w1"))
    await append_events(store, "alice", sid, tid, TextDelta(turnId=tid, round=1, text="hello"))
    await end_turn(store, "alice", sid, tid, "completed", stop_reason="end_turn")
    stored = [entry_id for entry_id, _ in await redis.xrange(keys.turn_events("alice", sid, tid))]
    events = await live.closed()  # ends after the terminal event, as GET …/events does
    assert [e.id for e in events] == stored
    assert _types(events) == ["turn.queued", "turn.started", "text.delta", "turn.completed"]
    # The same key again replays the same turn's whole stream.
    replay = await Reader(http, url, sse, expect=200, json={"message": "hi"}).closed()
    assert [e.id for e in replay] == stored
    assert await redis.xlen(keys.turn_events("alice", sid, tid)) == len(stored)


async def test_expired_stream_of_a_finished_turn_resyncs_and_closes(
    http: httpx.AsyncClient, gw: LiveGateway, redis: aioredis.Redis, keys: Keys
) -> None:
    sid, tid = await session_and_turn(http)
    await end_turn(
        gw.gateway.turns, "alice", sid, tid, "failed", reason="rate_limited", error="slow down"
    )
    await redis.delete(keys.turn_events("alice", sid, tid))
    url = f"/v1/sessions/{sid}/turns/{tid}/events"
    events = await Reader(http, url, {"Last-Event-ID": "1-0"}).closed()
    assert _types(events) == ["resync", "turn.failed"]
    assert events[0].json()["earliest"] is None
    failed = events[1].json()
    assert events[1].id is None
    assert (failed["turnId"], failed["reason"], failed["message"]) == (
        tid,
        "rate_limited",
        "slow down",
    )


async def test_bad_cursor_and_missing_turn(http: httpx.AsyncClient) -> None:
    sid, tid = await session_and_turn(http)
    r = await http.get(f"/v1/sessions/{sid}/turns/{tid}/events", headers={"Last-Event-ID": "x"})
    assert r.status_code == 400
    assert r.json()["error"]["field"] == "Last-Event-ID"
    r = await http.get(f"/v1/sessions/{sid}/turns/{tid}/events?after=1-2-3")
    assert r.status_code == 400
    r = await http.get(f"/v1/sessions/{sid}/events", params={"after": "\u0661-\u0660"})
    assert r.status_code == 400
    assert r.json()["error"]["field"] == "after"
    r = await http.get(f"/v1/sessions/{sid}/turns/t_none/events")
    assert r.status_code == 404
    r = await http.get("/v1/sessions/s_none/events")
    assert r.status_code == 404


@pytest.mark.cluster
async def test_session_log_stream_follows_resumes_and_resyncs(
    http: httpx.AsyncClient, gw: LiveGateway, redis: aioredis.Redis, keys: Keys
) -> None:
    sid = (await http.post("/v1/sessions", json={"meta": {"title": "a"}})).json()["sessionId"]
    url = f"/v1/sessions/{sid}/events"
    log = Reader(http, url)
    await log.count(1)
    assert log.events[0].event == "envelope.patched"
    assert log.events[0].json()["origin"] == "create"
    env = (await http.get(f"/v1/sessions/{sid}")).json()
    r = await http.put(
        f"/v1/sessions/{sid}/meta", json={"updatedAt": env["updatedAt"] + 1, "meta": {"title": "b"}}
    )
    assert r.status_code == 200
    await gw.gateway.envelopes.worker_overlay("alice", sid, {"workingNotes": "keep this"})
    await log.count(3)
    assert [e.json()["origin"] for e in log.events] == ["create", "host", "worker"]
    log.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await log.task

    resumed = Reader(http, url, {"Last-Event-ID": log.events[0].id or ""})
    await resumed.count(2)
    assert [e.id for e in resumed.events] == [e.id for e in log.events[1:]]
    resumed.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await resumed.task

    # The log trimmed past the cursor: resync first, then what it still holds.
    await redis.xtrim(keys.log("alice", sid), maxlen=1, approximate=False)
    trimmed = Reader(http, url, {"Last-Event-ID": log.events[0].id or ""})
    await trimmed.count(2)
    assert _types(trimmed.events) == ["resync", "envelope.patched"]
    assert trimmed.events[0].json()["earliest"] == log.events[2].id
    assert trimmed.events[1].id == log.events[2].id
    trimmed.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await trimmed.task
    await wait_for(lambda: gw.gateway.hub.followers == 0, what="followers to leave")


async def test_hub_catch_up_resyncs_when_trimmed_between_pages(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    key = keys.log("alice", "s_trim")
    ids = [
        await redis.xadd(key, {"data": encode_event(TextDelta(turnId="t", round=1, text=str(i)))})
        for i in range(10)
    ]
    hub = SseHub(Settings(redis_url=redis_url), redis, keys, page=2, block_ms=200)
    await hub.start()
    items = hub.stream(key, None, lambda e: e.id == ids[0])
    try:
        got = [await anext(items), await anext(items)]  # the first page
        assert [e.id for e in got if isinstance(e, StreamEntry)] == ids[:2]
        # A writer trims the stream while the catch-up is between two pages.
        await redis.xtrim(key, maxlen=3, approximate=False)
        rest: list[object] = []
        async for item in items:
            if item is CAUGHT_UP:
                break
            rest.append(item)
        assert rest[0] == Resync(requested=ids[1], earliest=ids[7])
        assert [e.id for e in rest[1:] if isinstance(e, StreamEntry)] == ids[7:]
        assert len(rest) == 4
    finally:
        await items.aclose()
        await hub.close()


def _delta(i: int) -> dict[str, str]:
    return {"data": encode_event(TextDelta(turnId="t", round=1, text=str(i))).decode()}


@pytest.mark.parametrize("killed", ["tracking", "invalidations", "blocking-read"])
async def test_hub_reads_on_after_its_connection_is_killed(
    redis: aioredis.Redis, redis_url: str, keys: Keys, killed: str
) -> None:
    key = keys.log("alice", "s_kill")
    await redis.xadd(key, _delta(0))
    before = max(int(c["id"]) for c in await redis.client_list())
    tracking = killed != "blocking-read"
    hub = SseHub(Settings(redis_url=redis_url), redis, keys, block_ms=200, tracking=tracking)
    await hub.start()
    items = hub.stream(key, None, lambda e: True)
    try:
        async for item in items:
            if item is CAUGHT_UP:
                break
        following = asyncio.ensure_future(anext(items))

        async def hub_link() -> str | None:
            # The hub's link to kill: the one that sends its reads (its blocked XREAD, or
            # with client tracking its last XREAD), or the one told of changes (flag P).
            mine = [c for c in await redis.client_list() if int(c["id"]) > before]
            if killed == "invalidations":
                found = [c for c in mine if "P" in c.get("flags", "")]
            else:
                found = [c for c in mine if c.get("cmd") == "xread"]
            return found[0]["id"] if found else None

        await wait_for(lambda: hub.followers == 1, what="the follower registered")
        await wait_for(hub_link, what="the hub's link")
        ids = [await redis.xadd(key, _delta(1))]
        # Its connection goes (a Redis blip, a proxy's idle cut) while it waits for entries.
        assert await redis.client_kill_filter(_id=await hub_link()) == 1
        ids += [await redis.xadd(key, _delta(i)) for i in range(2, 5)]
        got = [await asyncio.wait_for(following, 10)]
        got += [await asyncio.wait_for(anext(items), 10) for _ in range(3)]
        # Every entry written meanwhile, in order, none twice.
        assert [e.id for e in got if isinstance(e, StreamEntry)] == ids
        assert hub.tracking is tracking
        if tracking:
            # A read per change at most, and one more for every stream when the links
            # are made again: never a read per stream per wake-up.
            assert hub.tracked_reads <= len(ids) + 3, hub.tracked_reads
        more = await redis.xadd(key, _delta(5))
        assert await asyncio.wait_for(anext(items), 10) == StreamEntry(
            more, "text.delta", _delta(5)["data"]
        )
    finally:
        await items.aclose()
        await hub.close()


async def test_hub_falls_back_to_blocking_reads_when_redis_refuses_client_tracking(
    redis: aioredis.Redis, redis_url: str, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    # A user that may not run CLIENT (as on some managed Redis services).
    user = "nocli" + keys.prefix
    await redis.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all", "-client")
    url = urllib.parse.urlsplit(redis_url)
    refused = url._replace(netloc=f"{user}:pw@{url.hostname}:{url.port}").geturl()
    key = keys.log("alice", "s_refused")
    first = await redis.xadd(key, _delta(0))
    hub = SseHub(Settings(redis_url=refused), redis, keys, block_ms=200)
    await hub.start()
    items = hub.stream(key, None, lambda e: True)
    try:
        assert [await anext(items), await anext(items)][1] is CAUGHT_UP
        following = asyncio.ensure_future(anext(items))
        await wait_for(lambda: not hub.tracking and hub.readers == 1, what="the fallback")
        ids = [await redis.xadd(key, _delta(i)) for i in range(1, 4)]
        got = [await asyncio.wait_for(following, 10)]
        got += [await asyncio.wait_for(anext(items), 10) for _ in range(2)]
        assert [e.id for e in got if isinstance(e, StreamEntry)] == ids
        assert first not in [e.id for e in got if isinstance(e, StreamEntry)]
        said = [r for r in caplog.records if "refused client tracking" in r.getMessage()]
        assert len(said) == 1 and "no permissions" in said[0].getMessage(), said
    finally:
        await items.aclose()
        await hub.close()
        await redis.execute_command("ACL", "DELUSER", user)


async def test_hub_drops_a_follower_that_falls_behind(
    redis: aioredis.Redis, redis_url: str, keys: Keys
) -> None:
    key = keys.log("alice", "s_slow")
    await redis.xadd(key, {"data": encode_event(TextDelta(turnId="t", round=1, text="0"))})
    hub = SseHub(Settings(redis_url=redis_url), redis, keys, queue_size=3, block_ms=200)
    await hub.start()
    try:
        items = hub.stream(key, None, lambda e: True)
        seen: list[object] = []
        async for item in items:
            seen.append(item)
            if item is CAUGHT_UP:
                break
        assert isinstance(seen[0], StreamEntry)
        slow = asyncio.create_task(items.__anext__())  # registers, then never reads on
        fast_items = hub.stream(key, None, lambda e: True)
        async for item in fast_items:
            if item is CAUGHT_UP:
                break
        fast_next = asyncio.create_task(fast_items.__anext__())
        await wait_for(lambda: hub.followers == 2, what="both followers registered")
        fast: list[object] = []
        for i in range(10):
            await redis.xadd(
                key, {"data": encode_event(TextDelta(turnId="t", round=1, text=str(i)))}
            )
            nxt = fast_next if i == 0 else asyncio.ensure_future(fast_items.__anext__())
            fast.append(await asyncio.wait_for(nxt, 5))
        assert [e.data for e in fast if isinstance(e, StreamEntry)][-1].endswith('"text":"9"}')
        # Its queue (3) overflowed: dropped, while the fast follower got every entry.
        assert isinstance(await asyncio.wait_for(slow, 5), StreamEntry)  # its one read
        with pytest.raises(FollowerDropped) as info:
            await asyncio.wait_for(items.__anext__(), 5)
        assert info.value.reason == "slow_consumer"
        assert hub.followers == 1
        await items.aclose()
        await fast_items.aclose()
        assert hub.followers == 0
        assert hub.followed_streams == 0
    finally:
        await hub.close()


@pytest.mark.timeout(90)
async def test_200_clients_dropped_mid_stream_free_everything(
    http: httpx.AsyncClient, gw: LiveGateway, token: str
) -> None:
    sid, tid = await session_and_turn(http)
    url = f"{gw.base_url}/v1/sessions/{sid}/turns/{tid}/events"
    metrics = gw.app.state.metrics
    hub = gw.gateway.hub

    def open_streams() -> float:
        value: float = metrics.open_streams._value.get()
        return value

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as client:
        # One warm-up stream, so anything started lazily on the first stream is part
        # of the baseline.
        warm = await client.get(url, headers={"Authorization": f"Bearer {token}"})
        await warm.content.readline()
        warm.close()
        await wait_for(lambda: open_streams() == 0 and hub.followers == 0, what="warm-up to end")
        baseline = len(asyncio.all_tasks())
        connections = len(gw.server.server_state.connections)

        async def open_one(i: int) -> aiohttp.ClientResponse:
            # Half by header, half by ?access_token= like a browser's EventSource.
            if i % 2:
                resp = await client.get(url, headers={"Authorization": f"Bearer {token}"})
            else:
                resp = await client.get(url, params={"access_token": token})
            assert resp.status == 200
            assert (await resp.content.readline()).startswith(b"id: ")
            return resp

        responses = await asyncio.gather(*(open_one(i) for i in range(200)))
        await wait_for(lambda: open_streams() == 200, what="200 open streams")
        assert hub.followers == 200
        assert hub.followed_streams == 1
        await append_events(
            gw.gateway.turns, "alice", sid, tid, TextDelta(turnId=tid, round=1, text="live")
        )

        async def saw_live(resp: aiohttp.ClientResponse) -> None:
            while b"live" not in await resp.content.readline():
                pass

        await asyncio.wait_for(asyncio.gather(*(saw_live(r) for r in responses)), 20)
        for resp in responses:
            resp.close()  # drop mid-stream: the turn is still running

    await wait_for(lambda: open_streams() == 0, deadline_s=20, what="open-stream gauge at 0")
    await wait_for(
        lambda: hub.followers == 0 and hub.followed_streams == 0, deadline_s=20, what="hub empty"
    )
    await wait_for(
        lambda: len(asyncio.all_tasks()) <= baseline,
        deadline_s=20,
        what=f"task count back to {baseline}",
    )
    await wait_for(
        lambda: len(gw.server.server_state.connections) <= connections,
        deadline_s=20,
        what="server connections closed",
    )


async def test_keep_alive_pings(settings: Settings, redis: aioredis.Redis, token: str) -> None:
    fast_pings = dataclasses.replace(settings, sse_ping_s=1)
    async with (
        live_gateway(fast_pings) as gw,
        httpx.AsyncClient(base_url=gw.base_url, timeout=10) as http,
    ):
        headers = {"Authorization": f"Bearer {token}"}
        sid = (await http.post("/v1/sessions", headers=headers)).json()["sessionId"]
        async with http.stream("GET", f"/v1/sessions/{sid}/events", headers=headers) as resp:
            lines = resp.aiter_lines()
            while not (await anext(lines)).startswith(": ping"):
                pass


async def test_a_client_that_stops_reading_is_dropped_with_a_clear_close(
    settings: Settings, redis: aioredis.Redis, token: str
) -> None:
    small_queue = dataclasses.replace(settings, sse_queue_size=2)
    async with live_gateway(small_queue) as gw, aiohttp.ClientSession() as client:
        headers = {"Authorization": f"Bearer {token}"}
        async with client.post(f"{gw.base_url}/v1/sessions", headers=headers) as r:
            sid = (await r.json())["sessionId"]
        async with client.post(
            f"{gw.base_url}/v1/sessions/{sid}/turns", headers=headers, json={"message": "x"}
        ) as r:
            tid = (await r.json())["turnId"]
        url = f"{gw.base_url}/v1/sessions/{sid}/turns/{tid}/events"
        metrics = gw.app.state.metrics
        async with client.get(url, headers=headers) as resp:
            first = await resp.content.readline()
            assert first.startswith(b"id: ")
            # The client reads nothing more while the worker writes a lot: the
            # socket buffers fill, the gateway's send blocks, its queue overflows.
            chunk = "x" * 65536
            i = 0
            while metrics.sse_dropped._value.get() == 0:
                await append_events(
                    gw.gateway.turns,
                    "alice",
                    sid,
                    tid,
                    TextDelta(turnId=tid, round=1, text=f"{i}{chunk}"),
                )
                i += 1
                assert i < 2000, "never dropped"
                await asyncio.sleep(0)
            rest = (first + await asyncio.wait_for(resp.content.read(), 20)).decode()
        assert rest.rstrip().split("\r\n\r\n")[-1].startswith("event: stream.dropped\r\n")
        last = list(iter_sse([rest]))[-1]
        assert last.event == "stream.dropped"
        data = last.json()
        assert data["type"] == "stream.dropped"
        assert data["reason"] == "slow_consumer"
        assert data["lastEventId"] in rest
        await wait_for(lambda: gw.gateway.hub.followers == 0, what="hub empty")


async def test_a_quiet_turn_stream_whose_session_is_deleted_ends_with_gone(
    settings: Settings, redis: aioredis.Redis, token: str
) -> None:
    # A turn nobody runs (no worker here) waits queued, as a paused one waits for its
    # caller: its follower only gets keep-alives. The session is deleted: at the next
    # keep-alive the stream ends with stream.dropped "gone", and a reconnect is a 404.
    fast_pings = dataclasses.replace(settings, sse_ping_s=1)
    async with (
        live_gateway(fast_pings) as gw,
        httpx.AsyncClient(
            base_url=gw.base_url, timeout=10, headers={"Authorization": f"Bearer {token}"}
        ) as http,
    ):
        sid, tid = await session_and_turn(http)
        url = f"/v1/sessions/{sid}/turns/{tid}/events"
        follower = Reader(http, url, expect=200)
        await follower.count(1)
        assert _types(follower.events) == ["turn.queued"]
        assert (await http.delete(f"/v1/sessions/{sid}")).status_code == 204
        events = await follower.closed()
        assert _types(events) == ["turn.queued", "stream.dropped"]
        assert '"reason":"gone"' in events[-1].data
        assert (await http.get(url)).status_code == 404

"""SSE cursors affect only their own follower; odd entries never stop the hub;
events that are ready together go out in one send."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from tests.gateway_server import (
    LiveGateway,
    Reader,
    session_and_turn,
    wait_for,
)
from tests.turn_kit import append_events, end_turn
from turnbus.gateway.auth import mint_token
from turnbus.gateway.hub import CAUGHT_UP
from turnbus.shared.events import (
    RoundStarted,
    TextDelta,
    TurnStarted,
    Usage,
    encode_event,
)
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings

pytestmark = pytest.mark.timeout(60)

AHEAD = "99999999999999-0"
MAX_ID = "18446744073709551615-18446744073709551615"


async def test_a_cursor_ahead_of_the_stream_is_refused_before_it_starts(
    http: httpx.AsyncClient, gw: LiveGateway
) -> None:
    sid, tid = await session_and_turn(http)
    for url in (f"/v1/sessions/{sid}/events", f"/v1/sessions/{sid}/turns/{tid}/events"):
        for cursor in (AHEAD, MAX_ID):
            r = await http.get(url, headers={"Last-Event-ID": cursor})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "cursor_ahead"
            assert error["field"] == "Last-Event-ID"
            r = await http.get(url, params={"after": cursor})
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "cursor_ahead"
    assert gw.gateway.hub.followers == 0


async def test_a_follower_ahead_of_the_stream_does_not_hold_back_another(
    http: httpx.AsyncClient, gw: LiveGateway
) -> None:
    sid, tid = await session_and_turn(http)
    hub = gw.gateway.hub
    key = gw.gateway.keys.turn_events("alice", sid, tid)
    # A follower with a cursor far ahead registers first.
    ahead = hub.stream(key, AHEAD, lambda e: e.type == "turn.queued")
    assert await anext(ahead) is CAUGHT_UP
    ahead_next = asyncio.ensure_future(anext(ahead))
    await wait_for(lambda: hub.followers == 1, what="the ahead follower registered")
    normal = Reader(http, f"/v1/sessions/{sid}/turns/{tid}/events", expect=200)
    await normal.count(1)
    await wait_for(lambda: hub.followers == 2, what="both followers registered")

    store = gw.gateway.turns
    await append_events(store, "alice", sid, tid, TurnStarted(turnId=tid, attempt=1, worker="w1"))
    await append_events(store, "alice", sid, tid, RoundStarted(turnId=tid, round=1))
    await append_events(store, "alice", sid, tid, TextDelta(turnId=tid, round=1, text="hello"))
    await append_events(store, "alice", sid, tid, Usage(turnId=tid, inputTokens=1, outputTokens=1))
    await end_turn(store, "alice", sid, tid, "completed", stop_reason="end_turn")
    # The normal follower gets all 6 entries and its turn stream ends.
    events = await normal.closed()
    assert [e.event for e in events] == [
        "turn.queued",
        "turn.started",
        "round.started",
        "text.delta",
        "usage",
        "turn.completed",
    ]
    # The follower ahead sees nothing: its cursor affects it alone.
    assert not ahead_next.done()
    ahead_next.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await ahead_next
    await ahead.aclose()
    await wait_for(lambda: hub.followers == 0, what="hub empty")


async def test_an_entry_that_is_not_utf8_does_not_stop_the_hub(
    http: httpx.AsyncClient, gw: LiveGateway, redis: aioredis.Redis, keys: Keys
) -> None:
    sid, tid = await session_and_turn(http)
    key = keys.turn_events("alice", sid, tid)
    await redis.xadd(key, {"data": b"\xff\xfe not utf-8 \xc3"})  # poison before connect
    reader = Reader(http, f"/v1/sessions/{sid}/turns/{tid}/events", expect=200)
    await reader.count(2)
    await wait_for(lambda: gw.gateway.hub.followers == 1, what="follower registered")
    await redis.xadd(key, {"data": b'{"type":"text.delta","text":"\xff"}'})  # poison, live
    await append_events(
        gw.gateway.turns, "alice", sid, tid, TextDelta(turnId=tid, round=1, text="after")
    )
    await end_turn(gw.gateway.turns, "alice", sid, tid, "completed", stop_reason="end_turn")
    events = await reader.closed()
    assert [e.event for e in events] == [
        "turn.queued",
        "unknown",
        "text.delta",
        "text.delta",
        "turn.completed",
    ]
    assert "\ufffd" in events[1].data and "\ufffd" in events[2].data
    assert events[3].json()["text"] == "after"
    # Another stream is still served live by the same hub.
    sid2, tid2 = await session_and_turn(http)
    second = Reader(http, f"/v1/sessions/{sid2}/turns/{tid2}/events", expect=200)
    await second.count(1)
    await end_turn(gw.gateway.turns, "alice", sid2, tid2, "completed", stop_reason="end_turn")
    assert [e.event for e in await second.closed()] == ["turn.queued", "turn.completed"]


async def _run_counting_sends(
    gw: LiveGateway, settings: Settings, path: str, started: asyncio.Event
) -> list[bytes]:
    """GET ``path`` through the gateway's ASGI app, recording each body send."""
    assert settings.jwt_secret
    token = mint_token(settings.jwt_secret, "alice")
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"authorization", f"Bearer {token}".encode()), (b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    bodies: list[bytes] = []
    disconnect = asyncio.Event()
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200
            started.set()
        elif message["type"] == "http.response.body" and message.get("body"):
            bodies.append(message["body"])

    await gw.app(scope, receive, send)
    return bodies


async def test_events_ready_together_go_out_in_one_send(
    http: httpx.AsyncClient, gw: LiveGateway, settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    sid, tid = await session_and_turn(http)
    store = gw.gateway.turns
    key = keys.turn_events("alice", sid, tid)
    path = f"/v1/sessions/{sid}/turns/{tid}/events"
    started = asyncio.Event()
    run = asyncio.create_task(_run_counting_sends(gw, settings, path, started))
    await asyncio.wait_for(started.wait(), 10)
    await wait_for(lambda: gw.gateway.hub.followers == 1, what="follower registered")
    # A burst the hub reads at once: 50 deltas and the terminal event, in one MULTI.
    async with redis.pipeline(transaction=True) as pipe:
        for i in range(50):
            pipe.xadd(key, {"data": encode_event(TextDelta(turnId=tid, round=1, text=f"d{i}"))})
        await pipe.execute()
    await end_turn(store, "alice", sid, tid, "completed", stop_reason="end_turn")
    bodies = await asyncio.wait_for(run, 10)
    text = b"".join(bodies).decode()
    assert text.count("event: text.delta") == 50
    assert text.count("event: turn.completed") == 1
    # One send for the catch-up, one for the burst, one for the terminal event
    # (never one send per event).
    assert len(bodies) <= 3, [len(b) for b in bodies]
    # A follower that connects now catches up on all 52 entries in one send.
    replay = await asyncio.wait_for(_run_counting_sends(gw, settings, path, asyncio.Event()), 10)
    assert len(replay) == 1
    assert b"".join(replay).decode().count("\r\n\r\n") == 52
    assert all(len(b) <= 64 * 1024 for b in bodies + replay)

"""``turnbus.Client`` and ``AsyncClient`` against a live gateway, a real worker and Redis.

The sync client runs in a thread: the test gateway is served from the test's own
event loop, which a blocking call on that loop would stall.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import turnbus
from harness.redis_server import free_port
from tests.gateway_server import LiveGateway, wait_for
from tests.worker_kit import running_worker, turn_events
from turnbus import (
    ApiError,
    AsyncClient,
    Client,
    Conflict,
    NotFound,
    QuotaExceeded,
    SessionBusy,
    SessionQueueFull,
    StreamLost,
    Unauthorized,
    Unavailable,
)
from turnbus.gateway import schemas
from turnbus.gateway.auth import mint_token
from turnbus.shared import records
from turnbus.shared.envelope import Envelope
from turnbus.shared.events import (
    Event,
    Resync,
    TextDelta,
    TurnCompleted,
    UnknownEvent,
    WorkingNotes,
    event_type,
)
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.worker.models.scripted import ScriptedModel

pytestmark = pytest.mark.timeout(60)


def _token(settings: Settings, user: str = "alice") -> str:
    assert settings.jwt_secret
    return mint_token(settings.jwt_secret, user)


async def test_async_client_runs_a_turn_reads_the_session_and_replays_a_key(
    gw: LiveGateway, settings: Settings
) -> None:
    async with (
        running_worker(settings, ScriptedModel(settings)),
        AsyncClient(gw.base_url, _token(settings)) as tb,
    ):
        session = await tb.create_session({"title": "client test"})
        assert session.meta == {"title": "client test"}
        turn = await tb.submit_turn(session.session_id, "remember the build is green")
        assert (turn.status, turn.replayed) == ("queued", False)
        stream = tb.events(session.session_id, turn.turn_id)
        events = [event async for event in stream]
        assert isinstance(events[-1], TurnCompleted)
        assert any(isinstance(e, WorkingNotes) for e in events)
        assert "".join(e.text for e in events if isinstance(e, TextDelta))
        assert stream.last_event_id is not None and stream.reconnects == 0

        notes = await tb.notes(session.session_id)
        assert notes.notes == "- the build is green"
        assert "- the build is green" in await tb.system(session.session_id)
        rows = await tb.messages(session.session_id)
        assert rows[0]["role"] == "user"
        record = await tb.get_turn(session.session_id, turn.turn_id)
        assert record.status == "completed"
        # After the terminal event there is nothing more to read: an empty stream.
        assert [
            e async for e in tb.events(session.session_id, turn.turn_id, after=stream.last_event_id)
        ] == []

        # The same key again: the same turn, replayed, no second turn.
        first = await tb.submit_turn(session.session_id, "hello", idempotency_key="k-1")
        again = await tb.submit_turn(session.session_id, "hello", idempotency_key="k-1")
        assert again.turn_id == first.turn_id and again.replayed
        await tb.delete_session(session.session_id)
        with pytest.raises(NotFound):
            await tb.get_session(session.session_id)


class CountingTransport(httpx.AsyncHTTPTransport):
    """Records every request the client sends."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, str]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append((request.method, request.url.path))
        return await super().handle_async_request(request)


async def test_run_turn_submits_and_follows_in_one_request(
    gw: LiveGateway, settings: Settings
) -> None:
    transport = CountingTransport()
    async with (
        running_worker(settings, ScriptedModel(settings)),
        AsyncClient(gw.base_url, _token(settings), transport=transport) as tb,
    ):
        session = await tb.create_session()
        stream = await tb.run_turn(session.session_id, "remember one request is enough")
        events = [event async for event in stream]
        notes = await tb.notes(session.session_id)
    assert event_type(events[0]) == "turn.queued" and isinstance(events[-1], TurnCompleted)
    assert any(isinstance(e, WorkingNotes) for e in events)
    assert notes.notes == "- one request is enough"
    assert transport.requests[:2] == [
        ("POST", "/v1/sessions"),
        ("POST", f"/v1/sessions/{session.session_id}/turns"),
    ]
    assert len(transport.requests) == 3  # and the notes: no GET of the events
    assert stream.reconnects == 0


async def test_sync_client_runs_a_turn_and_follows_the_session_log(
    gw: LiveGateway, settings: Settings
) -> None:
    def scenario() -> tuple[list[str], str | None, list[str]]:
        with Client(gw.base_url, _token(settings)) as tb:
            session = tb.create_session()
            events = list(tb.run_turn(session.session_id, "remember to ship on friday"))
            notes = tb.notes(session.session_id).notes
            log = tb.session_events(session.session_id)
            seen: list[str] = []
            for event in log:
                seen.append(event_type(event))
                if event_type(event) == "turn.completed":
                    break
            log.close()
            return [event_type(e) for e in events], notes, seen

    async with running_worker(settings, ScriptedModel(settings)):
        types, notes, log = await asyncio.to_thread(scenario)
    assert types[0] == "turn.queued" and types[-1] == "turn.completed"
    assert "working_notes" in types
    assert notes == "- to ship on friday"
    assert log[0] == "envelope.patched" and "working_notes" in log


async def test_typed_errors_busy_not_found_unauthorized(
    gw: LiveGateway, settings: Settings
) -> None:
    # No worker runs: the first turn stays active, so a second one is refused.
    async with AsyncClient(gw.base_url, _token(settings)) as tb:
        session = await tb.create_session()
        first = await tb.submit_turn(session.session_id, "one")
        with pytest.raises(SessionBusy) as busy:
            await tb.submit_turn(session.session_id, "two")
        assert busy.value.status == 409 and busy.value.code == "session_busy"
        assert busy.value.active_turn_id == first.turn_id
        with pytest.raises(SessionBusy):  # refused before any stream: raised at once
            await tb.run_turn(session.session_id, "two")
        queued = await tb.submit_turn(session.session_id, "two", multitask="enqueue")
        assert queued.turn_id != first.turn_id
        with pytest.raises(NotFound):
            await tb.get_turn(session.session_id, "t_nope")
        with pytest.raises(NotFound):
            await anext(tb.events(session.session_id, "t_nope"))
    async with AsyncClient(gw.base_url, "not-a-token") as anonymous:
        with pytest.raises(Unauthorized) as refused:
            await anonymous.create_session()
        assert refused.value.code == "unauthorized"

    def sync_busy() -> str:
        with Client(gw.base_url, _token(settings)) as tb, pytest.raises(SessionBusy) as exc:
            tb.submit_turn(session.session_id, "three")
        return exc.value.active_turn_id

    assert await asyncio.to_thread(sync_busy) == first.turn_id


async def test_a_full_session_queue_is_a_typed_error_with_retry_after() -> None:
    # The gateway's answer when a session's queue is full, served by a tiny app.
    async def full(request: Request) -> JSONResponse:
        body = {"error": {"code": "session_queue_full", "message": "64 turns wait already"}}
        return JSONResponse(body, status_code=429, headers={"Retry-After": "3"})

    app = Starlette(routes=[Route("/v1/sessions/{sid}/turns", full, methods=["POST"])])
    async with AsyncClient("http://gw", "t", transport=httpx.ASGITransport(app)) as tb:
        with pytest.raises(SessionQueueFull) as exc:
            await tb.submit_turn("s_1", "hello", multitask="enqueue")
    assert (exc.value.status, exc.value.code, exc.value.retry_after) == (
        429,
        "session_queue_full",
        3.0,
    )


async def test_a_quota_refusal_is_a_typed_error_with_field_and_retry_after() -> None:
    async def over(request: Request) -> JSONResponse:
        error = {"code": "quota_exceeded", "field": "turnsPerMinute", "message": "over"}
        return JSONResponse({"error": error}, status_code=429, headers={"Retry-After": "17"})

    app = Starlette(routes=[Route("/v1/sessions/{sid}/turns", over, methods=["POST"])])
    async with AsyncClient("http://gw", "t", transport=httpx.ASGITransport(app)) as tb:
        with pytest.raises(QuotaExceeded) as exc:
            await tb.submit_turn("s_1", "hello")
    assert (exc.value.code, exc.value.field, exc.value.retry_after) == (
        "quota_exceeded",
        "turnsPerMinute",
        17.0,
    )


def _with_each_client(
    kind: str, handler: Callable[[httpx.Request], httpx.Response], call: Callable[[Any], Any]
) -> Any:
    """``call(client)`` with the sync or the async client, on answers from ``handler``."""
    options: dict[str, Any] = dict(backoff_s=0.001, backoff_max_s=0.002, max_reconnects=2)
    if kind == "sync":
        with Client("http://gw", "t", transport=httpx.MockTransport(handler), **options) as tb:
            return call(tb)

    async def run() -> Any:
        transport = httpx.MockTransport(handler)
        async with AsyncClient("http://gw", "t", transport=transport, **options) as tb:
            result = call(tb)
            return await result if inspect.isawaitable(result) else result

    return asyncio.run(run())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_both_clients_read_a_refusal_into_its_typed_error(kind: str) -> None:
    def gateway(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":  # a key reused with another body
            body = {"error": {"code": "conflict", "message": "another body",
                              "field": "Idempotency-Key", "turnId": "t_0"}}  # fmt: skip
            return httpx.Response(409, json=body)
        return httpx.Response(502, text="<html>bad gateway</html>")  # a proxy's, not JSON

    with pytest.raises(Conflict) as conflict:
        _with_each_client(
            kind, gateway, lambda tb: tb.submit_turn("s_1", "hi", idempotency_key="k")
        )
    assert (conflict.value.status, conflict.value.turn_id) == (409, "t_0")
    assert conflict.value.field == "Idempotency-Key"
    with pytest.raises(ApiError) as refused:  # retried, then given up on
        _with_each_client(kind, gateway, lambda tb: tb.get_session("s_1"))
    assert (type(refused.value), refused.value.status, refused.value.code) == (
        ApiError,
        502,
        "unknown",
    )


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_both_clients_retry_a_503_where_it_is_safe_under_the_same_key(kind: str) -> None:
    seen: list[tuple[str, str | None]] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.headers.get("idempotency-key")))
        if len(seen) % 2:  # every other request: Redis is out of reach
            body = {"error": {"code": "unavailable", "message": "cannot reach Redis"}}
            return httpx.Response(503, json=body)
        accepted = {"turnId": "t_1", "status": "queued", "eventsUrl": "/e"}
        return httpx.Response(202, json=accepted, headers={"Idempotent-Replayed": "true"})

    turn = _with_each_client(kind, gateway, lambda tb: tb.submit_turn("s_1", "hi"))
    assert (turn.turn_id, turn.replayed) == ("t_1", True)
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0][1]  # one key, sent twice
    seen.clear()
    with pytest.raises(Unavailable):  # creating a session is not idempotent: not retried
        _with_each_client(kind, gateway, lambda tb: tb.create_session())
    assert seen == [("POST", None)]


async def test_a_trimmed_cursor_yields_resync_then_carries_on(
    gw: LiveGateway, settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    async with (
        running_worker(settings, ScriptedModel(settings)),
        AsyncClient(gw.base_url, _token(settings)) as tb,
    ):
        session = await tb.create_session()
        turn = await tb.submit_turn(session.session_id, "remember resync works")
        events = [e async for e in tb.events(session.session_id, turn.turn_id)]
        stream_key = keys.turn_events("alice", session.session_id, turn.turn_id)
        entries = await redis.xrange(stream_key)
        await redis.xtrim(stream_key, maxlen=2, approximate=False)
        resumed = [
            e async for e in tb.events(session.session_id, turn.turn_id, after=entries[0][0])
        ]
    assert isinstance(resumed[0], Resync)
    assert resumed[1:] == events[-2:]


# --- a gateway killed mid-turn and started again ----------------------------------------


class GatewayProcess:
    """``turnbus gateway`` on a fixed port, as its own process (SIGKILL-able)."""

    def __init__(self, settings: Settings, port: int, log: Path) -> None:
        assert settings.jwt_secret
        env = {k: v for k, v in os.environ.items() if not k.startswith("TURNBUS_")}
        env.update(
            TURNBUS_REDIS_URL=settings.redis_url,
            TURNBUS_PREFIX=settings.prefix,
            TURNBUS_JWT_SECRET=settings.jwt_secret,
        )
        self.base_url = f"http://127.0.0.1:{port}"
        with log.open("ab") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "turnbus", "gateway", "--port", str(port)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )

    async def ready(self) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=2) as http:

            async def up() -> bool:
                assert self.proc.poll() is None, "the gateway exited"
                try:
                    return (await http.get("/readyz")).status_code == 200
                except httpx.TransportError:
                    return False

            await wait_for(up, deadline_s=30, what="the gateway process")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def gateways() -> Iterator[list[GatewayProcess]]:
    started: list[GatewayProcess] = []
    yield started
    for gateway in started:
        gateway.kill()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["async", "sync", "run_turn"])
async def test_a_turn_stream_resumes_across_a_gateway_restart_with_each_event_once(
    kind: str,
    settings: Settings,
    redis: aioredis.Redis,
    keys: Keys,
    gateways: list[GatewayProcess],
    tmp_path: Path,
) -> None:
    port = free_port()
    gateways.append(GatewayProcess(settings, port, tmp_path / "gateway.log"))
    await gateways[-1].ready()
    slow = dataclasses.replace(settings, scripted_delay_ms=40, scripted_rounds=6)
    token = _token(settings)
    received: list[Event | UnknownEvent] = []
    done = threading.Event()
    reconnects: list[int] = []
    turn_ids: list[str] = []

    async with running_worker(slow, ScriptedModel(slow)):
        async with AsyncClient(gateways[-1].base_url, token) as setup:
            session = await setup.create_session()
            if kind != "run_turn":  # run_turn submits it, in the request it follows
                turn = await setup.submit_turn(session.session_id, "remember the restart")
                turn_ids.append(turn.turn_id)

        async def follow_async() -> None:
            async with AsyncClient(
                f"http://127.0.0.1:{port}", token, backoff_s=0.05, backoff_max_s=0.5,
                max_reconnects=100,
            ) as tb:  # fmt: skip
                if kind == "run_turn":
                    stream = await tb.run_turn(session.session_id, "remember the restart")
                else:
                    stream = tb.events(session.session_id, turn_ids[0])
                async for event in stream:
                    if not turn_ids:  # run_turn's: the turn is named by its first event
                        turn_ids.append(getattr(event, "turnId", ""))
                    received.append(event)
                reconnects.append(stream.reconnects)

        def follow_sync() -> None:
            with Client(
                f"http://127.0.0.1:{port}", token, backoff_s=0.05, backoff_max_s=0.5,
                max_reconnects=100,
            ) as tb:  # fmt: skip
                stream = tb.events(session.session_id, turn_ids[0])
                for event in stream:
                    received.append(event)
                reconnects.append(stream.reconnects)

        async def follow() -> None:
            try:
                if kind == "sync":
                    await asyncio.to_thread(follow_sync)
                else:
                    await follow_async()
            finally:
                done.set()

        follower = asyncio.create_task(follow())
        await wait_for(lambda: len(received) >= 4 or done.is_set(), 20, "the first events")
        assert not done.is_set(), received
        gateways[-1].kill()
        # Events go on being written while no gateway runs.
        tid = turn_ids[0]
        before = len(await turn_events(redis, keys, "alice", session.session_id, tid))
        await wait_for(
            lambda: _more_events(redis, keys, session.session_id, tid, before), 20,
            "the turn to go on without a gateway",
        )  # fmt: skip
        gateways.append(GatewayProcess(settings, port, tmp_path / "gateway.log"))
        await gateways[-1].ready()
        await asyncio.wait_for(follower, 30)

    stored = await turn_events(redis, keys, "alice", session.session_id, turn_ids[0])
    assert received == stored, "every event exactly once, in order"
    assert isinstance(received[-1], TurnCompleted)
    assert reconnects[0] >= 1


async def _more_events(
    redis: aioredis.Redis, keys: Keys, session: str, turn: str, than: int
) -> bool:
    return len(await turn_events(redis, keys, "alice", session, turn)) > than


async def test_a_stream_that_cannot_be_resumed_raises_stream_lost(settings: Settings) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    async with AsyncClient(closed, "t", backoff_s=0.01, backoff_max_s=0.02, max_reconnects=3) as tb:
        with pytest.raises(StreamLost, match="after 3 tries"):
            await anext(tb.events("s_1", "t_1"))


async def test_both_clients_page_through_the_sessions_list(
    gw: LiveGateway, settings: Settings
) -> None:
    async with AsyncClient(gw.base_url, _token(settings)) as tb:
        created = [(await tb.create_session({"title": f"t{i}"})).session_id for i in range(3)]
        first = await tb.list_sessions(limit=2)
        assert [s.session_id for s in first.sessions] == created[:0:-1]
        assert first.sessions[0].title == "t2" and first.sessions[0].active_turn is None
        assert first.next_cursor is not None
        last = await tb.list_sessions(limit=2, cursor=first.next_cursor)
        assert ([s.session_id for s in last.sessions], last.next_cursor) == ([created[0]], None)

    def in_a_thread() -> list[str]:
        with Client(gw.base_url, _token(settings)) as sync:
            return [s.session_id for s in sync.list_sessions().sessions]

    assert await asyncio.to_thread(in_a_thread) == created[::-1]


async def test_both_clients_create_a_session_with_the_title_given(
    gw: LiveGateway, settings: Settings
) -> None:
    async with AsyncClient(gw.base_url, _token(settings)) as tb:
        session = await tb.create_session(title="Release checklist")
        assert session.title == "Release checklist"
        assert session.meta == {"title": "Release checklist"}
        assert (await tb.get_session(session.session_id)).title == "Release checklist"
        # The keyword wins over a title in ``meta``; the rest of ``meta`` is kept.
        both = await tb.create_session({"title": "from meta", "personaId": "p"}, title="kw")
        assert (both.title, both.meta["personaId"]) == ("kw", "p")

    def in_a_thread() -> str | None:
        with Client(gw.base_url, _token(settings)) as sync:
            return sync.create_session(title="Sync title").title

    assert await asyncio.to_thread(in_a_thread) == "Sync title"


# --- the structs' names ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("client_struct", "wire_struct"),
    [
        (turnbus.TurnRecord, records.TurnRecord),
        (turnbus.TurnUsage, records.TurnUsage),
        (turnbus.TurnWebhook, records.TurnWebhook),
        (turnbus.SessionSummary, records.SessionSummary),
        (turnbus.SessionPage, records.SessionPage),
        (turnbus.ActiveTurn, records.ActiveTurn),
        (turnbus.Session, Envelope),
        (turnbus.TurnAccepted, schemas.TurnAccepted),
        (turnbus.Notes, schemas.NotesResponse),
    ],
)
def test_client_structs_are_snake_case_over_the_gateways_wire_names(
    client_struct: type[msgspec.Struct], wire_struct: type[msgspec.Struct]
) -> None:
    # The client's own view of each body: the same wire names as the gateway's.
    wire = set(wire_struct.__struct_encode_fields__)
    assert set(client_struct.__struct_encode_fields__) - {"replayed"} == wire
    assert all(name == name.lower() for name in client_struct.__struct_fields__)


def test_the_camel_case_names_still_read_and_warn() -> None:
    session = msgspec.json.decode(
        b'{"sessionId": "s_1", "updatedAt": 2, "createdAt": 1, "meta": {"title": "hi"}}',
        type=turnbus.Session,
    )
    assert (session.session_id, session.updated_at, session.title) == ("s_1", 2, "hi")
    with pytest.warns(
        DeprecationWarning, match=r"Session.sessionId is deprecated; use .session_id"
    ):
        assert session.sessionId == "s_1"
    page = msgspec.json.decode(b'{"sessions": [], "nextCursor": "c"}', type=turnbus.SessionPage)
    with pytest.warns(DeprecationWarning, match="next_cursor"):
        assert page.nextCursor == "c"
    with pytest.raises(AttributeError, match="session_idd"):
        _ = session.session_idd
    assert msgspec.json.decode(msgspec.json.encode(session), type=dict)["sessionId"] == "s_1"

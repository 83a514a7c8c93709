"""The durable pause for client tools, on a real stack (a live gateway, workers in
this process or in processes of their own, a real Redis): a turn that calls a client
tool commits its round, pauses (``requires_action``) holding no lease, no run slot and
no work entry, and any worker resumes it at the next round once its caller answers;
a bad answer changes nothing; a cancel or the action timeout closes the pending calls
with synthetic results, so the next turn's history stays valid."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from tests.gateway_server import live_gateway, signed_in
from tests.worker_kit import (
    WorkerProcess,
    running_worker,
    turn_events,
    wait_terminal,
    wait_until,
)
from turnbus import ApiError, AsyncClient, Client, PendingCall, ToolResultAnswer
from turnbus.gateway.auth import mint_token
from turnbus.shared.events import (
    Event,
    RoundStarted,
    TextDelta,
    ToolResult,
    TurnCancelled,
    TurnCompleted,
    TurnRequiresAction,
    TurnStarted,
    TurnTimedOut,
    UnknownEvent,
)
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.worker import slots
from turnbus.worker.commit import ACTION_CLOSED
from turnbus.worker.consumer import Worker
from turnbus.worker.models.scripted import ScriptedModel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

PICK = {
    "name": "pick_file",
    "description": "Ask the user to pick a file.",
    "inputSchema": {
        "type": "object",
        "properties": {"prompt": {"type": "string"}},
        "required": ["prompt"],
    },
}
CONFIRM = {
    "name": "confirm",
    "description": "Ask the user to confirm.",
    "inputSchema": {"type": "object", "properties": {"question": {"type": "string"}}},
}


@dataclasses.dataclass
class Stack:
    settings: Settings
    keys: Keys
    redis: aioredis.Redis
    http: httpx.AsyncClient
    sid: str

    async def submit(self, message: str, **body: Any) -> str:
        body = {"message": message, "clientTools": [PICK, CONFIRM], **body}
        r = await self.http.post(f"/v1/sessions/{self.sid}/turns", json=body)
        assert r.status_code == 202, r.text
        return str(r.json()["turnId"])

    async def record(self, tid: str) -> dict[str, Any]:
        r = await self.http.get(f"/v1/sessions/{self.sid}/turns/{tid}")
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    async def paused(self, tid: str, within: float = 15.0) -> dict[str, Any]:
        """The record once the turn waits for its caller."""
        record: dict[str, Any] = {}

        async def waiting() -> bool:
            nonlocal record
            record = await self.record(tid)
            return record["status"] == "requires_action"

        await wait_until(waiting, within)
        return record

    async def answer(self, tid: str, results: list[dict[str, Any]], **kw: Any) -> httpx.Response:
        return await self.http.post(
            f"/v1/sessions/{self.sid}/turns/{tid}/actions", json={"toolResults": results}, **kw
        )

    async def events(self, tid: str) -> list[Event | UnknownEvent]:
        return await turn_events(self.redis, self.keys, "alice", self.sid, tid)

    async def ended(self, tid: str, within: float = 15.0) -> list[Event | UnknownEvent]:
        return await wait_terminal(self.redis, self.keys, "alice", self.sid, tid, within)

    async def messages(self) -> list[dict[str, Any]]:
        r = await self.http.get(f"/v1/sessions/{self.sid}/messages")
        assert r.status_code == 200, r.text
        rows: list[dict[str, Any]] = r.json()["messages"]
        return rows


def fast(settings: Settings, **changes: Any) -> Settings:
    return dataclasses.replace(
        settings,
        lease_ms=1000,
        heartbeat_ms=200,
        claim_idle_ms=600,
        outbox_grace_ms=400,
        **changes,
    )


@contextlib.asynccontextmanager
async def stack(settings: Settings, redis: aioredis.Redis, keys: Keys) -> AsyncIterator[Stack]:
    async with live_gateway(settings) as gw, signed_in(gw, settings) as http:
        sid = (await http.post("/v1/sessions")).json()["sessionId"]
        yield Stack(settings, keys, redis, http, sid)


@contextlib.asynccontextmanager
async def paused_turn(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> AsyncIterator[tuple[Stack, str]]:
    """A stack with a worker, and a turn of it paused on one ``pick_file`` call."""
    settings = fast(settings)
    async with stack(settings, redis, keys) as s, running_worker(settings, ScriptedModel(settings)):
        tid = await s.submit(call("pick_file", prompt="a"))
        await s.paused(tid)
        yield s, tid


def call(tool: str, **tool_input: Any) -> str:
    return f"call {tool} {json.dumps(tool_input)}"


def of_type(events: list[Event | UnknownEvent], kind: type[Any]) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


async def holds_nothing(s: Stack, worker: Worker) -> None:
    """The paused turn holds no lease, no run slot, no work entry in flight."""
    assert not await s.redis.exists(s.keys.lease("alice", s.sid))
    assert worker.slots.busy == 0
    assert not worker.slots.in_flight
    info = await s.redis.xpending(s.keys.work(0), "workers")
    assert int(info["pending"]) == 0


async def _true(value: bool) -> bool:
    return value


def tool_uses_closed(rows: list[dict[str, Any]]) -> None:
    """Every tool_use of the history has its tool_result in the next row."""
    for i, row in enumerate(rows):
        uses = [
            b["id"] for b in row["content"] if isinstance(b, dict) and b.get("type") == "tool_use"
        ]
        if not uses:
            continue
        after = rows[i + 1]["content"] if i + 1 < len(rows) else []
        answered = {b.get("tool_use_id") for b in after if isinstance(b, dict)}
        assert set(uses) <= answered, (uses, rows)


async def test_a_client_call_pauses_the_turn_and_the_answer_resumes_it(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    settings = fast(settings)
    async with (
        stack(settings, redis, keys) as s,
        running_worker(settings, ScriptedModel(settings), name="w-a") as worker,
    ):
        tid = await s.submit(call("pick_file", prompt="which file?"))
        record = await s.paused(tid)
        [pending] = record["pendingCalls"]
        assert pending["name"] == "pick_file" and pending["kind"] == "client"
        assert pending["input"] == {"prompt": "which file?"}
        await holds_nothing(s, worker)
        [row] = (await s.http.get("/v1/sessions")).json()["sessions"]
        assert row["activeTurn"] == {"turnId": tid, "status": "requires_action"}
        env = (await s.http.get(f"/v1/sessions/{s.sid}")).json()
        assert env["meta"]["turnStatus"] == "requires_action"
        [paused] = of_type(await s.events(tid), TurnRequiresAction)
        assert [c.callId for c in paused.calls] == [pending["callId"]]
        r = await s.answer(tid, [{"callId": pending["callId"], "output": "notes.txt"}])
        assert r.status_code == 202, r.text
        assert r.json()["status"] == "queued" and "pendingCalls" not in r.json()
        events = await s.ended(tid)
        rows = await s.messages()
    assert isinstance(events[-1], TurnCompleted), events[-1]
    # The attempt the answer started says so: a client does not read it as a lost worker.
    started = [(e.attempt, e.after) for e in of_type(events, TurnStarted)]
    assert started == [(1, ""), (2, "answered")]
    [result] = of_type(events, ToolResult)
    assert (result.callId, result.output) == (pending["callId"], "notes.txt")
    # The answer's script filled in the tool's name and the round.
    assert (result.name, result.round) == ("pick_file", paused.round)
    text = "".join(e.text for e in of_type(events, TextDelta))
    assert "notes.txt" in text
    tool_uses_closed(rows)
    assert [r["role"] for r in rows] == ["user", "assistant", "user", "assistant"]
    # The answer left no call to run: the resume's start announced the next round with
    # it (no round commit between), and that round's commit stored the paused round too.
    resumed = next(i for i, e in enumerate(events) if isinstance(e, TurnStarted) and e.attempt == 2)
    after = events[resumed + 1]
    assert isinstance(after, RoundStarted) and after.round == paused.round + 1, events
    assert [e.round for e in of_type(events, RoundStarted)] == [paused.round, paused.round + 1]


async def test_two_client_calls_and_a_server_call_in_one_round_answered_together(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    settings = fast(settings)
    async with (
        stack(settings, redis, keys) as s,
        running_worker(settings, ScriptedModel(settings)) as worker,
    ):
        message = "\n".join(
            [
                call("working_notes_update", notes="the user picks files"),
                call("pick_file", prompt="which?"),
                call("confirm", question="sure?"),
            ]
        )
        tid = await s.submit(message)
        record = await s.paused(tid)
        assert [c["name"] for c in record["pendingCalls"]] == ["pick_file", "confirm"]
        # The round's server-side call ran and was committed before the pause.
        notes = (await s.http.get(f"/v1/sessions/{s.sid}/notes")).json()
        assert notes["notes"] == "the user picks files"
        before = await s.events(tid)
        kinds = [type(e).__name__ for e in before]
        assert kinds.index("ToolResult") < kinds.index("TurnRequiresAction")
        await holds_nothing(s, worker)
        # A later turn of the session queues behind the paused one, holding no run slot.
        later = await s.submit("hello", multitask="enqueue")
        await wait_until(lambda: _true(bool(worker.slots.in_flight) and worker.slots.busy == 0))
        assert (await s.record(later))["status"] == "queued"
        pick, confirm = (c["callId"] for c in record["pendingCalls"])
        answers = [
            {"callId": confirm, "output": "yes"},
            {"callId": pick, "output": "a.txt", "isError": False},
        ]
        assert (await s.answer(tid, answers)).status_code == 202
        events = await s.ended(tid)
        later_events = await s.ended(later)
        rows = await s.messages()
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert isinstance(later_events[-1], TurnCompleted), later_events[-1]
    results = {e.callId: e.output for e in of_type(events, ToolResult)}
    assert results[pick] == "a.txt" and results[confirm] == "yes"
    text = "".join(e.text for e in of_type(events, TextDelta))
    assert "a.txt" in text and "yes" in text
    tool_uses_closed(rows)
    # The results reach the model in the order of its calls.
    [row] = [r for r in rows if r.get("kind") == "tool_results"]
    assert [b["tool_use_id"] for b in row["content"]][1:] == [pick, confirm]


async def queued_behind_a_pause(s: Stack, worker: Worker) -> tuple[str, str, str]:
    """A turn paused on one client call and a later turn queued behind it, its entry
    waiting on the worker: (the paused turn, its call's id, the later turn)."""
    tid = await s.submit(call("pick_file", prompt="which?"))
    [pending] = (await s.paused(tid))["pendingCalls"]
    later = await s.submit("hello", multitask="enqueue")
    await wait_until(lambda: _true(bool(worker.slots.in_flight) and worker.slots.busy == 0))
    return tid, pending["callId"], later


def a_minute_between_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The waiter's next look behind a paused turn a minute away: only a wake-up brings
    it sooner."""
    monkeypatch.setattr(slots, "_PAUSED_POLL_S", 60.0)
    monkeypatch.setattr(slots, "_PAUSED_POLL_MAX_S", 60.0)


async def test_a_turn_queued_behind_a_paused_one_looks_at_it_rarely_and_runs_after(
    settings: Settings, redis: aioredis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A paused turn may wait a day: the turn queued behind it looks at its session about
    # once a second and less often after, not every 0.05-0.4 s as behind a running turn.
    paces: list[float] = []
    woken = slots._woken

    async def recorded(event: asyncio.Event, within: float) -> bool:
        paces.append(within)
        return await woken(event, within)

    monkeypatch.setattr(slots, "_woken", recorded)
    settings = fast(settings)
    async with (
        stack(settings, redis, keys) as s,
        running_worker(settings, ScriptedModel(settings)) as worker,
    ):
        tid, call_id, later = await queued_behind_a_pause(s, worker)
        await wait_until(lambda: _true(len(paces) >= 2))
        assert paces[:2] == [1.0, 1.5]
        assert worker.metrics.session_looks._value.get() >= 2
        assert (await s.record(later))["status"] == "queued"
        assert (await s.answer(tid, [{"callId": call_id, "output": "a"}])).status_code == 202
        assert isinstance((await s.ended(tid))[-1], TurnCompleted)
        assert isinstance((await s.ended(later))[-1], TurnCompleted)


async def test_a_cancel_of_a_paused_turn_wakes_the_turn_queued_behind_it(
    settings: Settings, redis: aioredis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the cancel's announcement starts the queued turn within the deadline.
    a_minute_between_looks(monkeypatch)
    settings = fast(settings)
    async with (
        stack(settings, redis, keys) as s,
        running_worker(settings, ScriptedModel(settings)) as worker,
    ):
        tid, _, later = await queued_behind_a_pause(s, worker)
        r = await s.http.post(f"/v1/sessions/{s.sid}/turns/{tid}/cancel")
        assert r.status_code == 202 and r.json()["status"] == "cancelled", r.text
        assert isinstance((await s.ended(later, within=10.0))[-1], TurnCompleted)
        tool_uses_closed(await s.messages())


async def test_an_answer_to_a_paused_turn_with_a_turn_queued_behind_it_tells_the_workers(
    settings: Settings, redis: aioredis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Behind an answered turn the waiter must go back to the usual pace: a worker ending
    # the resumed turn wakes its own waiters, and the answer's word on the cancel channel
    # reaches those of every other worker.
    a_minute_between_looks(monkeypatch)
    settings = fast(settings)
    pubsub = redis.pubsub()
    await pubsub.subscribe(keys.cancel_channel())
    try:
        async with (
            stack(settings, redis, keys) as s,
            running_worker(settings, ScriptedModel(settings)) as worker,
        ):
            # Nothing queued behind: the answer tells no one.
            alone = await s.submit(call("pick_file", prompt="which?"))
            [pending] = (await s.paused(alone))["pendingCalls"]
            publishes = await _publishes(redis)
            r = await s.answer(alone, [{"callId": pending["callId"], "output": "a"}])
            assert r.status_code == 202
            assert await _publishes(redis) == publishes
            assert isinstance((await s.ended(alone))[-1], TurnCompleted)

            tid, call_id, later = await queued_behind_a_pause(s, worker)
            r = await s.answer(tid, [{"callId": call_id, "output": "a"}])
            assert r.status_code == 202
            word = await _next_message(pubsub)
            assert word == {"user": "alice", "session": s.sid, "answered": tid}
            assert isinstance((await s.ended(tid))[-1], TurnCompleted)
            assert isinstance((await s.ended(later, within=10.0))[-1], TurnCompleted)
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]


async def _publishes(redis: aioredis.Redis) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_publish", {}).get("calls", 0))


async def _next_message(pubsub: Any, within: float = 10.0) -> dict[str, Any]:
    async with asyncio.timeout(within):
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=within)
            if message is not None:
                word: dict[str, Any] = json.loads(message["data"])
                return word


async def test_bad_answers_get_their_4xx_and_change_nothing(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    settings = fast(settings)
    async with stack(settings, redis, keys) as s, running_worker(settings, ScriptedModel(settings)):
        tid = await s.submit("\n".join([call("pick_file", prompt="a"), call("confirm")]))
        record = await s.paused(tid)
        pick, confirm = (c["callId"] for c in record["pendingCalls"])
        events = await s.events(tid)
        work = await s.redis.xlen(s.keys.work(0))
        cases: list[tuple[list[dict[str, Any]], int, str, str, str]] = [
            ([{"callId": "toolu_nope", "output": "x"}, {"callId": pick, "output": "x"}],
             422, "unknown_call", "toolu_nope", "toolResults[0].callId"),
            ([{"callId": pick, "output": "x"}], 422, "missing_call", confirm, "toolResults"),
            ([{"callId": pick, "output": "x"}, {"callId": pick, "output": "y"},
              {"callId": confirm, "output": "z"}],
             422, "duplicate_call", pick, "toolResults[1].callId"),
        ]  # fmt: skip
        for answers, status, code, call_id, field in cases:
            r = await s.answer(tid, answers)
            assert r.status_code == status, r.text
            error = r.json()["error"]
            assert (error["code"], error["callId"], error["field"]) == (code, call_id, field)
            assert call_id in error["message"]
            assert await s.record(tid) == record
            assert await s.events(tid) == events
            assert await s.redis.xlen(s.keys.work(0)) == work
        bad_body = await s.http.post(
            f"/v1/sessions/{s.sid}/turns/{tid}/actions", json={"toolResults": [{"output": "x"}]}
        )
        assert bad_body.status_code == 422, bad_body.text
        good = [{"callId": pick, "output": "a"}, {"callId": confirm, "output": "b"}]
        key = {"Idempotency-Key": "answer-1"}
        first = await s.answer(tid, good, headers=key)
        assert first.status_code == 202, first.text
        # A repeat under the same key answers the same; another body under it is refused.
        again = await s.answer(tid, good, headers=key)
        assert again.status_code == 202 and again.headers["idempotent-replayed"] == "true"
        other = await s.answer(tid, good[::-1], headers=key)
        assert other.status_code == 409 and other.json()["error"]["code"] == "conflict"
        # A second answer without the key: the turn no longer waits.
        double = await s.answer(tid, good)
        assert double.status_code == 409, double.text
        assert double.json()["error"]["code"] == "turn_not_waiting"
        events = await s.ended(tid)
        assert isinstance(events[-1], TurnCompleted)
        late = await s.answer(tid, good)
        assert late.status_code == 409 and late.json()["error"]["code"] == "turn_not_waiting"
        assert await s.events(tid) == events
        missing = await s.answer("t_0000000000000000000000", good)
        assert missing.status_code == 404
        # Each call got exactly one result, its answer's.
        assert sorted(e.output for e in of_type(events, ToolResult)) == ["a", "b"]


async def test_a_different_worker_resumes_the_turn(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    settings = fast(settings)
    async with stack(settings, redis, keys) as s:
        async with running_worker(settings, ScriptedModel(settings), name="w-first") as first:
            tid = await s.submit(call("pick_file", prompt="a"))
            record = await s.paused(tid)
            await holds_nothing(s, first)
        async with running_worker(settings, ScriptedModel(settings), name="w-second"):
            [pending] = record["pendingCalls"]
            r = await s.answer(tid, [{"callId": pending["callId"], "output": "b.txt"}])
            assert r.status_code == 202
            events = await s.ended(tid)
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert [e.worker for e in of_type(events, TurnStarted)] == ["w-first", "w-second"]
    assert "b.txt" in "".join(e.text for e in of_type(events, TextDelta))


async def test_a_paused_turn_survives_sigkill_of_its_worker(
    settings: Settings, redis: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    settings = fast(settings)
    env = {
        "TURNBUS_LEASE_MS": "1000",
        "TURNBUS_HEARTBEAT_MS": "200",
        "TURNBUS_CLAIM_IDLE_MS": "600",
    }
    async with stack(settings, redis, keys) as s:
        killed = WorkerProcess(settings, "w-killed", tmp_path / "w.log", **env)
        try:
            tid = await s.submit(call("pick_file", prompt="a"))
            record = await s.paused(tid, within=30)
        finally:
            killed.stop()  # SIGKILL
        assert killed.proc.returncode == -9
        assert not await s.redis.exists(s.keys.lease("alice", s.sid))
        async with running_worker(settings, ScriptedModel(settings), name="w-after"):
            [pending] = record["pendingCalls"]
            r = await s.answer(tid, [{"callId": pending["callId"], "output": "c.txt"}])
            assert r.status_code == 202
            events = await s.ended(tid)
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert [e.worker for e in of_type(events, TurnStarted)] == ["w-killed", "w-after"]


async def test_a_worker_killed_in_the_round_after_an_answer_loses_nothing(
    settings: Settings, redis: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """The resumed round's rows wait for the next round's commit: a worker killed in that
    round leaves them to the next attempt, which resumes the paused round again."""
    settings = fast(settings)
    env = {
        "TURNBUS_LEASE_MS": "1000",
        "TURNBUS_HEARTBEAT_MS": "200",
        "TURNBUS_CLAIM_IDLE_MS": "600",
        "TURNBUS_SCRIPTED_TTFT_MS": "60000",  # round 2 never answers before the kill
    }
    async with stack(settings, redis, keys) as s:
        async with running_worker(settings, ScriptedModel(settings), name="w-pause"):
            tid = await s.submit(call("pick_file", prompt="a"))
            record = await s.paused(tid)
        killed = WorkerProcess(settings, "w-killed", tmp_path / "w.log", **env)
        try:
            [pending] = record["pendingCalls"]
            r = await s.answer(tid, [{"callId": pending["callId"], "output": "d.txt"}])
            assert r.status_code == 202

            async def in_round_2() -> bool:
                events = await s.events(tid)
                return any(isinstance(e, RoundStarted) and e.round == 2 for e in events)

            await wait_until(in_round_2, 30)
        finally:
            killed.stop()  # SIGKILL
        assert killed.proc.returncode == -9
        assert [r["role"] for r in await s.messages()] == ["user"]  # round 1 not stored yet
        async with running_worker(settings, ScriptedModel(settings), name="w-after"):
            events = await s.ended(tid, within=30)
        rows = await s.messages()
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert [e.worker for e in of_type(events, TurnStarted)] == ["w-pause", "w-killed", "w-after"]
    assert "d.txt" in "".join(e.text for e in of_type(events, TextDelta))
    tool_uses_closed(rows)
    assert [r["role"] for r in rows] == ["user", "assistant", "user", "assistant"]


async def test_a_cancel_ends_a_paused_turn_at_once_and_closes_its_calls(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    settings = fast(settings)
    async with stack(settings, redis, keys) as s, running_worker(settings, ScriptedModel(settings)):
        tid = await s.submit("\n".join([call("lookup_nothing"), call("pick_file", prompt="a")]))
        await s.paused(tid)
        r = await s.http.post(f"/v1/sessions/{s.sid}/turns/{tid}/cancel")
        assert r.status_code == 202 and r.json()["status"] == "cancelled", r.text
        assert [c["name"] for c in r.json()["pendingCalls"]] == ["pick_file"]
        events = await s.events(tid)
        assert isinstance(events[-1], TurnCancelled)
        env = (await s.http.get(f"/v1/sessions/{s.sid}")).json()
        assert env["meta"]["turnStatus"] == "cancelled"
        rows = await s.messages()
        tool_uses_closed(rows)
        [closed] = [r for r in rows if r.get("kind") == "tool_results"]
        assert closed["content"][-1]["content"] == ACTION_CLOSED
        assert closed["content"][-1]["is_error"] is True
        # The next turn runs on a valid history.
        after = await s.submit("hello")
        assert isinstance((await s.ended(after))[-1], TurnCompleted)
        tool_uses_closed(await s.messages())


async def test_an_interrupt_ends_a_paused_turn_at_once_and_runs_next(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    async with paused_turn(settings, redis, keys) as (s, tid):
        # A new message while the turn waits for its caller: the waiting turn ends
        # (interrupted, by the new one), its call closed; the new one runs at once.
        after = await s.submit("hello", multitask="interrupt")
        [cancelled] = of_type(await s.ended(tid), TurnCancelled)
        assert (cancelled.reason, cancelled.by) == ("interrupted", after)
        record = await s.record(tid)
        assert (record["status"], record["reason"]) == ("cancelled", "interrupted")
        assert isinstance((await s.ended(after))[-1], TurnCompleted)
        tool_uses_closed(await s.messages())
        # The answer that comes too late changes nothing.
        [pending] = record["pendingCalls"]
        r = await s.answer(tid, [{"callId": pending["callId"], "output": "late"}])
        assert r.status_code == 409 and r.json()["error"]["code"] == "turn_not_waiting", r.text


async def test_past_its_action_timeout_a_paused_turn_times_out_and_closes_its_calls(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    settings = fast(settings)
    async with stack(settings, redis, keys) as s, running_worker(settings, ScriptedModel(settings)):
        tid = await s.submit(call("pick_file", prompt="a"), actionTimeoutS=1)
        paused = await s.paused(tid)
        assert paused["actionDeadline"] - paused["pausedAt"] == 1000
        events = await s.ended(tid, within=20)
        assert isinstance(events[-1], TurnTimedOut), events[-1]
        assert events[-1].reason == "action_timeout"
        record = await s.record(tid)
        assert (record["status"], record["reason"]) == ("timed_out", "action_timeout")
        rows = await s.messages()
        tool_uses_closed(rows)
        [closed] = [r for r in rows if r.get("kind") == "tool_results"]
        assert closed["content"][0]["content"] == ACTION_CLOSED
        # The record keeps the calls it waited on; an answer now is too late.
        assert record["pendingCalls"] == paused["pendingCalls"]
        late = await s.answer(tid, [{"callId": paused["pendingCalls"][0]["callId"], "output": "x"}])
        assert late.status_code == 409 and late.json()["error"]["code"] == "turn_not_waiting"
        after = await s.submit("hello")
        assert isinstance((await s.ended(after))[-1], TurnCompleted)
        tool_uses_closed(await s.messages())


async def test_a_follower_that_reconnects_gets_requires_action_again(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    async with paused_turn(settings, redis, keys) as (s, tid):
        entries = await s.redis.xrange(s.keys.turn_events("alice", s.sid, tid))
        ids = [entry_id for entry_id, _ in entries]
        paused_at = next(
            i for i, (_, f) in enumerate(entries) if '"turn.requires_action"' in f["data"]
        )
        url = f"/v1/sessions/{s.sid}/turns/{tid}/events"
        headers = {"Last-Event-ID": ids[paused_at - 1]}
        async with s.http.stream("GET", url, headers=headers, timeout=10) as resp:
            assert resp.status_code == 200
            seen: list[str] = []
            async for line in resp.aiter_lines():
                if line.startswith("event:"):
                    seen.append(line.split(":", 1)[1].strip())
                if "turn.requires_action" in seen:
                    break
        assert seen == ["turn.requires_action"]


async def test_the_wall_clock_counts_running_time_not_the_wait(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    settings = fast(settings, turn_wall_clock_ms=3000)
    async with stack(settings, redis, keys) as s, running_worker(settings, ScriptedModel(settings)):
        tid = await s.submit(call("pick_file", prompt="a"))
        record = await s.paused(tid)
        # As if the turn had started, and paused, a minute ago: past its wall clock
        # counted from its start, well within it counted without the wait.
        earlier = record["pausedAt"] - 60_000
        await s.redis.hset(
            s.keys.turn("alice", s.sid, tid),
            mapping={"startedAt": earlier, "pausedAt": earlier},
        )
        [pending] = record["pendingCalls"]
        assert (
            await s.answer(tid, [{"callId": pending["callId"], "output": "x"}])
        ).status_code == 202
        events = await s.ended(tid)
        assert isinstance(events[-1], TurnCompleted), events[-1]
        assert (await s.record(tid))["waitedMs"] >= 60_000


def pick_file(prompt: str) -> str:
    """Ask the user to pick a file."""
    return f"picked for {prompt}: notes.txt"


async def test_run_turn_answers_client_tools_with_the_sync_client(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    settings = fast(settings)
    token = mint_token(settings.jwt_secret or "", "alice")
    async with stack(settings, redis, keys) as s, running_worker(settings, ScriptedModel(settings)):
        base = str(s.http.base_url)

        def run() -> tuple[list[Any], list[PendingCall], Any]:
            with Client(base, token) as tb:
                stream = tb.run_turn(
                    s.sid,
                    "\n".join([call("pick_file", prompt="the report"), call("confirm")]),
                    client_tools={"pick_file": pick_file, "confirm": lambda **_: {"ok": True}},
                )
                events = list(stream)
                tid = events[0].turnId
                return events, tb.pending_actions(s.sid, tid), tb.get_turn(s.sid, tid)

        events, pending, record = await asyncio.to_thread(run)
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert len(of_type(events, TurnRequiresAction)) == 1
    outputs = sorted(e.output for e in of_type(events, ToolResult))
    assert outputs == ["picked for the report: notes.txt", '{"ok":true}']
    assert pending == [] and record.status == "completed" and record.resumes == 1
    assert [t.name for t in record.client_tools or []] == ["pick_file", "confirm"]
    spec = next(t for t in record.client_tools or [] if t.name == "pick_file")
    assert spec.description == "Ask the user to pick a file."
    assert spec.input_schema["required"] == ["prompt"]


async def test_the_async_client_answers_by_hand_and_by_run_turn(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    settings = fast(settings)
    token = mint_token(settings.jwt_secret or "", "alice")

    async def pick_async(prompt: str) -> str:
        """Pick a file, asynchronously."""
        return f"async:{prompt}"

    async with (
        stack(settings, redis, keys) as s,
        running_worker(settings, ScriptedModel(settings)),
        AsyncClient(str(s.http.base_url), token) as tb,
    ):
        stream = await tb.run_turn(
            s.sid, call("pick_file", prompt="x"), client_tools={"pick_file": pick_async}
        )
        events = [e async for e in stream]
        assert isinstance(events[-1], TurnCompleted), events[-1]
        [result] = of_type(events, ToolResult)
        assert result.output == "async:x"
        # The lower-level calls: submit, see what waits, answer it.
        accepted = await tb.submit_turn(
            s.sid, call("pick_file", prompt="y"), client_tools={"pick_file": pick_async}
        )
        tid = accepted.turn_id
        pending: list[PendingCall] = []

        async def waiting() -> bool:
            nonlocal pending
            pending = await tb.pending_actions(s.sid, tid)
            return bool(pending)

        await wait_until(waiting, 15)
        [waits] = pending
        assert (waits.name, waits.input, waits.kind) == ("pick_file", {"prompt": "y"}, "client")
        record = await tb.submit_actions(
            s.sid, tid, tool_results=[ToolResultAnswer(waits.call_id, "by hand")]
        )
        assert record.status in ("queued", "running", "completed")
        with pytest.raises(ApiError) as refused:
            await tb.submit_actions(
                s.sid, tid, tool_results=[ToolResultAnswer(waits.call_id, "again")]
            )
        assert refused.value.status == 409 and refused.value.code == "turn_not_waiting"
        events = [e async for e in tb.events(s.sid, tid)]
    assert isinstance(events[-1], TurnCompleted)
    assert [e.output for e in of_type(events, ToolResult)] == ["by hand"]


async def test_a_paused_round_keeps_no_copy_of_the_notes(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    settings = fast(settings)
    secret = "the launch code is 0000"
    async with stack(settings, redis, keys) as s, running_worker(settings, ScriptedModel(settings)):
        first = await s.submit(call("working_notes_update", notes=secret))
        await s.ended(first)
        tid = await s.submit("\n".join([call("working_notes_get"), call("pick_file", prompt="a")]))
        record = await s.paused(tid)
        calls = await s.redis.hgetall(s.keys.turn_calls("alice", s.sid, tid))
        assert calls and not any(secret in v for v in calls.values())
        [pending] = record["pendingCalls"]
        assert (
            await s.answer(tid, [{"callId": pending["callId"], "output": "x"}])
        ).status_code == 202
        events = await s.ended(tid)
    assert isinstance(events[-1], TurnCompleted), events[-1]
    # The resumed round read the notes again for the model.
    assert secret in "".join(e.text for e in of_type(events, TextDelta))


async def test_a_paused_and_answered_turn_is_freed_without_the_garbage_collector(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    """Each attempt's state and each request's objects go as they end (reference
    counting): a cycle among them would leave them to the garbage collector, whose passes
    over hundreds of turns' leftovers stop the worker or the gateway for tens of ms."""
    settings = fast(settings)
    async with (
        stack(settings, redis, keys) as s,
        running_worker(settings, ScriptedModel(settings)) as worker,
    ):
        gc.collect()
        gc.disable()
        try:
            tid = await s.submit(call("pick_file", prompt="which file?"))
            [pending] = (await s.paused(tid))["pendingCalls"]
            r = await s.answer(tid, [{"callId": pending["callId"], "output": "a.txt"}])
            assert r.status_code == 202, r.text
            events = await s.ended(tid)
            await wait_until(lambda: _true(worker.slots.busy == 0), 10)
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            left = Counter(type(o).__name__ for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert (left["AttemptState"], left["RequestResponseCycle"]) == (0, 0), left

"""Approvals on a real stack (a live gateway, workers in this process or in processes of
their own, a real Redis): a call to a tool that requires approval (the tool's flag, or
the host's ``allowedTools`` entry) pauses the turn as a client call does, with
``"kind": "approval"``; approve runs it with the model's input, edit with the new one,
reject gives the model the reason; an approved side-effecting call runs at most once
through a SIGKILL; a paused turn outlives its workers and a restart of Redis with AOF;
deleting the session ends it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from harness.redis_server import redis_binary
from tests.gateway_server import live_gateway, signed_in
from tests.worker.test_pipeline import SAMPLE_TOOLS
from tests.worker.test_tool_crash import gate_server
from tests.worker_kit import WorkerProcess, running_worker, turn_events, wait_terminal, wait_until
from turnbus import Approval, AsyncClient, Client, PendingCall
from turnbus.gateway.auth import mint_token
from turnbus.procs import free_port
from turnbus.redis_local import PrivateRedis
from turnbus.shared.events import (
    Event,
    RoundStarted,
    TextDelta,
    ToolResult,
    TurnCompleted,
    TurnRequiresAction,
    TurnStarted,
    UnknownEvent,
)
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.shared.turns import REJECTED, ApprovalAnswer, TurnStore
from turnbus.worker.models.scripted import ScriptedModel
from turnbus.worker.pipeline import OUTCOME_UNKNOWN
from turnbus.worker.python_tools import PythonToolSource
from turnbus.worker.registry import ToolRegistry

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

APPROVAL_TOOLS = str(Path(__file__).with_name("approval_tools.py"))
FAST_ENV = {
    "TURNBUS_LEASE_MS": "1000",
    "TURNBUS_HEARTBEAT_MS": "200",
    "TURNBUS_CLAIM_IDLE_MS": "600",
}
PICK = {
    "name": "pick_file",
    "description": "Ask the user to pick a file.",
    "inputSchema": {"type": "object", "properties": {"prompt": {"type": "string"}}},
}


def registry() -> ToolRegistry:
    return ToolRegistry([PythonToolSource([APPROVAL_TOOLS, SAMPLE_TOOLS], entry_points=False)])


def fast(settings: Settings) -> Settings:
    return dataclasses.replace(
        settings, lease_ms=1000, heartbeat_ms=200, claim_idle_ms=600, outbox_grace_ms=400
    )


def call(tool: str, **tool_input: Any) -> str:
    return f"call {tool} {json.dumps(tool_input)}"


def of_type(events: list[Event | UnknownEvent], kind: type[Any]) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def text_of(events: list[Event | UnknownEvent]) -> str:
    return "".join(e.text for e in of_type(events, TextDelta))


@dataclasses.dataclass
class Stack:
    settings: Settings
    keys: Keys
    redis: aioredis.Redis
    http: httpx.AsyncClient
    sid: str
    effects: Path

    async def submit(self, message: str, **body: Any) -> str:
        r = await self.http.post(
            f"/v1/sessions/{self.sid}/turns", json={"message": message, **body}
        )
        assert r.status_code == 202, r.text
        return str(r.json()["turnId"])

    async def paused(self, tid: str, within: float = 15.0) -> dict[str, Any]:
        record: dict[str, Any] = {}

        async def waiting() -> bool:
            nonlocal record
            r = await self.http.get(f"/v1/sessions/{self.sid}/turns/{tid}")
            assert r.status_code == 200, r.text
            record = r.json()
            return record["status"] == "requires_action"

        await wait_until(waiting, within)
        return record

    async def answer(self, tid: str, **body: Any) -> httpx.Response:
        return await self.http.post(f"/v1/sessions/{self.sid}/turns/{tid}/actions", json=body)

    async def ended(self, tid: str, within: float = 15.0) -> list[Event | UnknownEvent]:
        return await wait_terminal(self.redis, self.keys, "alice", self.sid, tid, within)

    async def messages(self) -> list[dict[str, Any]]:
        r = await self.http.get(f"/v1/sessions/{self.sid}/messages")
        assert r.status_code == 200, r.text
        rows: list[dict[str, Any]] = r.json()["messages"]
        return rows

    def sent(self) -> list[dict[str, Any]]:
        if not self.effects.exists():
            return []
        return [json.loads(line) for line in self.effects.read_text().splitlines()]


@contextlib.asynccontextmanager
async def stack(
    settings: Settings, redis: aioredis.Redis, keys: Keys, tmp_path: Path
) -> AsyncIterator[Stack]:
    async with live_gateway(settings) as gw, signed_in(gw, settings) as http:
        sid = (await http.post("/v1/sessions")).json()["sessionId"]
        yield Stack(settings, keys, redis, http, sid, tmp_path / "sent.jsonl")


@pytest.fixture(autouse=True)
def effects_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "sent.jsonl"
    monkeypatch.setenv("APPROVAL_TOOLS_LOG", str(path))
    return path


async def test_an_approved_call_runs_with_the_models_input(
    settings: Settings, redis: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    settings = fast(settings)
    async with (
        stack(settings, redis, keys, tmp_path) as s,
        running_worker(settings, ScriptedModel(settings), tools=registry()),
    ):
        tid = await s.submit(call("send", to="bob", body="hi") + "\n" + call("lookup", term="x"))
        record = await s.paused(tid)
        [pending] = record["pendingCalls"]
        assert (pending["name"], pending["kind"]) == ("send", "approval")
        assert pending["input"] == {"to": "bob", "body": "hi"}
        assert s.sent() == [], "nothing runs before the approval"
        # The round's call that needs no approval ran first.
        before = await turn_events(redis, keys, "alice", s.sid, tid)
        assert [r.name for r in of_type(before, ToolResult)] == ["lookup"]
        [paused] = of_type(before, TurnRequiresAction)
        assert [(c.name, c.kind) for c in paused.calls] == [("send", "approval")]
        r = await s.answer(tid, approvals=[{"callId": pending["callId"], "decision": "approve"}])
        assert r.status_code == 202, r.text
        events = await s.ended(tid)
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert s.sent() == [{"to": "bob", "body": "hi", "callId": pending["callId"]}]
    results = {e.name: e for e in of_type(events, ToolResult)}
    assert results["send"].output == "sent to bob: hi" and not results["send"].isError
    assert "sent to bob: hi" in text_of(events)
    # An approved call runs on resume: the next round starts after its result, not with
    # the resume's turn.started (as it does when the answer leaves nothing to run).
    resumed = next(i for i, e in enumerate(events) if isinstance(e, TurnStarted) and e.attempt == 2)
    ran = next(i for i, e in enumerate(events) if isinstance(e, ToolResult) and e.name == "send")
    next_round = next(
        i for i, e in enumerate(events) if isinstance(e, RoundStarted) and e.round > paused.round
    )
    assert resumed < ran < next_round, events


async def test_an_edited_call_runs_with_the_new_input_checked_against_its_schema(
    settings: Settings, redis: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    settings = fast(settings)
    async with (
        stack(settings, redis, keys, tmp_path) as s,
        running_worker(settings, ScriptedModel(settings), tools=registry()),
    ):
        tid = await s.submit(call("send", to="bob", body="hi"))
        [pending] = (await s.paused(tid))["pendingCalls"]
        cid = pending["callId"]
        # The gateway knows the tool's schema (the workers publish it): a bad edit is a 422.
        r = await s.answer(tid, approvals=[{"callId": cid, "decision": "edit", "input": {"to": 5}}])
        assert r.status_code == 422, r.text
        assert r.json()["error"]["field"] == "approvals[0].input"
        r = await s.answer(tid, approvals=[{"callId": cid, "decision": "edit"}])
        assert r.status_code == 422 and r.json()["error"]["field"] == "approvals[0].input"
        r = await s.answer(tid, toolResults=[{"callId": cid, "output": "done"}])
        assert r.status_code == 422 and r.json()["error"]["code"] == "wrong_answer"
        r = await s.answer(
            tid, approvals=[{"callId": cid, "decision": "approve", "input": {"to": "x"}}]
        )
        assert r.status_code == 422, r.text
        assert (await s.paused(tid))["pendingCalls"] == [pending], "nothing changed"
        edited = {"to": "carol", "body": "hello"}
        r = await s.answer(tid, approvals=[{"callId": cid, "decision": "edit", "input": edited}])
        assert r.status_code == 202, r.text
        events = await s.ended(tid)
        rows = await s.messages()
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert s.sent() == [{**edited, "callId": cid}]
    assert "sent to carol: hello" in text_of(events)
    # The history shows the call as it ran.
    [use] = [b for r in rows for b in r["content"] if b.get("type") == "tool_use"]
    assert use["input"] == edited


async def test_an_edit_the_gateway_cannot_check_is_checked_by_the_worker(
    settings: Settings, redis: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    settings = fast(settings)
    async with (
        stack(settings, redis, keys, tmp_path) as s,
        running_worker(settings, ScriptedModel(settings), tools=registry()),
    ):
        tid = await s.submit(call("send", to="bob", body="hi"))
        [pending] = (await s.paused(tid))["pendingCalls"]
        bad = ApprovalAnswer(callId=pending["callId"], decision="edit", input={"to": 5})
        turns = TurnStore(redis, keys, settings)
        await turns.submit_actions("alice", s.sid, tid, [], approvals=[bad], schemas={})
        events = await s.ended(tid)
    assert isinstance(events[-1], TurnCompleted), events[-1]
    [result] = of_type(events, ToolResult)
    assert result.isError and result.output.startswith("ERROR invalid input for send")
    assert s.sent() == []


async def test_a_rejected_call_gives_the_model_the_reason(
    settings: Settings, redis: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    settings = fast(settings)
    async with (
        stack(settings, redis, keys, tmp_path) as s,
        running_worker(settings, ScriptedModel(settings), tools=registry()),
    ):
        tid = await s.submit(call("send", to="bob", body="hi"))
        [pending] = (await s.paused(tid))["pendingCalls"]
        reason = "bob is on leave this week"
        r = await s.answer(
            tid, approvals=[{"callId": pending["callId"], "decision": "reject", "reason": reason}]
        )
        assert r.status_code == 202, r.text
        events = await s.ended(tid)
        rows = await s.messages()
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert s.sent() == []
    [result] = of_type(events, ToolResult)
    assert result.isError and result.output == REJECTED.format(reason=reason)
    assert reason in text_of(events), "the model read the reason"
    [block] = [b for r in rows for b in r["content"] if b.get("type") == "tool_result"]
    assert block["is_error"] and reason in block["content"]


async def test_the_host_requires_approval_in_allowed_tools_beside_a_client_call(
    settings: Settings, redis: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    settings = fast(settings)
    async with (
        stack(settings, redis, keys, tmp_path) as s,
        running_worker(settings, ScriptedModel(settings), tools=registry()),
    ):
        url = f"/v1/sessions/{s.sid}/meta"
        clock = (await s.http.get(f"/v1/sessions/{s.sid}")).json()["updatedAt"]
        meta = {"allowedTools": json.dumps(["send", {"name": "lookup", "bogus": True}])}
        r = await s.http.put(url, json={"updatedAt": clock + 1, "meta": meta})
        assert r.status_code == 422 and r.json()["error"]["field"] == "meta.allowedTools", r.text
        allowed = ["send", {"name": "lookup", "requiresApproval": True}, "count_to"]
        r = await s.http.put(
            url, json={"updatedAt": clock + 1, "meta": {"allowedTools": json.dumps(allowed)}}
        )
        assert r.status_code == 200, r.text
        message = "\n".join(
            [
                call("lookup", term="lease"),
                call("pick_file", prompt="which?"),
                call("count_to", count=2),
            ]
        )
        tid = await s.submit(message, clientTools=[PICK])
        record = await s.paused(tid)
        kinds = {c["name"]: c["kind"] for c in record["pendingCalls"]}
        assert kinds == {"lookup": "approval", "pick_file": "client"}
        ids = {c["name"]: c["callId"] for c in record["pendingCalls"]}
        r = await s.answer(tid, toolResults=[{"callId": ids["pick_file"], "output": "a.txt"}])
        assert r.status_code == 422 and r.json()["error"]["code"] == "missing_call", r.text
        r = await s.answer(
            tid,
            toolResults=[{"callId": ids["pick_file"], "output": "a.txt"}],
            approvals=[{"callId": ids["lookup"], "decision": "approve"}],
        )
        assert r.status_code == 202, r.text
        events = await s.ended(tid)
    assert isinstance(events[-1], TurnCompleted), events[-1]
    outputs = {e.name: e.output for e in of_type(events, ToolResult)}
    assert outputs["lookup"] == "lease: found" and outputs["pick_file"] == "a.txt"
    assert outputs["count_to"].endswith(": 2")


async def test_an_approved_side_effecting_call_runs_once_through_a_sigkill(
    settings: Settings,
    redis: aioredis.Redis,
    keys: Keys,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = fast(settings)
    async with gate_server(hold={"pay"}) as gate, stack(settings, redis, keys, tmp_path) as s:
        victim = WorkerProcess(
            settings,
            "victim",
            tmp_path / "victim.log",
            TURNBUS_TOOLS=APPROVAL_TOOLS,
            SAMPLE_TOOLS_GATE=gate.address,
            **FAST_ENV,
        )
        try:
            tid = await s.submit(call("pay", amount=40))
            [pending] = (await s.paused(tid, within=30))["pendingCalls"]
            r = await s.answer(
                tid, approvals=[{"callId": pending["callId"], "decision": "approve"}]
            )
            assert r.status_code == 202, r.text

            async def arrived() -> bool:
                return gate.count("pay") == 1

            await wait_until(arrived, 30)  # approved, running, its result not stored
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(timeout=10)
        finally:
            victim.stop()
        monkeypatch.setenv("SAMPLE_TOOLS_GATE", gate.address)
        gate.release.set()
        async with running_worker(
            settings, ScriptedModel(settings), name="rescuer", tools=registry()
        ):
            events = await s.ended(tid, within=30)
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert gate.count("pay") == 1, "the approved call's effect happened once"
    [result] = of_type(events, ToolResult)
    assert result.isError and result.output == OUTCOME_UNKNOWN
    assert text_of(events).endswith(OUTCOME_UNKNOWN), "the model was told"
    # The victim's second attempt resumed the answered pause; the rescuer's replaced a
    # lost worker, which its turn.started does not claim to know.
    started = [(e.worker, e.after) for e in of_type(events, TurnStarted)]
    assert started == [("victim", ""), ("victim", "answered"), ("rescuer", "")]


@pytest.mark.timeout(120)
async def test_a_paused_turn_outlives_every_worker_and_a_redis_restart(
    settings: Settings, tmp_path: Path
) -> None:
    server = PrivateRedis(
        tmp_path / "redis",
        tmp_path / "redis.log",
        port=free_port(),
        binary=redis_binary(),
        aof=True,
    )
    (tmp_path / "redis").mkdir()
    server.start()
    try:
        own = fast(dataclasses.replace(settings, redis_url=server.url, redis_cluster=False))
        keys = Keys(own.prefix)
        client = aioredis.Redis.from_url(server.url, decode_responses=True)
        async with stack(own, client, keys, tmp_path) as s:
            first = WorkerProcess(
                own, "w-paused", tmp_path / "w1.log", TURNBUS_TOOLS=APPROVAL_TOOLS, **FAST_ENV
            )
            try:
                tid = await s.submit(call("send", to="dan", body="later"))
                [pending] = (await s.paused(tid, within=30))["pendingCalls"]
            finally:
                first.stop()  # SIGKILL: every worker is gone
            assert first.proc.returncode == -9
            server.stop()  # SIGTERM: Redis writes its AOF and exits
            server.start()
            [again] = (await s.paused(tid, within=15))["pendingCalls"]
            assert again == pending
            async with running_worker(own, ScriptedModel(own), name="w-after", tools=registry()):
                r = await s.answer(
                    tid, approvals=[{"callId": pending["callId"], "decision": "approve"}]
                )
                assert r.status_code == 202, r.text
                events = await s.ended(tid, within=30)
            sent = s.sent()
        await client.aclose()
    finally:
        server.stop()
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert [e.worker for e in of_type(events, TurnStarted)] == ["w-paused", "w-after"]
    assert sent == [{"to": "dan", "body": "later", "callId": pending["callId"]}]


async def test_deleting_the_session_ends_the_waiting_turn(
    settings: Settings, redis: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    settings = fast(settings)
    async with (
        stack(settings, redis, keys, tmp_path) as s,
        running_worker(settings, ScriptedModel(settings), tools=registry()) as worker,
    ):
        tid = await s.submit(call("send", to="eve", body="x"))
        [pending] = (await s.paused(tid))["pendingCalls"]
        r = await s.http.delete(f"/v1/sessions/{s.sid}")
        assert r.status_code == 204, r.text
        r = await s.answer(tid, approvals=[{"callId": pending["callId"], "decision": "approve"}])
        assert r.status_code == 404, r.text
        assert (await s.http.get(f"/v1/sessions/{s.sid}/turns/{tid}")).status_code == 404
        member = Keys.outbox_member("alice", s.sid, tid)
        assert await redis.zscore(keys.outbox("alice", s.sid), member) is None
        assert not await redis.exists(keys.turn_calls("alice", s.sid, tid))
        assert worker.slots.busy == 0
    assert s.sent() == []


async def test_run_turn_decides_approvals_with_on_approval_sync_client(
    settings: Settings, redis: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    settings = fast(settings)
    token = mint_token(settings.jwt_secret or "", "alice")
    seen: list[PendingCall] = []

    def decide(pending: PendingCall) -> Approval | bool:
        seen.append(pending)
        if pending.input["to"] == "bob":
            return True
        return Approval.reject("not to mallory")

    async with (
        stack(settings, redis, keys, tmp_path) as s,
        running_worker(settings, ScriptedModel(settings), tools=registry()),
    ):
        base = str(s.http.base_url)
        message = "\n".join(
            [call("send", to="bob", body="a"), call("send", to="mallory", body="b")]
        )

        def run() -> list[Any]:
            with Client(base, token) as tb:
                return list(tb.run_turn(s.sid, message, on_approval=decide))

        events = await asyncio.to_thread(run)
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert [(p.name, p.kind) for p in seen] == [("send", "approval")] * 2
    assert [e["to"] for e in s.sent()] == ["bob"]
    outputs = [e.output for e in of_type(events, ToolResult)]
    assert "sent to bob: a" in outputs
    assert REJECTED.format(reason="not to mallory") in outputs


async def test_run_turn_decides_approvals_with_an_async_on_approval(
    settings: Settings, redis: aioredis.Redis, keys: Keys, tmp_path: Path
) -> None:
    settings = fast(settings)
    token = mint_token(settings.jwt_secret or "", "alice")

    async def decide(pending: PendingCall) -> Approval:
        return Approval.edit({**pending.input, "to": "carol"})

    async with (
        stack(settings, redis, keys, tmp_path) as s,
        running_worker(settings, ScriptedModel(settings), tools=registry()),
        AsyncClient(str(s.http.base_url), token) as tb,
    ):
        stream = await tb.run_turn(s.sid, call("send", to="bob", body="x"), on_approval=decide)
        events = [e async for e in stream]
        # No callback: the call is rejected, never run.
        stream = await tb.run_turn(
            s.sid, call("send", to="dan", body="y"), client_tools={"pick_file": lambda: "x"}
        )
        unanswered = [e async for e in stream]
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert [e["to"] for e in s.sent()] == ["carol"]
    assert isinstance(unanswered[-1], TurnCompleted), unanswered[-1]
    [result] = of_type(unanswered, ToolResult)
    assert result.isError and "no on_approval callback" in result.output

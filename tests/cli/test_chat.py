"""``turnbus chat``: a reused session shows its last exchanges before the prompt; each tool
call is one line with its input, state and duration; a round played again by a new attempt
is printed once."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.gateway_server import LiveGateway
from tests.turn_kit import append_events, end_turn
from tests.worker.test_approvals import registry as approval_registry
from tests.worker_kit import running_worker, wait_until
from turnbus import AsyncClient, ClientToolSpec
from turnbus.chat import NO_CLIENT_TOOLS, Chat, TurnPrinter, exchanges
from turnbus.cli import main
from turnbus.gateway.auth import mint_token
from turnbus.hints import turnbus_command
from turnbus.shared.events import (
    Event,
    RoundStarted,
    TextDelta,
    ToolCall,
    ToolResult,
    TurnCompleted,
    TurnStarted,
)
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.shared.turns import REJECTED, TurnStore
from turnbus.worker.models.scripted import ScriptedModel

pytestmark = pytest.mark.timeout(60)


def test_exchanges_pair_prompts_with_the_replies_text() -> None:
    rows = [
        {"role": "user", "content": [{"type": "text", "text": "one"}], "kind": "prompt"},
        {"role": "assistant", "content": [{"type": "text", "text": "calling"},
                                          {"type": "tool_use", "id": "x", "name": "n", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "ok"}],
         "kind": "tool_results"},
        {"role": "assistant", "content": [{"type": "text", "text": " done"}]},
        {"role": "user", "content": "two"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "a plain reply"},
    ]  # fmt: skip
    # Each model round's text on a line of its own, never run together.
    assert exchanges(rows, 5) == [("one", "calling\ndone"), ("two", ""), ("three", "a plain reply")]
    assert exchanges(rows, 2) == [("two", ""), ("three", "a plain reply")]
    assert exchanges(rows, 0) == []


async def test_chat_on_a_reused_session_shows_its_last_exchanges_first(
    gw: LiveGateway, settings: Settings
) -> None:
    assert settings.jwt_secret
    token = mint_token(settings.jwt_secret, "alice")
    async with running_worker(settings, ScriptedModel(settings)):
        async with AsyncClient(gw.base_url, token) as tb:
            session = (await tb.create_session()).session_id
            for message in ("hello there", "remember the build is green", "and one more"):
                events = [e async for e in await tb.run_turn(session, message)]
                assert events, message

        def chat() -> str:
            out = io.StringIO()
            session_chat = Chat(gw.base_url, token, out=out)
            try:
                session_chat.open_session(session)
                session_chat.show_history(2)
                session_chat.repl(io.StringIO("/notes\n/quit\n"))
            finally:
                session_chat.close()
            return out.getvalue()

        text = await asyncio.to_thread(chat)
    history, _, rest = text.partition("---\nsession ")
    assert "--- the last 2 exchanges of this session; 1 earlier not shown ---" in history
    assert "[you]   hello there" not in history
    assert history.index("[you]   remember the build is green") < history.index(
        "[you]   and one more"
    )
    # The reply's two model rounds, each on a line of its own.
    assert "[agent] Saving that to my working notes.\n        Noted: the build is green." in history
    assert "you> " not in history, "the history comes before the first prompt"
    assert "- the build is green" in rest


def _lost_worker_events(tid: str, replay: list[str]) -> list[Event]:
    """A turn whose worker was lost while round 2 streamed; attempt 2 plays round 2 again."""
    return [
        TurnStarted(turnId=tid, attempt=1),
        RoundStarted(turnId=tid, round=1),
        TextDelta(turnId=tid, round=1, text="Saving that."),
        ToolCall(turnId=tid, round=1, callId="c", name="working_notes_update"),
        ToolResult(
            turnId=tid,
            round=1,
            callId="c",
            name="working_notes_update",
            output="working notes updated (9 bytes)",
            durationMs=3,
        ),
        RoundStarted(turnId=tid, round=2),
        TextDelta(turnId=tid, round=2, text="Noted: z0 z1 "),
        TextDelta(turnId=tid, round=2, text="z2"),
        TurnStarted(turnId=tid, attempt=2),
        RoundStarted(turnId=tid, round=2),
        *(TextDelta(turnId=tid, round=2, text=t) for t in replay),
        TurnCompleted(turnId=tid),
    ]


def _printed(events: list[Event]) -> str:
    out = io.StringIO()
    printer = TurnPrinter(lambda text="", end="\n": out.write(text + end))
    ended = [printer.show(e) for e in events]
    assert ended[-1] == "turn.completed" and not any(ended[:-1])
    return out.getvalue()


def test_chat_prints_one_line_per_call_with_its_input_duration_and_error_state() -> None:
    tid = "t"
    long_input = {"text": "a line far longer than the forty characters an input gets"}
    events: list[Event] = [
        TurnStarted(turnId=tid, attempt=1),
        RoundStarted(turnId=tid, round=1),
        TextDelta(turnId=tid, round=1, text="Calling lookup, boom, append_line."),
        ToolCall(turnId=tid, round=1, callId="c1", name="lookup", input={"term": "lease"}),
        ToolCall(turnId=tid, round=1, callId="c2", name="boom", input={"reason": "gone"}),
        ToolCall(turnId=tid, round=1, callId="c3", name="append_line", input=long_input),
        # Each line is printed as its result comes in, paired with its call by id.
        ToolResult(
            turnId=tid,
            round=1,
            callId="c2",
            name="boom",
            output="ERROR boom raised ValueError: gone",
            isError=True,
            durationMs=2,
        ),
        ToolResult(
            turnId=tid,
            round=1,
            callId="c3",
            name="append_line",
            output="ERROR append_line timed out after 5 s (the call was cancelled)",
            isError=True,
            durationMs=5003,
        ),
        ToolResult(
            turnId=tid, round=1, callId="c1", name="lookup", output="lease: found", durationMs=12
        ),
        RoundStarted(turnId=tid, round=2),
        TextDelta(turnId=tid, round=2, text="Done."),
        TurnCompleted(turnId=tid),
    ]
    assert _printed(events) == (
        "agent> Calling lookup, boom, append_line.\n"
        '  [tool boom {"reason": "gone"} → ERROR, 2 ms: ERROR boom raised ValueError: gone]\n'
        '  [tool append_line {"text": "a line far longer than the fo… → ERROR, 5003 ms: '
        "ERROR append_line timed out after 5 s (the call was cancell…]\n"
        '  [tool lookup {"term": "lease"} → ok, 12 ms: lease: found]\n'
        "agent> Done.\n"
        "  [turn.completed (end_turn)]\n"
    )


@pytest.mark.parametrize(
    ("replay", "expected"),
    [
        (
            ["Noted: z0", " z1 z2 z3", " z4."],
            "agent> … z3 z4.\n",
        ),
        (
            ["Noted: z0, z1 z2"],
            "  [attempt 2 wrote round 2 anew; it replaces the text above]\n"
            "agent> Noted: z0, z1 z2\n",
        ),
        (
            ["Noted: z0"],
            "  [attempt 2 wrote round 2 anew; it replaces the text above]\nagent> Noted: z0\n",
        ),
    ],
    ids=["repeats-then-goes-on", "differs", "ends-short"],
)
def test_chat_prints_a_replayed_round_once_with_its_attempt(
    replay: list[str], expected: str
) -> None:
    text = _printed(_lost_worker_events("t", replay))
    head = (
        "agent> Saving that.\n"
        "  [tool working_notes_update {} → ok, 3 ms: working notes updated (9 bytes)]\n"
        "agent> Noted: z0 z1 z2\n"
        "  [attempt 2 after a worker was lost; the round it was streaming plays again, "
        "shown once]\n"
    )
    assert text == head + expected + "  [turn.completed (end_turn)]\n"


async def test_chat_follows_a_turn_whose_worker_was_lost(
    gw: LiveGateway, settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    """The same, through the gateway's event stream, as ``turnbus chat`` reads it."""
    assert settings.jwt_secret
    token = mint_token(settings.jwt_secret, "alice")
    async with AsyncClient(gw.base_url, token) as tb:
        session = (await tb.create_session()).session_id
        tid = (await tb.submit_turn(session, "remember z0 … z4")).turn_id
    store = TurnStore(redis, keys, settings)
    events = _lost_worker_events(tid, ["Noted: z0 z1 z2", " z3 z4."])
    for event in events[:-1]:
        await append_events(store, "alice", session, tid, event)
    await end_turn(store, "alice", session, tid, "completed")

    def follow() -> str:
        out = io.StringIO()
        chat = Chat(gw.base_url, token, out=out)
        try:
            chat.open_session(session)
            assert chat.follow(tid) == "turn.completed"
        finally:
            chat.close()
        return out.getvalue()

    text = await asyncio.to_thread(follow)
    assert text.count("z1") == 1, text
    assert "agent> Noted: z0 z1 z2\n  [attempt 2 after a worker was lost" in text
    assert "agent> … z3 z4.\n  [turn.completed (end_turn)]" in text


def _chat(argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    """``turnbus chat <argv>`` as the command runs it (in a thread: the test gateway is
    served from the test's own event loop)."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdin, sys.stdout, sys.stderr
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin), out, err
    try:
        code = main(["chat", *argv])
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved
    return code, out.getvalue(), err.getvalue()


async def test_chat_title_names_the_session_it_creates(gw: LiveGateway, settings: Settings) -> None:
    assert settings.jwt_secret
    token = mint_token(settings.jwt_secret, "alice")
    argv = ["--url", gw.base_url, "--token", token, "--title", "Release checklist"]
    code, out, err = await asyncio.to_thread(_chat, argv, "/quit\n")
    assert code == 0, err
    session = out.split()[1]  # "session <id> on <url>. …"
    async with AsyncClient(gw.base_url, token) as tb:
        assert (await tb.get_session(session)).title == "Release checklist"

    code, _, err = await asyncio.to_thread(_chat, [*argv, "--list"])
    assert code == 2 and "--title names a new session" in err


async def test_chat_list_prints_the_users_sessions_newest_first(
    gw: LiveGateway, settings: Settings
) -> None:
    assert settings.jwt_secret
    token = mint_token(settings.jwt_secret, "alice")
    async with AsyncClient(gw.base_url, token) as tb:
        older = (await tb.create_session({"title": "older"})).session_id
        newer = (await tb.create_session({"title": "newer"})).session_id
    async with AsyncClient(gw.base_url, mint_token(settings.jwt_secret, "bob")) as tb:
        await tb.create_session({"title": "not alice's"})

    def listing(user_token: str) -> str:
        code, out, err = _chat(["--url", gw.base_url, "--token", user_token, "--list"])
        assert code == 0, err
        return out

    lines = (await asyncio.to_thread(listing, token)).splitlines()
    assert [line.split()[0] for line in lines[:2]] == [newer, older]
    assert lines[0].endswith("newer") and lines[1].endswith("older")
    assert "not alice's" not in "\n".join(lines)
    # The command that works from here: bare `turnbus` only when the PATH finds this one.
    assert lines[2] == f"resume one with: {turnbus_command()} chat --session ID"
    empty = await asyncio.to_thread(listing, mint_token(settings.jwt_secret, "carol"))
    assert empty == "(no sessions yet)\n"


async def test_chat_interrupts_a_running_turn_and_queue_waits_for_it_instead(
    gw: LiveGateway, settings: Settings
) -> None:
    assert settings.jwt_secret
    token = mint_token(settings.jwt_secret, "alice")
    # Turns of a few seconds: three rounds of text streamed slowly.
    slow = dataclasses.replace(settings, scripted_delay_ms=100, scripted_rounds=3)
    async with (
        running_worker(slow, ScriptedModel(slow)),
        AsyncClient(gw.base_url, token) as tb,
    ):
        session = (await tb.create_session()).session_id
        argv = ["--url", gw.base_url, "--token", token, "--session", session, "--history", "0"]

        async def running(turn_id: str) -> bool:
            return (await tb.get_turn(session, turn_id)).status == "running"

        # Another client's turn runs: this chat's message interrupts it.
        first = (await tb.submit_turn(session, "take your time")).turn_id
        await wait_until(lambda: running(first))
        code, out, err = await asyncio.to_thread(_chat, argv, "a question\n/quit\n")
        assert code == 0, err
        record = await tb.get_turn(session, first)
        assert (record.status, record.reason) == ("cancelled", "interrupted")
        assert record.by is not None
        assert (await tb.get_turn(session, record.by)).status == "completed"
        assert "[turn.completed" in out, out

        # With --queue it waits for the running turn instead.
        second = (await tb.submit_turn(session, "take your time again")).turn_id
        await wait_until(lambda: running(second))
        code, out, err = await asyncio.to_thread(_chat, [*argv, "--queue"], "after it\n/quit\n")
        assert code == 0, err
        assert "[turn.completed" in out, out
        record = await tb.get_turn(session, second)
        assert (record.status, record.by) == ("completed", None)


async def test_chat_asks_approve_y_n_e_and_answers_a_client_call_it_cannot_run(
    gw: LiveGateway, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert settings.jwt_secret
    sent = tmp_path / "sent.jsonl"
    monkeypatch.setenv("APPROVAL_TOOLS_LOG", str(sent))
    token = mint_token(settings.jwt_secret, "alice")

    def send(to: str) -> str:
        return "call send " + json.dumps({"to": to, "body": "hi"})

    answers = "\n".join(
        [send("bob"), "y", send("mallory"), "n", "on leave", send("eve"), "maybe", "e",
         "not json", "e", '{"to": "carol", "body": "edited"}', "/quit", ""]
    )  # fmt: skip
    async with running_worker(settings, ScriptedModel(settings), tools=approval_registry()):

        def chat() -> str:
            out = io.StringIO()
            session_chat = Chat(gw.base_url, token, out=out)
            try:
                session_chat.open_session(None)
                session_chat.repl(io.StringIO(answers))
            finally:
                session_chat.close()
            return out.getvalue()

        text = await asyncio.to_thread(chat)
        assert text.count("approve? [y/n/e] ") == 5, text
        assert "worker was lost" not in text, "a resume after an answer is no lost worker"
        assert text.count("the turn goes on with the answers") == 3
        assert 'approval needed: send {"to": "bob", "body": "hi"}' in text
        assert "reason: " in text and "answer y (approve), n (reject) or e (edit" in text
        assert "! not JSON" in text
        assert REJECTED.format(reason="on leave") in text
        assert [json.loads(line)["to"] for line in sent.read_text().splitlines()] == [
            "bob",
            "carol",
        ]
        assert text.count("turn.completed") == 3

        # A client tool's call (declared by another client): chat says it cannot run it.
        async with AsyncClient(gw.base_url, token) as tb:
            session = (await tb.create_session()).session_id
            pick = ClientToolSpec(name="pick_file", description="Pick a file.",
                                  input_schema={"type": "object"})  # fmt: skip
            accepted = await tb.submit_turn(
                session, "call pick_file {}", client_tools={"pick_file": pick}
            )

        def follow() -> str:
            out = io.StringIO()
            session_chat = Chat(gw.base_url, token, out=out)
            try:
                session_chat.open_session(session)
                assert session_chat.follow(accepted.turn_id) == "turn.completed"
            finally:
                session_chat.close()
            return out.getvalue()

        followed = await asyncio.to_thread(follow)
    assert "the agent asks this client to run pick_file; chat cannot" in followed
    assert NO_CLIENT_TOOLS.format(name="pick_file") in followed

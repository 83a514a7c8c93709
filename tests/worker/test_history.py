from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import redis.asyncio as aioredis

from turnbus.shared import caps
from turnbus.shared.keys import Keys
from turnbus.shared.replicas import ReplicaWait
from turnbus.shared.settings import Settings
from turnbus.worker.commit import TurnCommit
from turnbus.worker.history import HistoryCache, HistoryFenced, SessionHistory, truncate_tool_result
from turnbus.worker.lease import SessionLease
from turnbus.worker.retry import RedisRetry

TOKEN = "lease-token"


class Committer:
    """Commits rows the way a round's commit does (``lua/turn_round.lua``), no events."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, settings: Settings) -> None:
        self.keys = keys
        self.lease = SessionLease(
            redis, keys, user="u1", session="s1", turn_id="t", token=TOKEN,
            lease_ms=30_000, heartbeat_ms=10_000,
        )  # fmt: skip
        self.turns = TurnCommit(
            redis, keys, settings, worker_name="w", budget=caps.HARNESS_SESSION_MAX_META_BYTES,
            retry=RedisRetry(0), replicas=ReplicaWait(0),
        )  # fmt: skip

    async def commit(
        self, history: SessionHistory, rows: list[dict[str, Any]], *, turn_id: str
    ) -> None:
        plan = history.commit_plan(rows)
        reply = await self.turns.commit_round(
            "u1", "s1", turn_id, lease=self.lease, plan=plan, envelope_at=None, events=[],
            notes=None,
        )  # fmt: skip
        if reply.status == "fenced":
            raise HistoryFenced(self.keys.messages("u1", "s1"))
        history.committed(plan)


@pytest.fixture
def committer(redis: aioredis.Redis, keys: Keys, settings: Settings) -> Committer:
    return Committer(redis, keys, settings)


def prompt(turn: str, text: str = "hi") -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": text}],
        "turnId": turn,
        "round": 0,
        "kind": "prompt",
    }


def assistant(turn: str, rnd: int, *, tool: bool = False, pad: int = 0) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "x" * pad or "ok"}]
    rows = [
        {
            "role": "assistant",
            "content": content,
            "turnId": turn,
            "round": rnd,
            "kind": "assistant",
            "stopReason": "tool_use" if tool else "end_turn",
        }
    ]
    if tool:
        content.append(
            {
                "type": "tool_use",
                "id": f"toolu_{turn}_{rnd}",
                "name": "working_notes_get",
                "input": {},
            }
        )
        rows.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"toolu_{turn}_{rnd}", "content": "r"}
                ],
                "turnId": turn,
                "round": rnd,
                "kind": "tool_results",
            }
        )
    return rows


async def load(redis: aioredis.Redis, keys: Keys, **caps_: int) -> SessionHistory:
    return await SessionHistory.load(redis, keys, "u1", "s1", **caps_)


def assert_well_formed(messages: list[dict[str, Any]]) -> None:
    """Starts with a user message, roles alternate, every tool_use is answered by the
    next message."""
    assert messages and messages[0]["role"] == "user"
    roles = [m["role"] for m in messages]
    assert all(a != b for a, b in itertools.pairwise(roles)), roles
    for i, message in enumerate(messages):
        uses = [b["id"] for b in message["content"] if b.get("type") == "tool_use"]
        if uses:
            answer = messages[i + 1]["content"]
            assert [b["tool_use_id"] for b in answer if b.get("type") == "tool_result"] == uses


def test_truncate_tool_result() -> None:
    assert truncate_tool_result("short") == ("short", False)
    out, cut = truncate_tool_result("é" * 100, limit=64)
    assert cut and len(out.encode()) <= 64
    assert out.endswith("of 200 bytes]")
    kept = int(out.rsplit("[truncated: kept ", 1)[1].split(" ")[0])
    assert out.startswith("é" * (kept // 2)) and kept % 2 == 0  # cut on a character boundary
    exact = "a" * caps.TOOL_RESULT_MAX_BYTES
    assert truncate_tool_result(exact) == (exact, False)


async def test_commits_are_fenced_by_the_lease(
    redis: aioredis.Redis, keys: Keys, committer: Committer
) -> None:
    history = await load(redis, keys)
    with pytest.raises(HistoryFenced):
        await committer.commit(history, [prompt("t1")], turn_id="t1")
    assert await redis.llen(keys.messages("u1", "s1")) == 0
    await redis.set(keys.lease("u1", "s1"), TOKEN)
    await committer.commit(history, [prompt("t1")], turn_id="t1")
    assert await redis.llen(keys.messages("u1", "s1")) == 1


async def test_row_cap_drops_oldest_whole_exchanges(
    redis: aioredis.Redis, keys: Keys, committer: Committer
) -> None:
    await redis.set(keys.lease("u1", "s1"), TOKEN)
    history = await load(redis, keys, max_rows=7)
    for turn in ("t1", "t2", "t3"):
        await committer.commit(history, [prompt(turn)], turn_id=turn)
        await committer.commit(history, assistant(turn, 1, tool=True), turn_id=turn)
    # 9 rows > 7: the whole first exchange (3 rows) goes, never half of it.
    stored = [json.loads(r) for r in await redis.lrange(keys.messages("u1", "s1"), 0, -1)]
    assert [(r["turnId"], r["kind"]) for r in stored] == [
        ("t2", "prompt"),
        ("t2", "assistant"),
        ("t2", "tool_results"),
        ("t3", "prompt"),
        ("t3", "assistant"),
        ("t3", "tool_results"),
    ]
    assert stored == history.rows
    reloaded = await load(redis, keys, max_rows=7)
    assert reloaded.model_messages() == history.model_messages()
    assert_well_formed(history.model_messages())


async def test_byte_cap_and_one_oversized_exchange(
    redis: aioredis.Redis, keys: Keys, committer: Committer
) -> None:
    await redis.set(keys.lease("u1", "s1"), TOKEN)
    history = await load(redis, keys, max_bytes=3000)
    await committer.commit(history, [prompt("t1")], turn_id="t1")
    await committer.commit(history, assistant("t1", 1, pad=500), turn_id="t1")
    await committer.commit(history, [prompt("t2")], turn_id="t2")
    # One exchange alone over the cap: its oldest rounds go, its prompt stays.
    for rnd in range(1, 8):
        await committer.commit(history, assistant("t2", rnd, tool=True, pad=400), turn_id="t2")
    stored = [json.loads(r) for r in await redis.lrange(keys.messages("u1", "s1"), 0, -1)]
    assert sum(len(r) for r in await redis.lrange(keys.messages("u1", "s1"), 0, -1)) <= 3000
    assert stored[0]["kind"] == "prompt" and stored[0]["turnId"] == "t2"
    rounds = [r["round"] for r in stored if r["kind"] == "assistant"]
    assert rounds == list(range(rounds[0], 8)) and rounds[0] > 1
    assert stored == history.rows
    assert_well_formed(history.model_messages())
    assert history.progress("t2").last_round == 7


async def test_progress_and_undecodable_rows(redis: aioredis.Redis, keys: Keys) -> None:
    await redis.rpush(keys.messages("u1", "s1"), json.dumps(prompt("t1")), "{not json")
    for row in assistant("t1", 1, tool=True) + assistant("t1", 2):
        await redis.rpush(keys.messages("u1", "s1"), json.dumps(row))
    history = await load(redis, keys)
    progress = history.progress("t1")
    assert (progress.has_prompt, progress.last_round, progress.last_stop) == (True, 2, "end_turn")
    assert history.progress("t9").has_prompt is False
    assert len(history.model_messages()) == 4  # the broken row is left out


async def test_interrupted_turns_still_give_alternating_messages(
    redis: aioredis.Redis, keys: Keys
) -> None:
    paused = assistant("t3", 1)
    paused[0]["stopReason"] = "pause_turn"
    rows = [
        prompt("t1", "cancelled before its first round"),
        prompt("t2", "cancelled after a tool round"),
        *assistant("t2", 1, tool=True),
        prompt("t3", "paused, then continued"),
        *paused,
        *assistant("t3", 2),
    ]
    await redis.rpush(keys.messages("u1", "s1"), *(json.dumps(r) for r in rows))
    messages = (await load(redis, keys)).model_messages()
    assert_well_formed(messages)
    assert [[b["type"] for b in m["content"]] for m in messages] == [
        ["text", "text"],  # two prompts with no reply between them: one user message
        ["text", "tool_use"],
        ["tool_result", "text"],  # tool results first, then the next prompt
        ["text", "text"],  # the paused round and its continuation
    ]
    # The stored rows are untouched.
    assert [json.loads(r) for r in await redis.lrange(keys.messages("u1", "s1"), 0, -1)] == rows


def test_thinking_is_kept_only_in_the_rows_of_the_live_turn() -> None:
    thinking = {"type": "thinking", "thinking": "secret steps", "signature": "s"}
    old = {**assistant("t1", 1)[0], "content": [thinking, {"type": "text", "text": "a"}]}
    raw = [json.dumps(prompt("t1")), json.dumps(old)]
    history = SessionHistory.from_raw(raw)
    assert history.holds_thinking()
    live = {**assistant("t2", 1)[0], "content": [thinking, {"type": "text", "text": "b"}]}
    # The live turn's new row keeps its thinking; an ended turn's stored row loses it,
    # so the commit rewrites the list.
    plan = history.commit_plan([prompt("t2"), live], live_turn="t2")
    assert plan.mode == "replace"
    stored = [json.loads(a) for a in plan.rows]
    assert [r["turnId"] for r in stored] == ["t1", "t1", "t2", "t2"]
    assert stored[1]["content"] == [{"type": "text", "text": "a"}]
    assert stored[3]["content"] == [thinking, {"type": "text", "text": "b"}]
    assert plan.kept_rows[3]["content"][0] == thinking  # the turn's own view keeps it
    # With no thinking stored, commits append as before.
    clean = SessionHistory.from_raw([json.dumps(prompt("t1"))])
    assert clean.commit_plan([live], live_turn="t2").mode == "append"
    plan = clean.commit_plan([live])  # the finish: no live turn
    assert plan.mode == "append" and b"secret steps" not in plan.rows[0]


def test_the_history_cache_keeps_the_most_recent_sessions_within_its_bytes(
    redis: aioredis.Redis, keys: Keys
) -> None:
    cache = HistoryCache(max_bytes=300)
    for session in ("s1", "s2", "s3"):
        rows = [json.dumps({"role": "user", "content": "x" * 100, "turnId": session})]
        history = SessionHistory.from_raw(rows)
        cache.put(keys.messages("u1", session), history)
    cache.get(keys.messages("u1", "s2"))  # used: kept over s3, the newer one
    cache.put(keys.messages("u1", "s4"), SessionHistory.from_raw(rows))
    assert cache.check_args(keys.messages("u1", "s1")) == ("0", b"")
    assert cache.check_args(keys.messages("u1", "s3")) == ("0", b"")
    assert cache.check_args(keys.messages("u1", "s2"))[0] == "1"
    assert len(cache) == 2

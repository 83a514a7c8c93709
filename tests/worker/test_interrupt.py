"""``multitask=interrupt`` on a real Redis (and the local cluster): the running turn is
cancelled at once (``reason`` ``interrupted``, ``by`` the new turn), the round it cut
short is kept in the history as far as it streamed, the new turn starts next, within
250 ms, ahead of the queued ones; with nothing running it is an enqueue."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.worker_kit import (
    ProgramModel,
    rounds,
    running_worker,
    text_round,
    tool_round,
    turn_events,
    wait_terminal,
    wait_until,
)
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.events import (
    TextDelta,
    ToolCall,
    TurnCancelled,
    TurnCompleted,
    TurnStarted,
)
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.base import ModelRequest, RoundResult, TextChunk, UsageCounts
from turnbus.worker.pipeline import CANCELLED
from turnbus.worker.python_tools import PythonToolSource
from turnbus.worker.registry import ToolRegistry
from turnbus.worker.state import CutRound

pytestmark = pytest.mark.cluster

U, S = "u1", "s1"
# The behaviour's deadline: the interrupting turn starts this soon after its submit.
START_DEADLINE_S = 0.25


def _long_round() -> list[TextChunk | RoundResult]:
    """A round that streams for about 20 s (at the model's 10 ms a chunk)."""
    return [
        *(TextChunk("word ") for _ in range(2000)),
        RoundResult("end_turn", [{"type": "text", "text": "x"}], [], UsageCounts()),
    ]


async def _first_long(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
    """The first round streams long; every later one answers at once."""
    return _long_round() if index == 0 else text_round(f"answer {index}")


async def _rows(redis: aioredis.Redis, keys: Keys) -> list[dict[str, Any]]:
    return [json.loads(r) for r in await redis.lrange(keys.messages(U, S), 0, -1)]


def _assert_valid_for_the_model(rows: list[dict[str, Any]]) -> None:
    """Roles alternate from a user message; every assistant message has content; every
    tool_use is answered by a tool_result in the next message."""
    assert rows[0]["role"] == "user"
    for before, after in itertools.pairwise(rows):
        assert before["role"] != after["role"], rows
    for i, row in enumerate(rows):
        assert row["content"], row
        if row["role"] != "assistant":
            continue
        uses = {b["id"] for b in row["content"] if b.get("type") == "tool_use"}
        if uses:
            answered = {b.get("tool_use_id") for b in rows[i + 1]["content"]}
            assert uses <= answered, (row, rows[i + 1])


async def _started(redis: aioredis.Redis, keys: Keys, turn_id: str) -> bool:
    return any(isinstance(e, TurnStarted) for e in await turn_events(redis, keys, U, S, turn_id))


async def _streaming(redis: aioredis.Redis, keys: Keys, turn_id: str) -> bool:
    return any(isinstance(e, TextDelta) for e in await turn_events(redis, keys, U, S, turn_id))


async def test_an_interrupt_cuts_the_running_turn_and_the_new_one_starts_within_250_ms(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create(U, S)
    turns = TurnStore(redis, keys, settings)
    model = ProgramModel(_first_long, delay_s=0.01)
    async with running_worker(settings, model):
        first, _, _ = await turns.submit_queued(U, S, "tell me a long story")
        await wait_until(lambda: _streaming(redis, keys, first.turnId))
        submitted = time.monotonic()
        second, _, _ = await turns.submit_queued(U, S, "stop, a question", multitask="interrupt")
        await wait_until(lambda: _started(redis, keys, second.turnId), interval=0.005)
        assert time.monotonic() - submitted < START_DEADLINE_S
        events = await wait_terminal(redis, keys, U, S, first.turnId, within=5)
        await wait_terminal(redis, keys, U, S, second.turnId, within=5)

    cancelled = events[-1]
    assert isinstance(cancelled, TurnCancelled)
    assert (cancelled.reason, cancelled.by) == ("interrupted", second.turnId)
    record = await turns.get(U, S, first.turnId)
    assert record is not None
    assert (record.status, record.reason, record.by) == ("cancelled", "interrupted", second.turnId)
    after = await turns.get(U, S, second.turnId)
    assert after is not None and after.status == "completed" and after.by is None

    # The cut round is kept as the model produced it: the text its events carried.
    streamed = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert streamed and set(streamed.split()) == {"word"}
    rows = await _rows(redis, keys)
    assert [(r["role"], r.get("turnId")) for r in rows] == [
        ("user", first.turnId),
        ("assistant", first.turnId),
        ("user", second.turnId),
        ("assistant", second.turnId),
    ]
    assert rows[1]["content"] == [{"type": "text", "text": streamed}]
    _assert_valid_for_the_model(rows)
    # The new turn's model saw it.
    assert model.requests[1].messages[1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": streamed}],
    }


_SLOW_TOOL = '''
import asyncio

from turnbus.tools import tool


@tool(timeout_s=60)
async def slow_lookup(term: str) -> str:
    """Runs until the turn is cut (the interrupt cancels it)."""
    await asyncio.Event().wait()
    return term
'''


async def test_an_interrupt_during_a_tool_call_closes_it_with_a_synthetic_result(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    tmp_path: Path,
) -> None:
    source = tmp_path / "slow_tools.py"
    source.write_text(_SLOW_TOOL)
    tools = ToolRegistry([PythonToolSource([str(source)], entry_points=False)])
    await store.create(U, S)
    turns = TurnStore(redis, keys, settings)

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        if index == 0:
            return tool_round("slow_lookup", {"term": "x"})
        return text_round(f"answer {index}")

    async def calling(turn_id: str) -> bool:
        events = await turn_events(redis, keys, U, S, turn_id)
        return any(isinstance(e, ToolCall) for e in events)

    async with running_worker(settings, ProgramModel(program), tools=tools):
        first, _, _ = await turns.submit_queued(U, S, "look it up")
        await wait_until(lambda: calling(first.turnId))
        second, _, _ = await turns.submit_queued(U, S, "never mind", multitask="interrupt")
        events = await wait_terminal(redis, keys, U, S, first.turnId, within=5)
        await wait_terminal(redis, keys, U, S, second.turnId, within=5)

    assert isinstance(events[-1], TurnCancelled) and events[-1].by == second.turnId
    rows = await _rows(redis, keys)
    assert [r["role"] for r in rows] == ["user", "assistant", "user", "user", "assistant"]
    assert rows[2]["content"][0]["tool_use_id"] == "toolu_1"
    assert rows[2]["content"][0]["is_error"] is True
    # The stored rows merge into alternating messages, every tool_use answered.
    merged: list[dict[str, Any]] = []
    for row in rows:
        if merged and merged[-1]["role"] == row["role"]:
            merged[-1]["content"] = [*merged[-1]["content"], *row["content"]]
        else:
            merged.append({"role": row["role"], "content": list(row["content"])})
    _assert_valid_for_the_model(merged)


async def test_an_interrupt_with_nothing_running_is_an_enqueue(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create(U, S)
    turns = TurnStore(redis, keys, settings)
    # No worker: the first turn stays queued, not running; an interrupt queues behind it
    # and cancels nothing.
    first, _, _ = await turns.submit_queued(U, S, "one")
    second, _, _ = await turns.submit_queued(U, S, "two", multitask="interrupt")
    assert second.status == "queued"
    assert await turns.active_turns(U, S) == [first.turnId, second.turnId]
    record = await turns.get(U, S, first.turnId)
    assert record is not None and not record.cancelRequested and record.by is None
    async with running_worker(settings, ProgramModel(rounds())):
        for turn in (first, second):
            events = await wait_terminal(redis, keys, U, S, turn.turnId, within=5)
            assert isinstance(events[-1], TurnCompleted)


async def test_an_interrupt_goes_ahead_of_the_queued_turns_which_stay_queued(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create(U, S)
    turns = TurnStore(redis, keys, settings)
    model = ProgramModel(_first_long, delay_s=0.01)
    async with running_worker(settings, model):
        running, _, _ = await turns.submit_queued(U, S, "a long one")
        await wait_until(lambda: _streaming(redis, keys, running.turnId))
        queued = [
            (await turns.submit_queued(U, S, f"queued {i}", multitask="enqueue"))[0]
            for i in range(2)
        ]
        interrupt, _, _ = await turns.submit_queued(U, S, "now", multitask="interrupt")
        order = [interrupt, *queued]
        for turn in order:
            await wait_terminal(redis, keys, U, S, turn.turnId, within=10)
        events = await wait_terminal(redis, keys, U, S, running.turnId, within=1)

    assert isinstance(events[-1], TurnCancelled) and events[-1].by == interrupt.turnId
    records = [await turns.get(U, S, t.turnId) for t in order]
    assert all(r is not None and r.status == "completed" for r in records)
    started = [r.startedAt for r in records if r is not None]
    assert started == sorted(started), started


async def test_interrupts_queue_in_the_order_they_came_behind_the_running_turn(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create(U, S)
    turns = TurnStore(redis, keys, settings)
    running, _, _ = await turns.submit_queued(U, S, "running")
    await redis.hset(keys.turn(U, S, running.turnId), "status", "running")  # as a start does
    queued, _, _ = await turns.submit_queued(U, S, "queued", multitask="enqueue")
    first, _, _ = await turns.submit_queued(U, S, "first", multitask="interrupt")
    second, _, _ = await turns.submit_queued(U, S, "second", multitask="interrupt")
    ids = [t.turnId for t in (running, first, second, queued)]
    assert await turns.active_turns(U, S) == ids
    record = await turns.get(U, S, running.turnId)
    assert record is not None and record.cancelRequested and record.by == first.turnId

    # The running turn ended; the first interrupt, queued, has not started yet: a third
    # interrupt still goes behind the interrupts, ahead of the queued turn.
    await redis.hset(keys.turn(U, S, running.turnId), "status", "cancelled")
    third, _, _ = await turns.submit_queued(U, S, "third", multitask="interrupt")
    assert await turns.active_turns(U, S) == [*ids[1:3], third.turnId, queued.turnId]
    record = await turns.get(U, S, first.turnId)
    assert record is not None and not record.cancelRequested


def test_a_cut_round_keeps_its_text_or_its_whole_message_with_its_calls_closed() -> None:
    cut = CutRound(2, parts=["Let me ", "check "])
    assert cut.rows("t_1") == [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Let me check "}],
            "turnId": "t_1",
            "round": 2,
            "kind": "assistant",
            "stopReason": "interrupted",
        }
    ]
    assert CutRound(1, parts=[" ", "\n"]).rows("t_1") == []  # no empty assistant message
    cut.result = tool_round("lookup", {"term": "x"})[-1]  # type: ignore[assignment]
    assistant, results = cut.rows("t_1")
    assert assistant["content"][-1]["type"] == "tool_use"
    assert results["kind"] == "tool_results"
    assert results["content"] == [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": CANCELLED, "is_error": True}
    ]

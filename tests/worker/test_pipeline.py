"""The tool pipeline (worker/pipeline.py) through a running worker and the scripted model:
every tool_use gets one result whatever the tool does, the allow-list holds, the calls
of a round run concurrently and their results come back in the model's order."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.worker_kit import running_worker, wait_terminal, wait_until
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.events import ToolCall, ToolResult, TurnCompleted
from turnbus.shared.keys import Keys
from turnbus.shared.meta import Meta
from turnbus.shared.settings import Settings
from turnbus.shared.tool_specs import read_published_tools
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.base import ModelRequest
from turnbus.worker.models.scripted import ScriptedModel
from turnbus.worker.python_tools import PythonToolSource
from turnbus.worker.registry import ToolRegistry
from turnbus.worker.tools import NOTES_TOOL_NAMES

# The pipeline runs on one Redis and on the local Redis Cluster (every script on the
# session's slot).
pytestmark = pytest.mark.cluster

SAMPLE_TOOLS = str(Path(__file__).with_name("sample_tools.py"))


def sample_registry() -> ToolRegistry:
    return ToolRegistry([PythonToolSource([SAMPLE_TOOLS], entry_points=False)])


class RecordingModel(ScriptedModel):
    """The scripted model, keeping each round's request (what it was offered)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.requests: list[ModelRequest] = []

    def stream_round(self, request: ModelRequest) -> Any:
        self.requests.append(request)
        return super().stream_round(request)


def calls(*lines: tuple[str, dict[str, Any]]) -> str:
    return "\n".join(f"call {name} {json.dumps(args)}" for name, args in lines)


async def run_turn(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    message: str,
    *,
    meta: Meta | None = None,
    model: ScriptedModel | None = None,
) -> tuple[list[ToolCall], list[ToolResult], str, list[dict[str, Any]]]:
    """Run one turn; its tool.call events, its tool.result events in the calls' order
    (a side-effecting call's result event is written as soon as the call ends), the
    final text, the history."""
    await store.create("u1", "s1", meta)
    turns = TurnStore(redis, keys, settings)
    async with running_worker(settings, model or ScriptedModel(settings), tools=sample_registry()):
        record, _, _ = await turns.submit_queued("u1", "s1", message)
        events = await wait_terminal(redis, keys, "u1", "s1", record.turnId, within=20)
    assert isinstance(events[-1], TurnCompleted), events[-1]
    text = "".join(getattr(e, "text", "") for e in events if type(e).__name__ == "TextDelta")
    rows = [json.loads(r) for r in await redis.lrange(keys.messages("u1", "s1"), 0, -1)]
    called = [e for e in events if isinstance(e, ToolCall)]
    order = {c.callId: i for i, c in enumerate(called)}
    results = sorted(
        (e for e in events if isinstance(e, ToolResult)), key=lambda r: order[r.callId]
    )
    return called, results, text, rows


async def test_a_round_calls_several_tools_and_gets_each_result_in_order(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    message = calls(("lookup", {"term": "lease"}), ("count_to", {"count": 3}))
    called, results, text, rows = await run_turn(redis, keys, settings, store, message)
    assert [c.name for c in called] == ["lookup", "count_to"]
    assert [r.name for r in results] == ["lookup", "count_to"]
    assert [r.callId for r in results] == [c.callId for c in called]
    assert not any(r.isError for r in results)
    assert results[0].output == "lease: found"
    # The context is the turn record's, never the model's input.
    turn_id = called[0].turnId
    assert results[1].output == f"u1/s1/{turn_id}/{called[1].callId}: 3"
    assert text.endswith(f"lease: found\nu1/s1/{turn_id}/{called[1].callId}: 3")
    assert all(r.durationMs >= 0 for r in results)
    # One tool_result per tool_use, stored with the round.
    uses = [b for row in rows for b in row["content"] if b.get("type") == "tool_use"]
    answers = [b for row in rows for b in row["content"] if b.get("type") == "tool_result"]
    assert [b["tool_use_id"] for b in answers] == [u["id"] for u in uses]


async def test_every_failure_is_an_error_result_and_the_turn_goes_on(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    message = calls(
        ("count_to", {"count": "three"}),  # fails the schema
        ("count_to", {}),  # a required field missing
        ("boom", {"reason": "ticket 7 is gone"}),
        ("hang", {}),
        ("big", {"megabytes": 5}),
        ("no_such_tool", {}),
        ("lookup", {"term": "turn"}),
        ("exits", {}),
    )
    _, results, _, rows = await run_turn(redis, keys, settings, store, message)
    by = [r.output for r in results]
    assert len(results) == 8
    assert results[0].isError and "count" in by[0] and "integer" in by[0]
    assert results[1].isError and "'count' is a required property" in by[1]
    assert results[2].isError and "ValueError: ticket 7 is gone" in by[2]
    assert "Traceback" not in by[2]
    assert results[3].isError and "timed out after 0.3 s" in by[3]
    assert not results[4].isError and results[4].truncated
    assert len(by[4].encode()) <= 16 * 1024
    assert by[4].endswith(f"of {5 * 1024 * 1024} bytes]")
    assert results[5].isError and "'no_such_tool' is not available" in by[5]
    assert not results[6].isError and by[6] == "turn: found"
    assert results[7].isError and "raised SystemExit: 3" in by[7]
    answers = [b for row in rows for b in row["content"] if b.get("type") == "tool_result"]
    assert [bool(b.get("is_error")) for b in answers] == [r.isError for r in results]


async def test_the_allow_list_offers_only_the_notes_tools_and_lookup(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    model = RecordingModel(settings)
    message = calls(("lookup", {"term": "round"}), ("count_to", {"count": 1}))
    meta = Meta(allowedTools=json.dumps(["lookup"]))
    _, results, _, _ = await run_turn(redis, keys, settings, store, message, meta=meta, model=model)
    for request in model.requests:
        offered = [t["name"] for t in request.tools]
        # Every round: the notes tools, then the allowed ones, nothing else.
        assert set(offered) == NOTES_TOOL_NAMES | {"lookup"}
        assert offered[3:] == ["lookup"]
    assert not results[0].isError
    # A forged call to a registered tool the session may not use is refused.
    assert results[1].isError and "'count_to' is not available" in results[1].output


async def test_the_submitting_tokens_tools_claim_narrows_the_turn_further(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    model = RecordingModel(settings)
    await store.create("u1", "s1", Meta(allowedTools=json.dumps(["lookup", "count_to"])))
    turns = TurnStore(redis, keys, settings)
    message = calls(("lookup", {"term": "x"}), ("count_to", {"count": 1}))
    async with running_worker(settings, model, tools=sample_registry()):
        # The gateway keeps the token's claim on the record (routes/turns.py).
        record, _, _ = await turns.submit_queued(
            "u1", "s1", message, allowed_tools=json.dumps(["lookup", "charge"])
        )
        events = await wait_terminal(redis, keys, "u1", "s1", record.turnId, within=20)
    for request in model.requests:
        assert [t["name"] for t in request.tools][3:] == ["lookup"]
    results = {e.name: e for e in events if isinstance(e, ToolResult)}
    assert not results["lookup"].isError
    assert results["count_to"].isError and "not available" in results["count_to"].output


async def test_without_an_allow_list_every_registered_tool_is_offered_sorted(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    model = RecordingModel(settings)
    await run_turn(redis, keys, settings, store, "hello", model=model)
    (request,) = model.requests
    names = [t["name"] for t in request.tools]
    assert names[:3] == ["working_notes_get", "working_notes_update", "working_notes_clear"]
    assert names[3:] == sorted(names[3:])
    assert {"lookup", "charge", "fetch", "boom"} <= set(names[3:])
    count_to = next(t for t in request.tools if t["name"] == "count_to")
    assert count_to["description"] == "Count up to ``count``."
    assert count_to["input_schema"]["required"] == ["count"]
    assert "ctx" not in count_to["input_schema"]["properties"]


async def test_a_worker_publishes_its_tools_with_each_heartbeat_and_takes_them_when_it_leaves(
    redis: aioredis.Redis, keys: Keys, settings: Settings
) -> None:
    fast = dataclasses.replace(settings, heartbeat_ms=50)
    async with running_worker(fast, ScriptedModel(fast), name="w-pub", tools=sample_registry()):
        published = await read_published_tools(redis, keys)
        assert {"lookup", "charge", "working_notes_get"} <= set(published)
        # Lost (a Redis that lost its data, a flush): written again by the next heartbeat.
        await redis.hdel(keys.tools(), "w-pub")
        await wait_until(lambda: redis.hexists(keys.tools(), "w-pub"), 10)
    assert not await redis.hexists(keys.tools(), "w-pub")

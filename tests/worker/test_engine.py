"""The turn engine, driven through a real Worker and Redis with a programmable model."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json

import pytest
import redis.asyncio as aioredis

from tests.worker.test_pipeline import sample_registry
from tests.worker_kit import (
    ProgramModel,
    log_events,
    no_pending,
    rounds,
    running_worker,
    text_round,
    tool_round,
    turn_events,
    types_of,
    wait_terminal,
    wait_until,
)
from turnbus.shared import caps
from turnbus.shared.envelope import Envelope, EnvelopeStore
from turnbus.shared.events import (
    EnvelopePatched,
    TextDelta,
    ToolResult,
    TurnCompleted,
    TurnFailed,
    TurnStarted,
    Usage,
    WorkingNotes,
)
from turnbus.shared.keys import Keys
from turnbus.shared.meta import Meta
from turnbus.shared.settings import Settings
from turnbus.shared.system import WORKING_NOTES_FOLD, resolve_system, working_notes_block
from turnbus.shared.turns import TurnStore
from turnbus.worker.consumer import GROUP
from turnbus.worker.models.base import ModelError, ModelRequest, RoundResult, TextChunk, UsageCounts
from turnbus.worker.tools import NOTES_CLEARED


async def submit(
    turns: TurnStore, message: str, *, session: str = "s1", enqueue: bool = False
) -> str:
    record, _, _ = await turns.submit_queued(
        "u1", session, message, multitask="enqueue" if enqueue else "reject"
    )
    return record.turnId


async def test_a_turn_streams_and_completes(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    model = ProgramModel(rounds(text_round("Hello there, this is a streamed answer.", chunks=4)))
    async with running_worker(settings, model, name="w1"):
        tid = await submit(turns, "hi")
        events = await wait_terminal(redis, keys, "u1", "s1", tid)
        kinds = types_of(events)
        assert kinds[:3] == ["turn.queued", "turn.started", "round.started"]
        assert kinds[-2:] == ["usage", "turn.completed"]
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        assert text == "Hello there, this is a streamed answer."
        started = next(e for e in events if isinstance(e, TurnStarted))
        assert (started.attempt, started.worker) == (1, "w1")
        # The entry is acked only after the terminal event; the lease is gone.
        await wait_until(lambda: no_pending(redis, keys))
        await wait_until(lambda: _gone(redis, keys.lease("u1", "s1")))

    record = await turns.get("u1", "s1", tid)
    assert record is not None
    assert (record.status, record.stopReason, record.attempt) == ("completed", "end_turn", 1)
    assert record.usage is not None and record.usage.inputTokens == 10
    envelope = await store.read("u1", "s1")
    assert envelope is not None
    assert (envelope.meta.turnRunId, envelope.meta.turnStatus) == (tid, "completed")
    assert json.loads(envelope.meta.usage or "{}")["outputTokens"] == 5
    assert await turns.active_turns("u1", "s1") == []
    # The model saw the system prompt as blocks and as the same joined string.
    request = model.requests[0]
    assert request.system == resolve_system()
    assert "".join(b["text"] for b in request.system_blocks) == request.system
    assert request.messages == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    rows = [json.loads(r) for r in await redis.lrange(keys.messages("u1", "s1"), 0, -1)]
    assert [(r["kind"], r["round"]) for r in rows] == [("prompt", 0), ("assistant", 1)]


async def _gone(redis: aioredis.Redis, key: str) -> bool:
    return not await redis.exists(key)


async def test_a_note_reaches_the_next_round_and_the_next_turn(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1", Meta(personaSnapshot="You are terse."))
    turns = TurnStore(redis, keys, settings)

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        prompt = request.messages[-1]["content"][0].get("text", "")
        if index == 0:
            return tool_round("working_notes_update", {"notes": "the build is green"})
        if prompt == "forget" and request.messages[-1]["content"][0]["type"] == "text":
            return tool_round("working_notes_clear", {}, call_id="toolu_2")
        return text_round("ok")

    model = ProgramModel(program)
    async with running_worker(settings, model):
        first = await submit(turns, "remember it")
        events = await wait_terminal(redis, keys, "u1", "s1", first)
        notes_events = [e for e in events if isinstance(e, WorkingNotes)]
        assert [(e.action, e.bytes, e.persisted) for e in notes_events] == [
            ("update", len("the build is green"), True)
        ]
        # Round 1 did not have it; round 2 of the same turn did.
        assert WORKING_NOTES_FOLD not in model.requests[0].system
        assert model.requests[1].system.endswith(working_notes_block("the build is green") or "")
        assert model.requests[1].system == resolve_system(
            "You are terse.", "the build is green", None
        )
        # The tool_use and its tool_result went back to the model in round 2.
        tool_result = model.requests[1].messages[-1]["content"][0]
        assert tool_result["type"] == "tool_result" and tool_result["tool_use_id"] == "toolu_1"

        second = await submit(turns, "and now?")
        await wait_terminal(redis, keys, "u1", "s1", second)
        assert "the build is green" in model.requests[2].system

        third = await submit(turns, "forget")
        events = await wait_terminal(redis, keys, "u1", "s1", third)
        results = [e for e in events if isinstance(e, ToolResult)]
        assert [r.output for r in results] == [NOTES_CLEARED]
        assert WORKING_NOTES_FOLD not in model.requests[-1].system
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes is None


async def test_text_deltas_are_coalesced(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    text = "token " * 400  # 2400 bytes in 400 one-token chunks, delivered at once

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        chunks: list[TextChunk | RoundResult] = [TextChunk("token ") for _ in range(400)]
        chunks.append(RoundResult("end_turn", [{"type": "text", "text": text}], [], UsageCounts()))
        return chunks

    async with running_worker(settings, ProgramModel(program)):
        tid = await submit(turns, "talk")
        events = await wait_terminal(redis, keys, "u1", "s1", tid)
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert "".join(d.text for d in deltas) == text
    assert len(deltas) <= 6  # ~512 bytes each, not one XADD per token
    assert all(len(d.text.encode()) >= 512 for d in deltas[:-1])


async def test_cancel_mid_stream_closes_the_model_stream_and_keeps_notes(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    long_round = [TextChunk("word ") for _ in range(2000)]
    long_round.append(RoundResult("end_turn", [{"type": "text", "text": "x"}], [], UsageCounts()))

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        if index == 0:
            return tool_round("working_notes_update", {"notes": "keep this"})
        return long_round

    model = ProgramModel(program, delay_s=0.01)
    async with running_worker(settings, model):
        tid = await submit(turns, "go")

        async def streaming() -> bool:
            events = await turn_events(redis, keys, "u1", "s1", tid)
            return any(isinstance(e, TextDelta) and e.round == 2 for e in events)

        await wait_until(streaming)
        await turns.request_cancel("u1", "s1", tid)
        # The model would stream for 20 s more; the cancel ends the turn mid-stream.
        # (Its latency — the 250 ms target — is measured by benchmarks/bench_turns.py.)
        events = await wait_terminal(redis, keys, "u1", "s1", tid, within=5)
        assert types_of(events)[-1] == "turn.cancelled"
        streamed = "".join(e.text for e in events if isinstance(e, TextDelta) and e.round == 2)
        assert 0 < len(streamed) < len("word ") * 2000
        await wait_until(lambda: no_pending(redis, keys))
    assert model.closed_streams == 2  # the cancelled stream was closed
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes == "keep this"
    assert envelope.meta.turnStatus == "cancelled"
    record = await turns.get("u1", "s1", tid)
    assert record is not None and record.status == "cancelled"


async def test_wall_clock_times_the_turn_out_and_keeps_notes(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, turn_wall_clock_ms=400)
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    slow = [TextChunk(".") for _ in range(1000)]

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        if index == 0:
            return tool_round("working_notes_update", {"notes": "noted before the clock ran out"})
        return slow

    async with running_worker(settings, ProgramModel(program, delay_s=0.01)):
        tid = await submit(turns, "go")
        events = await wait_terminal(redis, keys, "u1", "s1", tid)
    assert types_of(events)[-1] == "turn.timed_out"
    assert sum(1 for e in types_of(events) if e.startswith("turn.") and e != "turn.queued") == 2
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes == "noted before the clock ran out"
    record = await turns.get("u1", "s1", tid)
    assert record is not None and (record.status, record.reason) == ("timed_out", "wall_clock")


async def test_the_round_cap_fails_the_turn(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        return tool_round("working_notes_get", {}, call_id=f"toolu_{index}")

    model = ProgramModel(program)
    async with running_worker(settings, model):
        tid = await submit(turns, "loop forever")
        events = await wait_terminal(redis, keys, "u1", "s1", tid)
    last = events[-1]
    assert isinstance(last, TurnFailed) and last.reason == "max_rounds"
    assert len(model.requests) == caps.MAX_MODEL_ROUNDS
    assert await redis.llen(keys.messages("u1", "s1")) == 1 + 2 * caps.MAX_MODEL_ROUNDS


async def test_model_and_engine_failures_end_the_turn_not_the_worker(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        if index == 0:
            raise ModelError("overloaded", "the API stayed overloaded after 4 retries")
        if index == 1:
            raise RuntimeError("boom")
        if index == 2:
            return [TextChunk("a stream that never says how it ended")]
        return text_round("fine again")

    async with running_worker(settings, ProgramModel(program)) as worker:
        outcomes = []
        for message in ("one", "two", "three", "four"):
            tid = await submit(turns, message)
            events = await wait_terminal(redis, keys, "u1", "s1", tid)
            outcomes.append(events[-1])
        assert worker.running
    first, second, third, fourth = outcomes
    assert isinstance(first, TurnFailed) and first.reason == "overloaded"
    assert first.message == "the API stayed overloaded after 4 retries"
    assert isinstance(second, TurnFailed) and second.reason == "internal"
    assert "boom" not in second.message  # no internals leak to clients
    assert isinstance(third, TurnFailed) and third.reason == "provider_error"
    assert isinstance(fourth, TurnCompleted)


async def test_working_notes_get_returns_the_whole_block_past_the_tool_result_cap(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    # 20 KiB of notes: over the generic 16 KiB tool-result cap, within the notes' 32 KiB.
    notes = "".join(f"line {i:05d} of the notes\n" for i in range(1024))[: 20 * 1024 - 1] + "."
    assert len(notes.encode()) == 20_480 > caps.TOOL_RESULT_MAX_BYTES
    await store.create("u1", "s1", Meta(workingNotes=notes))
    turns = TurnStore(redis, keys, settings)
    model = ProgramModel(rounds(tool_round("working_notes_get", {})))
    async with running_worker(settings, model):
        tid = await submit(turns, "read")
        events = await wait_terminal(redis, keys, "u1", "s1", tid)
    result = next(e for e in events if isinstance(e, ToolResult))
    assert not result.truncated
    sent = model.requests[1].messages[-1]["content"][0]["content"]
    assert sent == notes


async def test_enqueued_turns_run_one_at_a_time_in_order(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    slow = [TextChunk(f"{i} ") for i in range(10)]
    slow.append(RoundResult("end_turn", [{"type": "text", "text": "slow"}], [], UsageCounts()))

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        return slow

    async with running_worker(settings, ProgramModel(program, delay_s=0.01), concurrency=4):
        ids = [await submit(turns, f"m{i}", enqueue=True) for i in range(3)]
        for tid in ids:
            events = await wait_terminal(redis, keys, "u1", "s1", tid)
            assert isinstance(events[-1], TurnCompleted)
    # The session log is one stream: each turn's start (its overlay setting turnRunId)
    # comes after the previous turn's terminal event.
    order = []
    for event in await log_events(redis, keys, "u1", "s1"):
        if isinstance(event, EnvelopePatched) and "turnRunId" in event.set:
            order.append(("start", event.set["turnRunId"]))
        elif isinstance(event, TurnCompleted):
            order.append(("end", event.turnId))
    assert order == [(kind, tid) for tid in ids for kind in ("start", "end")]


def _id(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


async def test_usage_events_are_cumulative(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    model = ProgramModel(rounds(tool_round("working_notes_get", {}), text_round("done")))
    async with running_worker(settings, model):
        tid = await submit(turns, "x")
        events = await wait_terminal(redis, keys, "u1", "s1", tid)
    usage = [e for e in events if isinstance(e, Usage)]
    assert [(u.inputTokens, u.cacheReadTokens) for u in usage] == [(10, 3), (20, 3)]


async def test_cancel_before_start_and_terminal_entries_are_just_acked(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    tid = await submit(turns, "never mind")
    await turns.request_cancel("u1", "s1", tid)  # queued: cancelled at once
    model = ProgramModel(rounds())
    async with running_worker(settings, model):
        await wait_until(lambda: _no_pending_after_read(redis, keys))
    assert model.requests == []
    assert types_of(await turn_events(redis, keys, "u1", "s1", tid)) == [
        "turn.queued",
        "turn.cancelled",
    ]


async def _no_pending_after_read(redis: aioredis.Redis, keys: Keys) -> bool:
    groups = await redis.xinfo_groups(keys.work(0))
    group = next(g for g in groups if g["name"] == GROUP)
    return int(group["pending"]) == 0 and group["last-delivered-id"] != "0-0"


async def test_lost_session_mid_turn_ends_quietly(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    deleted = asyncio.Event()

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        if index == 0:
            await store.delete("u1", "s1")
            deleted.set()
            return tool_round("working_notes_update", {"notes": "orphan"})
        return text_round("x")

    async with running_worker(settings, ProgramModel(program)):
        await submit(turns, "x")
        await asyncio.wait_for(deleted.wait(), 10)
        await wait_until(lambda: no_pending(redis, keys))
    # Nothing of the deleted session was written back, or left behind.
    assert await redis.keys(f"{keys.prefix}:{{u1:s1}}*") == []


async def test_a_tool_input_naming_another_session_changes_nothing_there(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    await store.create("u2", "victim", Meta(workingNotes="the victim's own notes"))
    victim_log = await redis.xlen(keys.log("u2", "victim"))
    turns = TurnStore(redis, keys, settings)
    hostile = {"notes": "planted", "sessionId": "victim", "userId": "u2", "user": "u2"}
    model = ProgramModel(
        rounds(
            tool_round("working_notes_update", hostile),
            tool_round("working_notes_clear", {"sessionId": "victim", "userId": "u2"}),
        )
    )
    async with running_worker(settings, model):
        tid = await submit(turns, "attack")
        await wait_terminal(redis, keys, "u1", "s1", tid)
    victim = await store.read("u2", "victim")
    assert victim is not None and victim.meta.workingNotes == "the victim's own notes"
    assert await redis.xlen(keys.log("u2", "victim")) == victim_log
    victim_keys = set(await redis.keys(f"{keys.prefix}:{{u2:victim}}:*"))
    assert victim_keys == {keys.env("u2", "victim"), keys.log("u2", "victim")}
    notes = [
        e for e in await turn_events(redis, keys, "u1", "s1", tid) if isinstance(e, WorkingNotes)
    ]
    assert [(e.action, e.bytes) for e in notes] == [("update", len("planted")), ("clear", 0)]


@pytest.mark.parametrize("filled", ["before the turn", "while the round runs"])
async def test_notes_that_cannot_be_persisted_still_reach_the_next_round(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore, filled: str
) -> None:
    # Persona and skills fill the 1 MiB meta budget, so the overlay refuses the notes:
    # the tool at once, or (filled by a host write while the round runs, after the
    # worker's check) the round's commit, which then stores the round saying so.
    big = "p" * (caps.PERSONA_SNAPSHOT_MAX_BYTES - 64)
    full = Meta(personaSnapshot=big, attachedSkills=json.dumps(big))
    await store.create("u1", "s1", full if filled == "before the turn" else None)
    turns = TurnStore(redis, keys, settings)

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        if index > 0:
            return text_round("ok")
        if filled != "before the turn":
            env = await store.read("u1", "s1")
            assert env is not None
            await store.host_replace("u1", "s1", env.updatedAt + 1, full)
        return tool_round("working_notes_update", {"notes": "x" * 500})

    model = ProgramModel(program)
    async with running_worker(settings, model):
        tid = await submit(turns, "note it")
        events = await wait_terminal(redis, keys, "u1", "s1", tid)
    [result] = [e for e in events if isinstance(e, ToolResult)]
    assert result.output == "working notes updated in-turn; persistence unavailable"
    [notes] = [e for e in events if isinstance(e, WorkingNotes)]
    assert notes.persisted is False
    assert (working_notes_block("x" * 500) or "") in model.requests[1].system
    assert model.requests[1].messages[-1]["content"][0]["content"] == result.output
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes is None


async def test_pause_turn_continues_and_max_tokens_completes(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    model = ProgramModel(
        rounds(text_round("thinking…", stop="pause_turn"), text_round("cut off", stop="max_tokens"))
    )
    async with running_worker(settings, model):
        tid = await submit(turns, "long task")
        events = await wait_terminal(redis, keys, "u1", "s1", tid)
    last = events[-1]
    assert isinstance(last, TurnCompleted) and last.stopReason == "max_tokens"
    assert len(model.requests) == 2
    assert model.requests[1].messages[-1]["role"] == "assistant"  # the paused content resent


async def test_a_queued_turn_waits_without_blocking_other_sessions(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "a")
    await store.create("u1", "b")
    turns = TurnStore(redis, keys, settings)
    release = asyncio.Event()

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        if request.messages[-1]["content"][0].get("text") == "a1":
            await release.wait()
        return text_round("ok")

    # Two slots: a1 holds one; a2 waits for a1 without taking the other, so b1 runs.
    async with running_worker(settings, ProgramModel(program), concurrency=2):
        a1 = await submit(turns, "a1", session="a")
        a2 = await submit(turns, "a2", session="a", enqueue=True)
        b1 = await submit(turns, "b1", session="b")
        events = await wait_terminal(redis, keys, "u1", "b", b1)
        assert types_of(events)[-1] == "turn.completed"
        record = await turns.get("u1", "a", a2)
        assert record is not None and record.status == "queued"
        release.set()
        await wait_terminal(redis, keys, "u1", "a", a1)
        events = await wait_terminal(redis, keys, "u1", "a", a2)
        assert types_of(events)[-1] == "turn.completed"


async def test_turns_on_every_shard_are_consumed(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, shards=3)
    turns = TurnStore(redis, keys, settings)
    sessions = [f"s{i}" for i in range(8)]
    assert len({Keys.shard_for("u1", s, 3) for s in sessions}) == 3
    async with running_worker(settings, ProgramModel(rounds())):
        submitted = []
        for session in sessions:
            await store.create("u1", session)
            submitted.append((session, await submit(turns, "hi", session=session)))
        for session, tid in submitted:
            events = await wait_terminal(redis, keys, "u1", session, tid)
            assert types_of(events)[-1] == "turn.completed"


async def test_a_turn_that_lost_its_lease_writes_no_notes(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1", Meta(workingNotes="the new holder's notes"))
    turns = TurnStore(redis, keys, settings)

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        # The lease lapsed mid-round and another worker's attempt took it over.
        await redis.set(keys.lease("u1", "s1"), "another-worker/attempt")
        return tool_round("working_notes_update", {"notes": "stale write"})

    async with running_worker(settings, ProgramModel(program)) as worker:
        tid = await submit(turns, "remember something")

        async def abandoned() -> bool:
            value = worker.metrics.registry.get_sample_value(
                "turnbus_worker_abandoned_attempts_total"
            )
            return bool(value)

        await wait_until(abandoned)
        events = await turn_events(redis, keys, "u1", "s1", tid)
    assert not any(isinstance(e, WorkingNotes) for e in events)
    # Nothing after the round's start (the call goes out with its result, which the
    # lease refused): left for the lease holder, not ended here.
    assert types_of(events)[-1] == "round.started"
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes == "the new holder's notes"
    assert envelope.meta.turnStatus == "running"
    assert await redis.get(keys.lease("u1", "s1")) == "another-worker/attempt"


async def test_after_failed_turns_the_model_still_gets_alternating_roles(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        if index in (0, 2):  # "one" fails in round 1; "two" fails after a tool round
            raise ModelError("overloaded", "the API stayed overloaded")
        if index == 1:
            return tool_round("working_notes_get", {})
        return text_round("ok")

    model = ProgramModel(program)
    async with running_worker(settings, model):
        for message in ("one", "two", "three"):
            tid = await submit(turns, message)
            await wait_terminal(redis, keys, "u1", "s1", tid)
    messages = model.requests[-1].messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert [[b.get("text", b["type"]) for b in m["content"]] for m in messages] == [
        ["one", "two"],
        ["calling a tool", "tool_use"],
        ["tool_result", "three"],
    ]


async def _every_value(redis: aioredis.Redis, prefix: str) -> list[str]:
    """Every key and value under ``prefix``, whatever its type (streams included)."""
    out: list[str] = []
    async for key in redis.scan_iter(match=f"{prefix}:*"):
        out.append(key)
        kind = await redis.type(key)
        if kind == "string":
            out.append(str(await redis.get(key)))
        elif kind == "hash":
            out.extend(f"{k}={v}" for k, v in (await redis.hgetall(key)).items())
        elif kind == "list":
            out.extend(await redis.lrange(key, 0, -1))
        elif kind == "set":
            out.extend(await redis.smembers(key))
        elif kind == "zset":
            out.extend(await redis.zrange(key, 0, -1))
        elif kind == "stream":
            for _, fields in await redis.xrange(key):
                out.extend(f"{k}={v}" for k, v in fields.items())
        else:
            raise AssertionError(f"unexpected type {kind} of {key}")
    return out


async def test_a_cleared_note_leaves_no_copy_anywhere_in_redis(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    secret = "the deploy key is hunter2-0f3a9c"
    from_host = "the host wrote sk-live-77e1"
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    model = ProgramModel(
        rounds(
            tool_round("working_notes_update", {"notes": secret}, call_id="toolu_1"),
            tool_round("working_notes_get", {}, call_id="toolu_2"),
            tool_round("working_notes_clear", {}, call_id="toolu_3"),
        )
    )
    async with running_worker(settings, model):
        tid = await submit(turns, "keep something for later, then drop it")
        events = await wait_terminal(redis, keys, "u1", "s1", tid)
        assert types_of(events)[-1] == "turn.completed"
        # Within the turn the model saw the notes whole: the text lives in memory only.
        assert model.requests[2].messages[-1]["content"][0]["content"] == secret
        # A host's mirror write, cleared by the agent in a second turn.
        env = await store.read("u1", "s1")
        assert env is not None
        await store.host_replace("u1", "s1", env.updatedAt + 1, Meta(workingNotes=from_host))
        model.program = rounds(tool_round("working_notes_clear", {}, call_id="toolu_4"))
        model.requests.clear()
        tid2 = await submit(turns, "forget it")
        await wait_terminal(redis, keys, "u1", "s1", tid2)

    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes is None
    values = await _every_value(redis, keys.prefix)
    assert any(keys.log("u1", "s1") == v for v in values)  # the scan saw the session log
    for text in (secret, from_host):
        leaks = [v for v in values if text in v]
        assert leaks == [], leaks
    # What the log says instead: the size and digest of each write.
    digests = {
        e.sha256 for e in await log_events(redis, keys, "u1", "s1") if isinstance(e, WorkingNotes)
    }
    assert hashlib.sha256(secret.encode()).hexdigest() in digests
    patched = [
        e.notes
        for e in await log_events(redis, keys, "u1", "s1")
        if isinstance(e, EnvelopePatched) and e.notes is not None
    ]
    assert [(d.bytes, d.sha256) for d in patched] == [
        (len(t), hashlib.sha256(t.encode()).hexdigest()) for t in (secret, from_host)
    ]


def _thinking(text: str) -> dict[str, str]:
    return {"type": "thinking", "thinking": text, "signature": "sig-" + text[-1]}


async def test_thinking_serves_the_tool_loop_and_is_gone_when_the_turn_ends(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    first = _thinking("private chain of thought 1")
    redacted = {"type": "redacted_thinking", "data": "opaque-private-2"}
    gate = asyncio.Event()

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        if index == 0:
            round_ = tool_round("working_notes_get", {})
            result = round_[-1]
            assert isinstance(result, RoundResult)
            content = [first, redacted, *result.content]
            return [*round_[:-1], dataclasses.replace(result, content=content)]
        await gate.wait()
        done = text_round("done")[-1]
        assert isinstance(done, RoundResult)
        content = [_thinking("private chain of thought 3"), *done.content]
        return [TextChunk("done"), dataclasses.replace(done, content=content)]

    model = ProgramModel(program)
    async with running_worker(settings, model):
        tid = await submit(turns, "look it up")

        async def second_round() -> bool:
            return len(model.requests) == 2

        await wait_until(second_round)
        # Within the turn: the model gets its thinking back to continue the tool loop,
        # and the committed round keeps it (a resumed attempt needs it too).
        assert model.requests[1].messages[1]["content"][:2] == [first, redacted]
        stored = await redis.lrange(keys.messages("u1", "s1"), 0, -1)
        assert any("private chain of thought 1" in row for row in stored)
        gate.set()
        events = await wait_terminal(redis, keys, "u1", "s1", tid)
    assert types_of(events)[-1] == "turn.completed"
    # Past the turn: no thinking anywhere in Redis, and the history still alternates.
    values = await _every_value(redis, keys.prefix)
    assert [v for v in values if "private" in v] == []
    rows = [json.loads(r) for r in await redis.lrange(keys.messages("u1", "s1"), 0, -1)]
    assert [r["kind"] for r in rows] == ["prompt", "assistant", "tool_results", "assistant"]
    assert [b["type"] for b in rows[1]["content"]] == ["text", "tool_use"]
    assert [b["type"] for b in rows[3]["content"]] == ["text"]


async def test_a_turns_envelope_clock_stays_at_most_2_to_the_53_minus_1(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    safe_max = caps.UPDATED_AT_MAX
    await store.create("u1", "s1")
    # A clock one below the cap (a relic of an unchecked host clock).
    await redis.hset(keys.env("u1", "s1"), "updatedAt", str(safe_max - 1))
    turns = TurnStore(redis, keys, settings)
    async with running_worker(settings, ProgramModel(rounds(text_round("ok")))):
        tid = await submit(turns, "hi")
        await wait_terminal(redis, keys, "u1", "s1", tid)
    patched = [
        e for e in await log_events(redis, keys, "u1", "s1") if isinstance(e, EnvelopePatched)
    ]
    # The turn's start and its end both overlay the envelope: neither passes the cap.
    assert [e.updatedAt for e in patched[-2:]] == [safe_max, safe_max]
    assert await redis.hget(keys.env("u1", "s1"), "updatedAt") == str(safe_max)


async def test_a_turn_without_a_notes_call_leaves_the_notes_unset(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    async with running_worker(settings, ProgramModel(rounds(text_round("just an answer")))):
        tid = await submit(turns, "remember nothing, just answer")
        events = await wait_terminal(redis, keys, "u1", "s1", tid)
    assert types_of(events)[-1] == "turn.completed"
    assert not [e for e in events if isinstance(e, WorkingNotes)]
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes is None
    assert not await redis.hexists(keys.env("u1", "s1"), "workingNotes")
    patched = [
        e for e in await log_events(redis, keys, "u1", "s1") if isinstance(e, EnvelopePatched)
    ]
    assert all("workingNotes" not in e.keys for e in patched)


async def test_every_model_round_is_offered_the_notes_tools_and_the_allowed_tools_only(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1", Meta(allowedTools=json.dumps(["lookup", "fetch"])))
    turns = TurnStore(redis, keys, settings)
    model = ProgramModel(
        rounds(
            tool_round("working_notes_update", {"notes": "a"}),
            tool_round("working_notes_get", {}, call_id="toolu_2"),
            text_round("done"),
            text_round("second turn"),
        )
    )
    async with running_worker(settings, model, tools=sample_registry()):
        for message in ("first", "second"):
            await wait_terminal(redis, keys, "u1", "s1", await submit(turns, message))
    assert len(model.requests) == 4  # three rounds, then one
    for request in model.requests:
        # The notes tools always, then the allowed ones sorted: the same bytes each round.
        assert [tool["name"] for tool in request.tools] == [
            "working_notes_get",
            "working_notes_update",
            "working_notes_clear",
            "fetch",
            "lookup",
        ]


async def test_a_session_s_next_turn_here_starts_from_the_history_it_left_unless_changed(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    model = ProgramModel(rounds())
    messages = keys.messages("u1", "s1")

    def texts(request: ModelRequest) -> list[str]:
        return [b["text"] for m in request.messages for b in m["content"] if b["type"] == "text"]

    async with running_worker(settings, model) as worker:
        for n in (1, 2):
            await wait_terminal(redis, keys, "u1", "s1", await submit(turns, f"turn {n}"))
        assert worker._engine is not None and len(worker._engine.histories) == 1
        assert texts(model.requests[1]) == ["turn 1", "done", "turn 2"]
        # Another writer's rows: one more, then the same count with another last row.
        row = {"role": "user", "content": [{"type": "text", "text": "elsewhere"}], "round": 0}
        await redis.rpush(messages, json.dumps({**row, "turnId": "t_x", "kind": "prompt"}))
        await wait_terminal(redis, keys, "u1", "s1", await submit(turns, "turn 3"))
        assert texts(model.requests[2])[-2:] == ["elsewhere", "turn 3"]
        last = json.loads(await redis.lindex(messages, -1))
        await redis.lset(messages, -1, json.dumps({**last, "content": "changed"}))
        await wait_terminal(redis, keys, "u1", "s1", await submit(turns, "turn 4"))
        assert texts(model.requests[3])[-2:] == ["changed", "turn 4"]


async def test_a_note_is_in_the_envelope_once_its_round_is_committed(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    # The round's commit stores the note: by the next model round it is in the envelope,
    # its envelope.patched and working_notes on the session log with the commit's clock.
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    seen: list[tuple[object, list[object]]] = []

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        if index == 0:
            return tool_round("working_notes_update", {"notes": "the build is green"})
        seen.append((await store.read("u1", "s1"), await log_events(redis, keys, "u1", "s1")))
        return text_round("ok")

    async with running_worker(settings, ProgramModel(program)):
        tid = await submit(turns, "remember it")
        events = await wait_terminal(redis, keys, "u1", "s1", tid)
    [(envelope, logged)] = seen
    assert isinstance(envelope, Envelope) and envelope.meta.workingNotes == "the build is green"
    patched, noted = logged[-2:]
    assert isinstance(patched, EnvelopePatched) and isinstance(noted, WorkingNotes)
    assert patched.keys == ["workingNotes"] and patched.notes is not None
    assert patched.notes.sha256 == hashlib.sha256(b"the build is green").hexdigest()
    [on_turn] = [e for e in events if isinstance(e, WorkingNotes)]
    assert on_turn == noted and on_turn.persisted
    assert on_turn.updatedAt == patched.updatedAt == envelope.updatedAt


async def test_a_note_written_in_the_last_round_is_stored_before_the_end(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    last = tool_round("working_notes_update", {"notes": "said in the last round"})
    result = last[-1]
    assert isinstance(result, RoundResult)
    last[-1] = dataclasses.replace(result, stop_reason="max_tokens")  # no round follows
    async with running_worker(settings, ProgramModel(rounds(last))):
        tid = await submit(turns, "note and stop")
        events = await wait_terminal(redis, keys, "u1", "s1", tid)
    assert types_of(events)[-3:] == ["tool.result", "usage", "turn.completed"]
    [noted] = [e for e in events if isinstance(e, WorkingNotes)]
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes == "said in the last round"
    assert noted.persisted and noted.updatedAt is not None and noted.updatedAt > 0
    assert noted in await log_events(redis, keys, "u1", "s1")

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from harness.redis_server import free_port
from tests.worker_kit import log_events, turn_events
from turnbus.shared import caps
from turnbus.shared.envelope import EnvelopeStore, LeaseNotHeld
from turnbus.shared.events import WorkingNotes
from turnbus.shared.keys import Keys
from turnbus.shared.meta import Meta
from turnbus.shared.settings import Settings
from turnbus.worker.tools import (
    NOTES_CLEARED,
    NOTES_EMPTY,
    NOTES_TOOL_NAMES,
    NOTES_TOOL_SPECS,
    NOTES_UNAVAILABLE,
    NOTES_UPDATED_NOT_PERSISTED,
    NotesTools,
)


def make_tools(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore, session: str = "s1"
) -> NotesTools:
    return NotesTools(redis, keys, settings, store, user="u1", session=session, turn_id="t_1")


def test_seed_strings_are_verbatim() -> None:
    assert NOTES_EMPTY == "(empty — no working notes for this session)"
    assert NOTES_UNAVAILABLE == "(unavailable)"
    assert NOTES_CLEARED == "working notes cleared — this is a new mind for this session"
    assert NOTES_UPDATED_NOT_PERSISTED == "working notes updated in-turn; persistence unavailable"
    assert {"working_notes_get", "working_notes_update", "working_notes_clear"} == NOTES_TOOL_NAMES
    update = next(s for s in NOTES_TOOL_SPECS if s["name"] == "working_notes_update")
    assert "Never write secrets" in update["description"]
    assert update["input_schema"]["required"] == ["notes"]


async def test_update_get_clear_round_trip(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    tools = make_tools(redis, keys, settings, store)
    assert (await tools.execute("working_notes_get", {})).output == NOTES_EMPTY

    out = await tools.execute("working_notes_update", {"notes": "  the build is green  "})
    assert out.output == (
        "working notes updated (18 bytes) — this block is folded into every future turn "
        "of this session"
    )
    assert not out.is_error
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes == "the build is green"
    written_at = envelope.updatedAt
    assert (await tools.execute("working_notes_get", {})).output == "the build is green"

    out = await tools.execute("working_notes_clear", {})
    assert out.output == NOTES_CLEARED
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes is None

    # One working_notes event per write, on the turn stream and the session log alike.
    on_turn = [
        e for e in await turn_events(redis, keys, "u1", "s1", "t_1") if isinstance(e, WorkingNotes)
    ]
    on_log = [e for e in await log_events(redis, keys, "u1", "s1") if isinstance(e, WorkingNotes)]
    assert on_turn == on_log
    assert [(e.action, e.bytes, e.persisted, e.turnId) for e in on_turn] == [
        ("update", 18, True, "t_1"),
        ("clear", 0, True, "t_1"),
    ]
    assert on_turn[0].sha256 == hashlib.sha256(b"the build is green").hexdigest()
    # The write's own clock (the log's entry is appended by the write itself).
    assert on_turn[0].updatedAt == written_at


async def test_update_with_empty_string_clears(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1", Meta(workingNotes="old"))
    tools = make_tools(redis, keys, settings, store)
    assert (await tools.execute("working_notes_update", {"notes": "   "})).output == NOTES_CLEARED
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes is None


async def test_a_bom_only_update_clears_and_nel_is_kept(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1", Meta(workingNotes="old"))
    tools = make_tools(redis, keys, settings, store)
    out = await tools.execute("working_notes_update", {"notes": "\ufeff\n"})
    assert out.output == NOTES_CLEARED
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes is None
    await tools.execute("working_notes_update", {"notes": "\ufeff\u0085kept\u001f "})
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes == "\u0085kept\u001f"


async def test_over_cap_update_is_refused_and_changes_nothing(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1", Meta(workingNotes="keep me"))
    tools = make_tools(redis, keys, settings, store)
    before = await redis.xlen(keys.log("u1", "s1"))
    big = "é" * (caps.WORKING_NOTES_MAX_BYTES // 2 + 1)  # 2 bytes each: 2 bytes over
    out = await tools.execute("working_notes_update", {"notes": big})
    assert out.is_error
    assert out.output.startswith("ERROR working_notes_update: notes exceed the 32 KiB cap")
    assert f"{caps.WORKING_NOTES_MAX_BYTES + 2} bytes asked" in out.output
    assert f"the cap is {caps.WORKING_NOTES_MAX_BYTES} bytes" in out.output
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes == "keep me"
    assert await redis.xlen(keys.log("u1", "s1")) == before
    # Exactly at the cap is accepted, never truncated.
    exact = "x" * caps.WORKING_NOTES_MAX_BYTES
    assert not (await tools.execute("working_notes_update", {"notes": exact})).is_error
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes == exact


async def test_non_text_notes_are_an_error(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    tools = make_tools(redis, keys, settings, store)
    for bad in ({}, {"notes": 42}, {"notes": ["a"]}, {"notes": "\ud800"}):
        out = await tools.execute("working_notes_update", bad)
        assert out.is_error and out.output.startswith("ERROR working_notes_update")
    out = await tools.execute("rm_rf", {})
    assert out.is_error and "unknown tool" in out.output


async def test_persistence_unavailable_keeps_notes_in_turn(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    # No envelope: the overlay cannot persist; the tool says so honestly.
    tools = make_tools(redis, keys, settings, store, session="gone")
    out = await tools.execute("working_notes_update", {"notes": "in-turn only"})
    assert out.output == NOTES_UPDATED_NOT_PERSISTED
    assert tools.has_in_turn_notes and tools.in_turn_notes == "in-turn only"
    assert (await tools.execute("working_notes_get", {})).output == "in-turn only"
    events = [
        e
        for e in await turn_events(redis, keys, "u1", "gone", "t_1")
        if isinstance(e, WorkingNotes)
    ]
    assert [(e.action, e.persisted) for e in events] == [("update", False)]


async def test_writes_are_fenced_by_the_session_lease(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1", Meta(workingNotes="written by the lease holder"))
    log_before = await redis.xlen(keys.log("u1", "s1"))
    tools = NotesTools(
        redis, keys, settings, store, user="u1", session="s1", turn_id="t_1", lease_token="mine"
    )
    # No lease, then a lease another attempt took over: nothing is written, no event.
    for holder in (None, "theirs"):
        if holder is not None:
            await redis.set(keys.lease("u1", "s1"), holder)
        for name, tool_input in (
            ("working_notes_update", {"notes": "from a worker that lost the turn"}),
            ("working_notes_clear", {}),
        ):
            with pytest.raises(LeaseNotHeld):
                await tools.execute(name, tool_input)
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes == "written by the lease holder"
    assert await redis.xlen(keys.log("u1", "s1")) == log_before
    assert not await redis.exists(keys.turn_events("u1", "s1", "t_1"))
    # While the lease is held by the attempt's token, the write lands.
    await redis.set(keys.lease("u1", "s1"), "mine")
    out = await tools.execute("working_notes_update", {"notes": "from the holder"})
    assert out.output.startswith("working notes updated (15 bytes)")
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes == "from the holder"


async def test_a_cancel_during_a_write_still_announces_the_stored_note(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    await store.create("u1", "s1")
    tools = make_tools(redis, keys, settings, store)
    stored, gate = asyncio.Event(), asyncio.Event()
    overlay = store.worker_overlay

    async def overlay_then_wait(*args: Any, **kwargs: Any) -> int:
        clock = await overlay(*args, **kwargs)
        stored.set()
        await gate.wait()
        return clock

    store.worker_overlay = overlay_then_wait  # type: ignore[method-assign]
    task = asyncio.create_task(tools.execute("working_notes_update", {"notes": "kept"}))
    await asyncio.wait_for(stored.wait(), 5)
    task.cancel()  # the note is stored; its event is not written yet
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    events = [
        e for e in await turn_events(redis, keys, "u1", "s1", "t_1") if isinstance(e, WorkingNotes)
    ]
    assert [(e.action, e.bytes, e.persisted) for e in events] == [("update", 4, True)]
    assert events == [
        e for e in await log_events(redis, keys, "u1", "s1") if isinstance(e, WorkingNotes)
    ]


async def test_store_down_is_unavailable_never_a_crash(keys: Keys, settings: Settings) -> None:
    dead = aioredis.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    try:
        store = EnvelopeStore(dead, keys)
        tools = NotesTools(dead, keys, settings, store, user="u1", session="s1", turn_id="t_1")
        assert (await tools.execute("working_notes_get", {})).output == NOTES_UNAVAILABLE
        out = await tools.execute("working_notes_update", {"notes": "x"})
        assert out.output == NOTES_UPDATED_NOT_PERSISTED
    finally:
        await dead.aclose()


@pytest.mark.parametrize(
    "tool_input",
    [
        {"notes": "mine", "sessionId": "victim", "userId": "u2"},
        {"notes": "mine", "session": "victim", "user": "u2", "turnId": "t_other"},
    ],
)
async def test_ids_in_the_tool_input_are_ignored(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    tool_input: dict[str, str],
) -> None:
    await store.create("u1", "s1")
    await store.create("u2", "victim", Meta(workingNotes="the victim's notes"))
    victim_log = await redis.xlen(keys.log("u2", "victim"))
    tools = make_tools(redis, keys, settings, store)
    await tools.execute("working_notes_update", tool_input)
    await tools.execute("working_notes_clear", {"sessionId": "victim", "userId": "u2"})
    victim = await store.read("u2", "victim")
    assert victim is not None and victim.meta.workingNotes == "the victim's notes"
    assert await redis.xlen(keys.log("u2", "victim")) == victim_log
    assert not await redis.exists(keys.turn_events("u2", "victim", "t_1"))
    own = await store.read("u1", "s1")
    assert own is not None and own.meta.workingNotes is None  # updated, then cleared

from __future__ import annotations

import logging

import msgspec
import pytest

from turnbus.shared.events import (
    EnvelopePatched,
    Event,
    NotesDigest,
    Resync,
    RoundStarted,
    TextDelta,
    ToolCall,
    ToolResult,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnQueued,
    TurnStarted,
    TurnTimedOut,
    UnknownEvent,
    Usage,
    WorkingNotes,
    decode_event,
    encode_event,
    event_type,
    is_terminal,
)

SAMPLES: list[Event] = [
    TurnQueued(turnId="t1", sessionId="s1", at=1),
    TurnStarted(turnId="t1", attempt=2, worker="w1", at=2),
    RoundStarted(turnId="t1", round=1, at=3),
    TextDelta(turnId="t1", round=1, text="héllo"),
    ToolCall(turnId="t1", round=1, callId="c1", name="working_notes_update", input={"notes": "x"}),
    ToolResult(turnId="t1", round=1, callId="c1", name="working_notes_update", output="ok"),
    WorkingNotes(action="update", bytes=1, sha256="ab", persisted=True, updatedAt=5, turnId="t1"),
    Usage(turnId="t1", inputTokens=10, outputTokens=2, cacheReadTokens=3, cacheWriteTokens=4),
    TurnCompleted(turnId="t1", at=9),
    TurnFailed(turnId="t1", reason="max_rounds", message="24 rounds", at=9),
    TurnCancelled(turnId="t1", at=9),
    TurnTimedOut(turnId="t1", at=9),
    EnvelopePatched(
        origin="worker",
        updatedAt=7,
        keys=["workingNotes", "statusSlot"],
        set={"statusSlot": "x"},
        notes=NotesDigest(bytes=1, sha256="ab"),
    ),
    Resync(requested="1-0", earliest="5-0"),
]


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: event_type(e))
def test_every_event_round_trips(event: Event) -> None:
    raw = encode_event(event)
    assert msgspec.json.decode(raw)["type"] == event_type(event)
    assert decode_event(raw) == event
    assert decode_event(raw.decode()) == event


def test_exactly_four_terminal_types() -> None:
    terminal = {event_type(e) for e in SAMPLES if is_terminal(e)}
    assert terminal == {"turn.completed", "turn.failed", "turn.cancelled", "turn.timed_out"}


def test_unknown_type_is_reported_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        event = decode_event(b'{"type": "turn.teleported", "turnId": "t1"}')
    assert isinstance(event, UnknownEvent)
    assert event.type == "turn.teleported"
    assert event_type(event) == "turn.teleported"
    assert not is_terminal(event)
    assert "turn.teleported" in caplog.text


def test_garbage_is_reported_not_raised() -> None:
    event = decode_event(b"not json at all")
    assert isinstance(event, UnknownEvent)
    assert event.type == "?"


def test_newer_writers_extra_fields_are_tolerated() -> None:
    event = decode_event(
        b'{"type": "text.delta", "turnId": "t", "round": 1, "text": "a", "new": 1}'
    )
    assert event == TextDelta(turnId="t", round=1, text="a")

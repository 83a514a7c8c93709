"""Turn and session events: a msgspec tagged union on ``type``.

Each stream entry stores one event as JSON in its ``data`` field; the entry id is
the SSE id. Readers tolerate unknown fields (old readers survive new writers) and
report an unknown ``type`` as :class:`UnknownEvent` rather than failing.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Literal

import msgspec

from turnbus.shared.contracts import (
    FAILURE_REASONS,
    TERMINAL_STATUSES,
    TIMEOUT_REASONS,
    CancelReason,
    FailureReason,
    TimeoutReason,
)
from turnbus.shared.records import PendingCall

__all__ = [
    "TERMINAL_TYPES",
    "EnvelopePatched",
    "Event",
    "NotesDigest",
    "Resync",
    "RoundStarted",
    "RoundWaiting",
    "TextDelta",
    "ToolCall",
    "ToolResult",
    "TurnCancelled",
    "TurnCompleted",
    "TurnFailed",
    "TurnQueued",
    "TurnRequiresAction",
    "TurnStarted",
    "TurnTimedOut",
    "UnknownEvent",
    "Usage",
    "WorkingNotes",
    "decode_event",
    "encode_event",
    "event_type",
    "is_terminal",
    "notes_digest",
    "peek_type",
    "terminal_event",
]

log = logging.getLogger(__name__)


def notes_digest(notes: str) -> NotesDigest:
    """The size and SHA-256 of a notes value, as the session log carries it."""
    raw = notes.encode("utf-8", "surrogatepass")
    return NotesDigest(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())


class _Event(msgspec.Struct, tag_field="type", kw_only=True):
    pass


class TurnQueued(_Event, tag="turn.queued"):
    turnId: str
    sessionId: str
    at: int


class TurnStarted(_Event, tag="turn.started"):
    """An attempt starts. ``after`` says why a later attempt runs: ``answered`` (its
    caller answered a pause: the turn goes on at its next round, nothing is played
    again); ``redis_lost`` (its worker could not reach Redis for ``redisLostMs``, long
    enough to stop the attempt before); ``""``: not known (a worker lost, most likely).
    An attempt that is not ``answered`` plays again the round that was streaming."""

    turnId: str
    attempt: int = 1
    worker: str = ""
    at: int = 0
    after: str = ""
    redisLostMs: int = 0


class RoundStarted(_Event, tag="round.started"):
    turnId: str
    round: int
    at: int = 0


class RoundWaiting(_Event, tag="round.waiting"):
    """The round is held back by the model's rate limit (``reason``: ``rate_limited`` or
    ``overloaded``), about ``waitMs`` more; it streams when the key is let through again,
    or the turn fails with that reason after ``TURNBUS_MODEL_WAIT_S``."""

    turnId: str
    round: int
    reason: str
    waitMs: int = 0
    at: int = 0


class TextDelta(_Event, tag="text.delta"):
    turnId: str
    round: int
    text: str


class ToolCall(_Event, tag="tool.call"):
    turnId: str
    round: int
    callId: str
    name: str
    input: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolResult(_Event, tag="tool.result"):
    turnId: str
    round: int
    callId: str
    name: str
    output: str
    isError: bool = False
    truncated: bool = False
    # From the call's start to its result (0 for a result that did not run the tool).
    durationMs: int = 0


class WorkingNotes(_Event, tag="working_notes"):
    """A notes write. It carries the size and digest of the notes, never their text:
    the session log outlives a clear, and a cleared note must leave no copy behind."""

    action: Literal["update", "clear"]
    bytes: int
    sha256: str
    persisted: bool
    updatedAt: int | None = None
    turnId: str | None = None


class Usage(_Event, tag="usage"):
    turnId: str
    inputTokens: int = 0
    outputTokens: int = 0
    cacheReadTokens: int = 0
    cacheWriteTokens: int = 0


class TurnRequiresAction(_Event, tag="turn.requires_action"):
    """The turn pauses for its caller: every call in ``calls`` waits for its answer
    (``POST …/turns/{tid}/actions``) until ``expiresAt`` (ms); the turn holds no worker
    meanwhile, and resumes at the next round once answered."""

    turnId: str
    round: int
    calls: list[PendingCall]
    expiresAt: int = 0
    at: int = 0


class TurnCompleted(_Event, tag="turn.completed"):
    turnId: str
    stopReason: str = "end_turn"
    at: int = 0


class TurnFailed(_Event, tag="turn.failed"):
    """``reason``: one of :data:`~turnbus.shared.contracts.FailureReason`; ``message``,
    a sentence for a person."""

    turnId: str
    reason: FailureReason
    message: str = ""
    at: int = 0


class TurnCancelled(_Event, tag="turn.cancelled", omit_defaults=True):
    """The turn was cancelled. An interrupt (a submit with ``multitask=interrupt``) says
    so: ``reason`` ``interrupted`` and ``by``, the id of the turn that interrupted it."""

    turnId: str
    at: int = 0
    reason: CancelReason | None = None
    by: str | None = None


class TurnTimedOut(_Event, tag="turn.timed_out"):
    """``reason``: ``wall_clock`` (the turn ran too long) or ``action_timeout`` (its
    caller did not answer a pause in time)."""

    turnId: str
    at: int = 0
    reason: TimeoutReason | Literal[""] = ""


class NotesDigest(msgspec.Struct):
    """What the session log says about a notes value: its UTF-8 size and SHA-256."""

    bytes: int
    sha256: str


class EnvelopePatched(_Event, tag="envelope.patched"):
    """One applied envelope write, appended by the same Lua call that applied it."""

    origin: Literal["create", "host", "worker", "submit"]
    updatedAt: int
    sessionId: str = ""
    keys: list[str] = msgspec.field(default_factory=list)
    # Every changed key's new value, except ``workingNotes``: its size and digest are
    # in ``notes`` (the text never enters the log).
    set: dict[str, str] = msgspec.field(default_factory=dict)
    unset: list[str] = msgspec.field(default_factory=list)
    notes: NotesDigest | None = None


class Resync(_Event, tag="resync"):
    """Sent by the gateway when a client's cursor is older than what the stream holds."""

    requested: str
    earliest: str | None = None


Event = (
    TurnQueued
    | TurnStarted
    | RoundStarted
    | RoundWaiting
    | TextDelta
    | ToolCall
    | ToolResult
    | WorkingNotes
    | Usage
    | TurnRequiresAction
    | TurnCompleted
    | TurnFailed
    | TurnCancelled
    | TurnTimedOut
    | EnvelopePatched
    | Resync
)

# A turn that ends with status ``s`` gets exactly one terminal event, of type ``turn.<s>``.
TERMINAL_TYPES = frozenset(f"turn.{status}" for status in TERMINAL_STATUSES)


def terminal_event(
    turn_id: str,
    status: str,
    *,
    at: int,
    reason: str | None = None,
    message: str | None = None,
    stop_reason: str | None = None,
    by: str | None = None,
) -> TurnCompleted | TurnFailed | TurnCancelled | TurnTimedOut:
    """The terminal event of a turn that ended with ``status`` (any status but
    ``completed``, ``cancelled`` or ``timed_out`` is a failure, ``internal`` by default;
    a reason that is not one of its status's is written as that default)."""
    if status == "completed":
        return TurnCompleted(turnId=turn_id, stopReason=stop_reason or "end_turn", at=at)
    if status == "cancelled":
        if by is not None:
            return TurnCancelled(turnId=turn_id, at=at, reason="interrupted", by=by)
        return TurnCancelled(turnId=turn_id, at=at)
    if status == "timed_out":
        timeout = reason if reason in TIMEOUT_REASONS else ""
        return TurnTimedOut(turnId=turn_id, at=at, reason=timeout)
    failure = reason if reason in FAILURE_REASONS else "internal"
    if reason is not None and failure != reason:
        log.warning(
            "turn %s failed with an unlisted reason %r: written as internal", turn_id, reason
        )
    return TurnFailed(turnId=turn_id, reason=failure, message=message or "", at=at)


class UnknownEvent(msgspec.Struct, frozen=True):
    """An entry this reader cannot decode: kept raw so it can be passed on or skipped."""

    type: str
    raw: bytes
    error: str


_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)


class _TypeOnly(msgspec.Struct):
    type: str | None = None


_type_decoder = msgspec.json.Decoder(_TypeOnly)
_TYPE_FIRST = '{"type":"'


def peek_type(data: bytes | str, default: str) -> str:
    """An entry's ``type`` without decoding the event, ``default`` when it has none (or
    is not JSON). Every writer puts the type first (``{"type":"text.delta",...}``): from
    ``str`` data it is read off; anything else is decoded for that one field."""
    if isinstance(data, str) and data.startswith(_TYPE_FIRST):
        end = data.find('"', 9)
        if end > 9 and "\\" not in data[9:end]:
            return data[9:end]
    try:
        kind = _type_decoder.decode(data).type
    except msgspec.DecodeError:
        return default
    return default if kind is None else kind


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def event_type(event: Event | UnknownEvent) -> str:
    if isinstance(event, UnknownEvent):
        return event.type
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def decode_event(raw: bytes | str) -> Event | UnknownEvent:
    """Decode one stream entry's ``data``; an undecodable entry comes back as UnknownEvent."""
    data = raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        kind = peek_type(data, "?")
        log.warning("undecodable event of type %r: %s", kind, exc)
        return UnknownEvent(type=kind, raw=data, error=str(exc))


def is_terminal(event: Event | UnknownEvent) -> bool:
    return event_type(event) in TERMINAL_TYPES

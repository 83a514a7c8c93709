"""The records the API answers with, as plain structs.

A turn record (``GET /v1/sessions/{id}/turns/{tid}``), a row and a page of the sessions
list, and the clock and ids they carry. Nothing here talks to Redis: the Python client
imports this module, and the stores that read and write these records
(:mod:`turnbus.shared.turns`, :mod:`turnbus.shared.session_index`) stand on it.
"""

from __future__ import annotations

import os
import time
from typing import Annotated, Any

import msgspec

from turnbus.shared.contracts import (
    END_REASONS,
    TERMINAL_STATUSES,
    TURN_STATUSES,
    ActiveStatus,
    EndReason,
    TurnStatus,
)

__all__ = [
    "TERMINAL_STATUSES",
    "TURN_STATUSES",
    "ActiveTurn",
    "ClientTool",
    "EndReason",
    "PendingCall",
    "SessionPage",
    "SessionSummary",
    "TurnRecord",
    "TurnStatus",
    "TurnUsage",
    "TurnWebhook",
    "WebhookAttempt",
    "new_session_id",
    "new_turn_id",
    "now_ms",
    "record_fields",
    "record_from_hash",
]


class TurnUsage(msgspec.Struct):
    """The turn's token counts so far (summed over its rounds and attempts)."""

    inputTokens: int = 0
    outputTokens: int = 0
    cacheReadTokens: int = 0
    cacheWriteTokens: int = 0


class WebhookAttempt(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One POST of a turn's webhook: when (ms), how long it took, and the receiver's
    HTTP status or the error that stood in for one."""

    at: int
    durationMs: int
    status: int | None = None
    error: str | None = None


class TurnWebhook(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The turn's webhook and its delivery (docs/operations.md, "Webhooks").

    ``id`` (the ``webhook-id`` header, the same on every retry) and ``state`` appear
    with the terminal event: ``pending`` until a POST is answered 2xx (``delivered``) or
    the retry window closes (``failed``). ``attempts``: the latest POSTs, oldest first."""

    url: str
    id: str | None = None
    state: str | None = None
    attempts: list[WebhookAttempt] = msgspec.field(default_factory=list)
    nextAttemptAt: int | None = None


class ClientTool(msgspec.Struct, forbid_unknown_fields=True):
    """A tool the caller runs, declared with the submit (``clientTools``)."""

    name: str
    description: str = ""
    inputSchema: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object"})


class PendingCall(msgspec.Struct, kw_only=True):
    """A call a paused turn waits on (``turn.requires_action``'s ``calls``)."""

    callId: str
    name: str
    input: dict[str, Any]
    kind: str = "client"


class TurnRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The turn record, as ``GET /v1/sessions/{id}/turns/{tid}`` answers it."""

    turnId: str
    sessionId: str
    userId: str
    status: TurnStatus
    message: str
    createdAt: int
    multitask: str = "reject"
    shard: int = 0
    attempt: int = 0
    startedAt: int | None = None
    endedAt: int | None = None
    worker: str | None = None
    reason: EndReason | None = None
    error: str | None = None
    stopReason: str | None = None
    usage: TurnUsage | None = None
    cancelRequested: bool = False
    # The turn that interrupted this one (a submit with ``multitask=interrupt``), set when
    # it is submitted; the end then gives ``reason`` ``interrupted``.
    by: str | None = None
    # The submitting token's ``tools`` claim (a JSON array of names in a string): the
    # most this turn's rounds are offered beyond the notes tools.
    allowedTools: str | None = None
    # The caller's tools (the submit's ``clientTools``), offered beside the session's.
    clientTools: list[ClientTool] | None = None
    # The pause: the calls it waits on, its start, the ms it may last (the submit's
    # ``actionTimeoutS``, capped by the setting) and when it ends; the ms the turn spent
    # waiting (its wall clock counts running time only) and how many answers resumed it.
    pendingCalls: list[PendingCall] | None = None
    pausedAt: int | None = None
    actionTimeoutMs: int | None = None
    actionDeadline: int | None = None
    waitedMs: int = 0
    resumes: int = 0
    # The per-user quota counters this turn feeds (``active``, ``tokens``, space
    # separated): its end gives back its running or queued count; its rounds add their
    # tokens to the user's day.
    quotas: str | None = None
    webhook: TurnWebhook | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def new_turn_id() -> str:
    """``t_`` + 12 hex digits of ms time + 10 random hex digits: unique and time-sortable."""
    return f"t_{now_ms():012x}{os.urandom(5).hex()}"


def new_session_id() -> str:
    return "s_" + os.urandom(12).hex()


_INT_FIELDS = frozenset(
    {
        "createdAt",
        "shard",
        "attempt",
        "startedAt",
        "endedAt",
        "pausedAt",
        "actionTimeoutMs",
        "actionDeadline",
        "waitedMs",
        "resumes",
    }
)
# Fields the hash keeps as JSON text.
_JSON_FIELDS: dict[str, msgspec.json.Decoder[Any]] = {
    "clientTools": msgspec.json.Decoder(list[ClientTool]),
    "pendingCalls": msgspec.json.Decoder(list[PendingCall]),
}
_record_decoder = msgspec.json.Decoder(TurnRecord)
# The hash keeps usage as JSON text (the worker's Lua writes it as one field).
_usage_decoder = msgspec.json.Decoder(TurnUsage)
_usage_encoder = msgspec.json.Encoder()
_webhook_decoder = msgspec.json.Decoder(TurnWebhook)


def record_from_hash(flat: dict[str, str]) -> TurnRecord:
    """Decode a stored turn hash (every value a string)."""
    values: dict[str, Any] = {}
    for key, value in flat.items():
        if key in _INT_FIELDS:
            try:
                values[key] = int(value)
            except ValueError:
                continue
        elif key == "reason":
            if value in END_REASONS:
                values[key] = value  # one a newer writer added is left out
        elif key == "cancelRequested":
            values[key] = value == "1"
        elif key == "usage":
            try:
                values[key] = _usage_decoder.decode(value)
            except msgspec.DecodeError:
                continue  # unreadable counts are left out; the record stays readable
        elif key == "webhook":
            try:
                values[key] = _webhook_decoder.decode(value)
            except msgspec.DecodeError:
                continue
        elif key in _JSON_FIELDS:
            if value:
                try:
                    values[key] = msgspec.to_builtins(_JSON_FIELDS[key].decode(value))
                except msgspec.DecodeError:
                    continue
        elif key in TurnRecord.__struct_fields__:
            values[key] = value
    return msgspec.convert(values, TurnRecord)


def record_fields(record: TurnRecord) -> dict[str, str]:
    out: dict[str, str] = {}
    for key in record.__struct_fields__:
        value = getattr(record, key)
        if value is None:
            continue
        if isinstance(value, bool):
            out[key] = "1" if value else "0"
        elif isinstance(value, TurnUsage | TurnWebhook | list):
            out[key] = _usage_encoder.encode(value).decode()
        else:
            out[key] = str(value)
    return out


class ActiveTurn(msgspec.Struct):
    """The session's oldest unfinished turn: running once a worker has started it."""

    turnId: str
    status: ActiveStatus


class SessionSummary(msgspec.Struct, kw_only=True):
    """One row of the sessions list."""

    sessionId: str
    title: str | None
    createdAt: Annotated[int, msgspec.Meta(description="ms; the list's order, newest first")]
    updatedAt: Annotated[int, msgspec.Meta(description="the envelope's clock (ms)")]
    activeTurn: ActiveTurn | None
    notesBytes: Annotated[
        int, msgspec.Meta(ge=0, description="the working notes' UTF-8 size; 0 when unset")
    ]


class SessionPage(msgspec.Struct):
    """A page of the sessions list, newest first."""

    sessions: list[SessionSummary]
    nextCursor: Annotated[
        str | None,
        msgspec.Meta(description="pass as `cursor` for the next page; null on the last page"),
    ]

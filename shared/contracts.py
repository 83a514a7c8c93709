"""The values that cross a process boundary, spelled once.

Turn statuses, the reasons a turn ends with, the work entry a submit hands the workers
and the thinking blocks of a model's history. The Lua scripts and the console get the
statuses and reasons from here through one generator (:mod:`turnbus.shared.generate`,
``make generate``); the event types and their JSON are :mod:`turnbus.shared.events`'
structs. Nothing here talks to Redis: the Python client imports this module too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

import msgspec

from turnbus.shared.keys import validate_id

__all__ = [
    "ACTIVE_STATUSES",
    "CANCEL_REASONS",
    "END_REASONS",
    "FAILURE_REASONS",
    "TERMINAL_STATUSES",
    "THINKING_BLOCK_TYPES",
    "TIMEOUT_REASONS",
    "TURN_STATUSES",
    "ActiveStatus",
    "CancelReason",
    "EndReason",
    "FailureReason",
    "TerminalStatus",
    "TimeoutReason",
    "TurnStatus",
    "WorkEntry",
]

# A turn's statuses in the order it can reach them. A turn in ``requires_action`` waits
# for its caller's answer, holding no worker; a turn in a terminal status never changes
# again.
ActiveStatus = Literal["queued", "running", "requires_action"]
TerminalStatus = Literal["completed", "failed", "cancelled", "timed_out"]
TurnStatus = Literal[ActiveStatus, TerminalStatus]
TURN_STATUSES: tuple[TurnStatus, ...] = get_args(TurnStatus)
ACTIVE_STATUSES: tuple[ActiveStatus, ...] = get_args(ActiveStatus)
TERMINAL_STATUSES: frozenset[str] = frozenset(get_args(TerminalStatus))

# Why a turn ended ``failed`` (``turn.failed``'s ``reason``, the record's): the model's
# provider refused or failed (``rate_limited`` … ``connection``, after the retries), the
# round cap was reached, the attempts ran out (its workers were lost), or anything else.
FailureReason = Literal[
    "max_rounds",
    "worker_lost",
    "rate_limited",
    "overloaded",
    "provider_error",
    "bad_request",
    "auth",
    "connection",
    "internal",
]
# Why a turn ended ``timed_out``: its wall clock, or its caller left a pause unanswered.
TimeoutReason = Literal["wall_clock", "action_timeout"]
# Why a turn ended ``cancelled``, when the record says: a cancel of a turn no worker was
# running, or a submit with ``multitask=interrupt``.
CancelReason = Literal["cancelled", "interrupted"]
EndReason = Literal[FailureReason, TimeoutReason, CancelReason]

FAILURE_REASONS: tuple[FailureReason, ...] = get_args(FailureReason)
TIMEOUT_REASONS: tuple[TimeoutReason, ...] = get_args(TimeoutReason)
CANCEL_REASONS: tuple[CancelReason, ...] = get_args(CancelReason)
END_REASONS: tuple[EndReason, ...] = (*FAILURE_REASONS, *TIMEOUT_REASONS, *CANCEL_REASONS)

# The content blocks of a model's reasoning in the stored history (Anthropic's): kept for
# the provider that wrote them, dropped where a reader must not see or resend them.
THINKING_BLOCK_TYPES: frozenset[str] = frozenset({"thinking", "redacted_thinking"})


class WorkEntry(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A work-stream entry: the turn a worker is to run, as flat stream fields.

    ``interrupts``: the turn this one interrupted (its worker then looks for the
    session's running turn to end without backing off). ``traceparent`` and
    ``tracestate``: the submit span's trace context, so the turn's span joins it."""

    user: str
    session: str
    turn: str
    interrupts: str | None = None
    traceparent: str | None = None
    tracestate: str | None = None

    def fields(self) -> dict[str, str]:
        """The entry's stream fields (XADD's), the one encoding of a work entry."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}

    @classmethod
    def decode(cls, fields: Mapping[str, Any]) -> WorkEntry:
        """The one decoding of a work entry's fields (values ``str`` or ``bytes``; fields
        it does not know are ignored, so an older reader survives a newer writer).
        Raises :class:`~turnbus.shared.keys.InvalidId` when an id is missing or unsafe."""
        values = {name: _text(fields.get(name)) for name in cls.__struct_fields__}
        for name, kind in (("user", "user"), ("session", "session"), ("turn", "turn")):
            validate_id(values[name], kind)
        return cls(**{k: v for k, v in values.items() if v is not None})

    def trace(self) -> dict[str, str] | None:
        """The submit's trace context (``traceparent``, ``tracestate``), if it has one."""
        if self.traceparent is None:
            return None
        context = {"traceparent": self.traceparent}
        if self.tracestate is not None:
            context["tracestate"] = self.tracestate
        return context


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    return str(value)

"""The errors of a turn's submit, answer and cancel (each an HTTP answer the gateway
gives with its code)."""

from __future__ import annotations

__all__ = [
    "ActionsInvalid",
    "IdempotencyMismatch",
    "SessionBusy",
    "SessionQueueFull",
    "TurnNotFound",
    "TurnNotWaiting",
]


class SessionBusy(Exception):
    """The session already has an active turn (HTTP 409 ``session_busy``)."""

    def __init__(self, active_turn_id: str) -> None:
        super().__init__(f"session has an active turn {active_turn_id}")
        self.active_turn_id = active_turn_id


class SessionQueueFull(Exception):
    """The session already holds its maximum of unfinished turns (HTTP 429 ``session_queue_full``)."""

    def __init__(self, active: int, limit: int) -> None:
        super().__init__(f"the session has {active} unfinished turns; the limit is {limit}")
        self.active = active
        self.limit = limit


class IdempotencyMismatch(Exception):
    """The ``Idempotency-Key`` was used before with a different body (HTTP 409)."""

    def __init__(self, turn_id: str) -> None:
        super().__init__(f"idempotency key already used for turn {turn_id} with another body")
        self.turn_id = turn_id


class TurnNotFound(LookupError):
    """No such turn in that session (HTTP 404)."""


class TurnNotWaiting(Exception):
    """An answer to a turn that is not waiting for one (HTTP 409 ``turn_not_waiting``)."""

    def __init__(self, status: str) -> None:
        super().__init__(f"the turn is {status}, not waiting for an answer")
        self.status = status


class ActionsInvalid(ValueError):
    """An answer that does not match the pending calls (HTTP 422): ``code`` is
    ``unknown_call``, ``missing_call``, ``duplicate_call``, ``wrong_answer`` (a result
    for a call awaiting approval, or a decision for a client call) or ``unprocessable``
    (an approval's input or reason), ``call_id`` the call."""

    def __init__(self, code: str, call_id: str, field: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.call_id = call_id
        self.field = field

"""How an attempt at a turn ended: for the engine (:class:`TurnOutcome`) and for the
entry's runner (:class:`AttemptResult`, with what becomes of the work entry)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from turnbus.shared.records import TERMINAL_STATUSES

__all__ = ["AttemptResult", "EntryFate", "TurnOutcome"]

# What becomes of a work entry after an attempt (:attr:`AttemptResult.entry`).
EntryFate = Literal["done", "retry", "leave"]


@dataclasses.dataclass(slots=True)
class TurnOutcome:
    """How an attempt ended. ``status`` is a terminal status, or ``"abandoned"`` (the
    attempt stopped without ending the turn: lease lost, worker stopping), ``"gone"``
    (the session or the turn record was deleted) or ``"requires_action"`` (the turn
    paused for its caller)."""

    status: str
    reason: str | None = None
    error: str | None = None
    stop_reason: str | None = None
    # A cancel by an interrupt: the turn that interrupted this one (``reason``
    # ``interrupted``).
    by: str | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


@dataclasses.dataclass(frozen=True, slots=True)
class AttemptResult:
    """How :meth:`TurnEngine.attempt` ended, for the entry's runner:

    - ``ended``: the turn ended here (``status``);
    - ``paused``: the turn waits for its caller (requires_action); the caller's answer
      enqueues it again;
    - ``dropped``: the turn had already ended; ``gone``: its record or session is gone
      (the runner also sweeps keys recreated meanwhile);
    - ``abandoned``: the attempt stopped without ending the turn (``reason``);
      ``stopped``: the worker is stopping before the turn started.
    """

    kind: Literal["ended", "dropped", "gone", "abandoned", "stopped", "paused"]
    status: str | None = None
    reason: str | None = None

    @property
    def entry(self) -> EntryFate:
        """``done``: the entry is acked. ``retry``: left pending because Redis was
        unreachable; this worker takes it back once Redis answers (a new attempt, from
        the last committed round). ``leave``: left pending for the next attempt (this
        worker's next start, or another worker's reclaim)."""
        if self.kind in ("ended", "paused", "dropped", "gone"):
            return "done"
        if self.kind == "abandoned" and self.reason == "redis_unavailable":
            return "retry"
        return "leave"

"""How an attempt at a turn ended: for the engine (:class:`TurnOutcome`) and for the
consumer (:class:`AttemptResult`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from turnbus.shared.records import TERMINAL_STATUSES

__all__ = ["AttemptResult", "TurnOutcome"]


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

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


@dataclasses.dataclass(frozen=True, slots=True)
class AttemptResult:
    """How :meth:`TurnEngine.attempt` ended, for the consumer:

    - ``ended``: the turn ended here (``status``); its entry is acked;
    - ``dropped``: the turn had already ended; ``gone``: its record or session is gone
      (the consumer acks the entry; for ``gone`` it also sweeps recreated keys);
    - ``abandoned``: the attempt stopped without ending the turn (``reason``), the
      entry stays pending; ``stopped``: the worker is stopping before the turn started;
    - ``paused``: the turn waits for its caller (requires_action); its entry is acked.
    """

    kind: Literal["ended", "dropped", "gone", "abandoned", "stopped", "paused"]
    status: str | None = None
    reason: str | None = None

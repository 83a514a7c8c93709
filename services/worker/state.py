"""What one attempt at a turn knows between its Redis calls (:class:`AttemptState`), the
round a cancel may cut short (:class:`CutRound`), and the history rows a round makes.

The engine builds the state from the start script's answer; the rounds, their writes
and the turn's end read and change it.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Callable
from typing import Any

from turnbus.shared.envelope import Envelope
from turnbus.shared.events import Event
from turnbus.shared.meta import meta_bytes
from turnbus.shared.records import TurnRecord
from turnbus.worker.history import SessionHistory, assistant_row
from turnbus.worker.lease import SessionLease
from turnbus.worker.models.base import RoundResult, UsageCounts
from turnbus.worker.pipeline import CANCELLED
from turnbus.worker.tools import NotesTools

__all__ = [
    "AttemptState",
    "CutRound",
    "meta_bytes_reader",
    "other_meta_bytes",
    "prompt_row",
    "round_rows",
]


def other_meta_bytes(flat: dict[str, str]) -> int:
    """The bytes the budget counts for an envelope's keys other than the notes (as the
    scripts count them: every key but createdAt and updatedAt, names and values)."""
    return meta_bytes(
        {k: v for k, v in flat.items() if k not in ("createdAt", "updatedAt", "workingNotes")}
    )


def prompt_row(record: TurnRecord) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": record.message}],
        "turnId": record.turnId,
        "round": 0,
        "kind": "prompt",
    }


def round_rows(
    turn_id: str,
    rnd: int,
    result: RoundResult,
    results: list[dict[str, Any]],
    notes_results: list[str],
) -> list[dict[str, Any]]:
    """A round's history rows: the assistant's, then its tool results (if any)."""
    rows = [assistant_row(turn_id, rnd, result.content, result.stop_reason)]
    if results:
        row: dict[str, Any] = {
            "role": "user",
            "content": results,
            "turnId": turn_id,
            "round": rnd,
            "kind": "tool_results",
        }
        if notes_results:
            row["notesResults"] = notes_results  # stored as their digest
        rows.append(row)
    return rows


@dataclasses.dataclass(slots=True)
class CutRound:
    """The round in progress, until its rows are built: the text streamed so far, its
    result once the stream ended, the text not yet written as an event. An interrupt
    keeps it in the history (:meth:`rows`)."""

    round: int
    parts: list[str] = dataclasses.field(default_factory=list)
    result: RoundResult | None = None
    unsent: list[Event] = dataclasses.field(default_factory=list)

    def rows(self, turn_id: str) -> list[dict[str, Any]]:
        """The round as far as the model produced it: its whole message with a
        cancelled result for each tool call once the stream ended, else the text streamed
        (nothing when there is no text: no empty assistant message)."""
        if self.result is not None:
            results = [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": CANCELLED,
                    "is_error": True,
                }
                for use in self.result.tool_uses
            ]
            return round_rows(turn_id, self.round, self.result, results, [])
        text = "".join(self.parts)
        if not text.strip():
            return []
        return [assistant_row(turn_id, self.round, [{"type": "text", "text": text}], "interrupted")]


@dataclasses.dataclass(slots=True, weakref_slot=True)
class AttemptState:
    """What one attempt knows between its Redis calls."""

    record: TurnRecord
    lease: SessionLease
    envelope: Envelope
    history: SessionHistory
    usage: UsageCounts
    # Rows not stored yet (the prompt, until the first commit; the last round's rows,
    # which go with the finish) and events not written yet (they go with the next write).
    pending_rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    outbox: list[Event] = dataclasses.field(default_factory=list)
    # The start script announced round 1 (the turn's first attempt), or, on the first
    # attempt after an answer that left no call to run, the round after the resumed one.
    round_announced: bool = False
    next_round_announced: bool = False
    # This attempt's event writes (``EventWriter``): its tag and how many it numbered.
    write_tag: str = dataclasses.field(default_factory=lambda: os.urandom(4).hex())
    written: int = 0
    # The notes tools, and the bytes the envelope's keys other than the notes take (as
    # the last commit saw them: a notes write must fit the budget to be held for the
    # next commit); the calls whose notes write the next commit stores.
    tools: NotesTools | None = None
    # A resumed attempt's calls hash as the start script answered it (flat, raw values).
    start_calls: dict[str, bytes] | None = None
    meta_bytes: int = 0
    held_calls: list[str] = dataclasses.field(default_factory=list)
    # The round in progress, until its rows are built (kept by an interrupt).
    cut: CutRound | None = None


def meta_bytes_reader(state: AttemptState) -> Callable[[], int]:
    """The notes tools' view of the attempt's ``meta_bytes``, through a weak reference:
    the state holds the tools, so a closure over the state would make a cycle of every
    attempt's objects that only the garbage collector frees, in passes that stop the
    worker for tens of milliseconds once hundreds of turns have ended."""
    ref = weakref.ref(state)

    def current() -> int:
        alive = ref()
        return alive.meta_bytes if alive is not None else 0

    return current

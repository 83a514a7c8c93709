"""What the rounds of an attempt write to Redis (:class:`RoundWrites`): their events,
each round's commit, a notes write the last round held, and the pause.

Events are written in batches: the round's last text, its tool results, its usage and
the next round's start go with the round's commit (one script,
:meth:`TurnCommit.commit_round`), which also stores the round's notes write and returns
the envelope when another writer changed it. The last round's rows and events go with
the finish (:mod:`turnbus.worker.ending`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from turnbus.shared.envelope import SessionNotFound, envelope_from_hash
from turnbus.shared.events import ToolResult, WorkingNotes, encode_event
from turnbus.shared.records import PendingCall, now_ms
from turnbus.worker.cancellation import shield_until_done
from turnbus.worker.commit import ACTION_CLOSED, StoredResult, TurnCommit
from turnbus.worker.events_out import EventWriter
from turnbus.worker.history import HistoryFenced, assistant_row, stored_row
from turnbus.worker.models.base import RoundResult
from turnbus.worker.outcome import TurnOutcome
from turnbus.worker.pipeline import RoundTools
from turnbus.worker.state import AttemptState, other_meta_bytes, round_rows
from turnbus.worker.tools import NOTES_UPDATED_NOT_PERSISTED

__all__ = ["RoundWrites"]


def _notes_refused(state: AttemptState, rows: list[dict[str, Any]]) -> None:
    """A held notes write the commit refused: its results and events say
    "persistence unavailable", as for a write refused at once."""
    calls = set(state.held_calls)
    state.held_calls.clear()
    for i, event in enumerate(state.outbox):
        if isinstance(event, ToolResult) and event.callId in calls:
            state.outbox[i] = msgspec.structs.replace(event, output=NOTES_UPDATED_NOT_PERSISTED)
        elif isinstance(event, WorkingNotes) and event.persisted and event.updatedAt == 0:
            state.outbox[i] = msgspec.structs.replace(event, persisted=False, updatedAt=now_ms())
    for row in [*state.pending_rows, *rows]:
        if row.get("kind") != "tool_results":
            continue
        for block in row["content"]:
            if block.get("tool_use_id") in calls:
                block["content"] = NOTES_UPDATED_NOT_PERSISTED


class RoundWrites:
    """The Redis writes of the rounds of every turn of a worker."""

    def __init__(self, commit: TurnCommit) -> None:
        self.commit = commit
        self.keys = commit.keys
        self.settings = commit.settings
        self.retry = commit.retry
        self.events = EventWriter(commit.redis, commit.settings.events_maxlen)

    async def flush(self, state: AttemptState) -> None:
        """Write the events waiting in the outbox, in one round trip (shared with the
        other turns' writes of the same moment)."""
        if not state.outbox:
            return
        await self.append(state, "events", [encode_event(event) for event in state.outbox])
        state.outbox.clear()

    async def append(self, state: AttemptState, what: str, data: list[bytes]) -> None:
        """Append events to the turn's stream, retried while Redis is unreachable. A try
        that failed may have run (its reply lost): the retry writes only the events the
        stream does not hold yet, so none is ever written twice."""
        record = state.record
        key = self.keys.turn_events(record.userId, record.sessionId, record.turnId)
        tag, first = state.write_tag, state.written
        state.written += len(data)
        stored = 0
        tries = 0

        async def write() -> None:
            nonlocal stored, tries
            tries += 1
            if tries > 1:
                stored = await self.events.landed(key, tag, first, len(data))
            await self.events.append(key, data[stored:], tag=tag, first=first + stored)

        await self.retry.run(what, write, state.lease)

    async def pause(
        self, state: AttemptState, rnd: int, result: RoundResult, done: RoundTools
    ) -> TurnOutcome:
        """The round calls client tools, or tools awaiting approval: its settled calls'
        results and events, its notes write and the rows before it are committed, then
        one script pauses the turn
        (:meth:`TurnCommit.pause`): the round kept for the resume, the pending calls on
        the record and in ``turn.requires_action``, the lease released. A cancel asked
        for meanwhile ends the turn instead, the pending calls closed as cancelled."""
        record = state.record
        tid = record.turnId
        await shield_until_done(self.commit_round(state, []))
        closed = [
            *done.results,
            *(
                {"type": "tool_result", "tool_use_id": use.id, "content": content, "is_error": True}
                for use in done.pending
                for content in [ACTION_CLOSED]
            ),
        ]
        by_id = {block["tool_use_id"]: block for block in closed}
        ordered = [by_id[use.id] for use in result.tool_uses]
        closing = round_rows(tid, rnd, result, ordered, done.notes_results)
        # The notes' text is kept nowhere but the envelope: a working_notes_get of the
        # round is not stored, it reads the notes again when the round resumes.
        settled = {
            str(block["tool_use_id"]): StoredResult(
                str(block["content"]), bool(block.get("is_error", False))
            )
            for block in done.results
            if block["tool_use_id"] not in done.notes_results
        }
        timeout_ms = record.actionTimeoutMs or self.settings.action_timeout_s * 1000
        reply = await shield_until_done(
            self.commit.pause(
                record.userId,
                record.sessionId,
                tid,
                lease=state.lease,
                rnd=rnd,
                assistant=stored_row(assistant_row(tid, rnd, result.content, result.stop_reason)),
                settled=settled,
                pending=[
                    PendingCall(
                        callId=use.id,
                        name=use.name,
                        input=use.input,
                        kind="approval" if use.id in done.approval else "client",
                    )
                    for use in done.pending
                ],
                closing=closing,
                timeout_ms=timeout_ms,
            )
        )
        if reply == "fenced":
            raise HistoryFenced(self.keys.messages(record.userId, record.sessionId))
        if reply == "cancel":
            state.pending_rows.extend(closing)
            return TurnOutcome("cancelled")
        state.lease.released()  # the script deleted it
        return TurnOutcome("requires_action")

    async def commit_round(self, state: AttemptState, rows: list[dict[str, Any]]) -> None:
        """One call: the round's rows (and a pending prompt), its events, the notes write
        the round's tools held, the envelope (when another writer changed it)."""
        record = state.record
        user, session, tid = record.userId, record.sessionId, record.turnId
        tools = state.tools
        while True:
            plan = state.history.commit_plan([*state.pending_rows, *rows], live_turn=tid)
            held = tools.held if tools is not None else None
            reply = await self.commit.commit_round(
                user,
                session,
                tid,
                lease=state.lease,
                plan=plan,
                envelope_at=state.envelope.updatedAt,
                events=state.outbox,
                notes=held,
            )
            if reply.status != "too_large":
                break
            # The budget filled since the last commit (a host write): the held write is
            # refused, and its results say so before the round is stored.
            assert tools is not None
            tools.not_persisted()
            _notes_refused(state, rows)
        if reply.status == "fenced":
            raise HistoryFenced(self.keys.messages(user, session))
        state.history.committed(plan)
        state.pending_rows.clear()
        state.outbox.clear()
        state.held_calls.clear()
        if tools is not None and held is not None:
            tools.committed()
        if reply.status == "same":
            # Nobody else wrote the envelope: the worker's copy holds, with its own write.
            if held is not None and reply.notes_at is not None:
                meta = msgspec.structs.replace(state.envelope.meta, workingNotes=held or None)
                state.envelope = msgspec.structs.replace(
                    state.envelope, updatedAt=reply.notes_at, meta=meta
                )
            return
        if not reply.envelope:
            raise SessionNotFound(session)
        state.envelope = envelope_from_hash(session, reply.envelope)
        state.meta_bytes = other_meta_bytes(reply.envelope)

    async def commit_held_notes(self, state: AttemptState) -> None:
        """Before the finish: a notes write the last round held (no commit follows it)
        is stored by a commit of its own, with the rows and events so far (which also
        puts the round's working_notes events on the session log)."""
        tools = state.tools
        if tools is None or (
            tools.held is None and not any(isinstance(e, WorkingNotes) for e in state.outbox)
        ):
            return
        try:
            await self.commit_round(state, [])
        except (HistoryFenced, SessionNotFound):
            tools.not_persisted()  # the end, too, will write nothing there

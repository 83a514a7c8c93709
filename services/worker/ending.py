"""A turn's end (:class:`TurnEnding`): the finish script with the attempt's last rows and
events, the ends of a turn that no attempt plays (past the attempt cap, a pause nobody
answered), and what follows the end: the webhook sender's poke, the user's quota count
given back.

The finish (:meth:`TurnCommit.finish`) is one script: the last round's rows and
events, the final status and the one terminal event, the envelope's status, the lease
released. It runs under ``asyncio.shield`` and is retried while Redis is unreachable.
The work entry is not acked here: its runner acks it once the attempt is over
(:class:`~turnbus.worker.entries.EntryRunner`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from turnbus.shared.quotas import ACTIVE, QuotaStore
from turnbus.shared.records import TurnRecord, TurnUsage
from turnbus.shared.settings import Settings
from turnbus.worker.commit import StartReply, TurnCommit
from turnbus.worker.history import SessionHistory
from turnbus.worker.lease import SessionLease
from turnbus.worker.models.base import UsageCounts
from turnbus.worker.outcome import TurnOutcome
from turnbus.worker.retry import REDIS_ERRORS
from turnbus.worker.state import AttemptState

__all__ = ["TurnEnding", "usage_from_record"]

log = logging.getLogger(__name__)


def usage_from_record(u: TurnUsage | None) -> UsageCounts:
    """The token counts a turn record holds."""
    if u is None:
        return UsageCounts()
    return UsageCounts(u.inputTokens, u.outputTokens, u.cacheReadTokens, u.cacheWriteTokens)


class TurnEnding:
    """Ends the turns of one worker; shared by all its turns."""

    def __init__(
        self,
        commit: TurnCommit,
        *,
        held_notes: Callable[[AttemptState], Awaitable[None]],
    ) -> None:
        self.commit = commit
        self.settings: Settings = commit.settings
        self.retry = commit.retry
        self.quotas = QuotaStore(commit.redis, commit.keys)
        # Stores a notes write the last round held (no round commit follows it).
        self._held_notes = held_notes
        # Told of each turn this worker ended with a webhook queued (the sender's poke).
        self.webhook_queued: Callable[[str, str], None] | None = None

    async def end(self, state: AttemptState, outcome: TurnOutcome) -> None:
        """End the turn an attempt played with its terminal ``outcome``."""
        record = state.record
        await asyncio.shield(
            self.retry.run(
                "finish",
                lambda: self._finish(record, state, outcome, state.lease),
                turn=record.turnId,
            )
        )

    async def end_exhausted(self, reply: StartReply, lease: SessionLease) -> None:
        """End a turn past the attempt cap ``worker_lost``. The dead attempts' commits
        kept their thinking for a resumed tool loop; this end strips it, as every turn's
        end does."""
        assert reply.record is not None
        record = reply.record
        outcome = TurnOutcome(
            "failed",
            reason="worker_lost",
            error=(
                f"the turn was started {record.attempt} times (the limit is "
                f"{self.settings.max_deliveries}); its workers were lost"
            ),
        )
        await self._end_unplayed(record, reply, lease, outcome, pending=[])

    async def end_action_timeout(self, reply: StartReply, lease: SessionLease) -> None:
        """End a turn whose caller did not answer its pause in time ``timed_out``
        (``action_timeout``): the paused round goes into the history with its pending
        calls closed by a synthetic error result, so the next turn's history is valid."""
        assert reply.record is not None
        record = reply.record
        timeout_ms = record.actionTimeoutMs or self.settings.action_timeout_s * 1000
        outcome = TurnOutcome(
            "timed_out",
            reason="action_timeout",
            error=f"the turn waited {timeout_ms // 1000} s for its caller's answer",
        )
        closing = await self.retry.run(
            "closing",
            lambda: self.commit.closing_rows(record.userId, record.sessionId, record.turnId),
            turn=record.turnId,
        )
        await self._end_unplayed(record, reply, lease, outcome, pending=closing)

    async def _end_unplayed(
        self,
        record: TurnRecord,
        reply: StartReply,
        lease: SessionLease,
        outcome: TurnOutcome,
        *,
        pending: list[dict[str, Any]],
    ) -> None:
        """End a turn that no attempt plays, from the history the start answered."""
        history = SessionHistory.from_raw(reply.rows)
        await asyncio.shield(
            self.retry.run(
                "finish",
                lambda: self._finish(
                    record, None, outcome, lease, history=history, pending=pending
                ),
                turn=record.turnId,
            )
        )

    async def _finish(
        self,
        record: TurnRecord,
        state: AttemptState | None,
        outcome: TurnOutcome,
        lease: SessionLease,
        *,
        history: SessionHistory | None = None,
        pending: list[dict[str, Any]] | None = None,
    ) -> bool:
        """End the turn (:meth:`TurnCommit.finish`) with the attempt's last rows and
        events. Returns ``False`` when the turn had already ended (nothing was written).
        ``history``: the session's history when there is no attempt ``state`` (a turn
        ended before any attempt ran), so its stored rows still lose their thinking."""
        usage = usage_from_record(record.usage)
        pending = list(pending or ())
        if state is not None:
            await self._held_notes(state)
            if outcome.by is not None and state.cut is not None:
                # An interrupt keeps the round it cut short, as far as it streamed.
                state.outbox.extend(state.cut.unsent)
                state.pending_rows.extend(state.cut.rows(record.turnId))
                state.cut = None
            usage, history, pending = state.usage, state.history, state.pending_rows
        # The turn ends: its rows are stored without thinking (rewritten if an earlier
        # commit of the turn kept some for a resumed tool loop).
        plan = None
        if history is not None and (pending or history.holds_thinking()):
            plan = history.commit_plan(pending)
        # The terminal event is acknowledged (the entry acked) once the replicas have it.
        ended = await self.commit.finish(
            record.userId,
            record.sessionId,
            record.turnId,
            lease_token=lease.token,
            outcome=outcome,
            usage=usage,
            events=state.outbox if state is not None else (),
            plan=plan,
            webhook=record.webhook,
        )
        lease.released()  # the script deleted it if this attempt still held it
        if ended is not None and record.webhook is not None and self.webhook_queued:
            self.webhook_queued(record.userId, record.sessionId)
        if history is not None and plan is not None:
            history.committed(plan)
        if state is not None:
            state.pending_rows.clear()
            state.outbox.clear()
        if ended is not None and record.quotas and ACTIVE in record.quotas.split():
            await self._quota_turn_ended(record)
        return ended is not None

    async def _quota_turn_ended(self, record: TurnRecord) -> None:
        """Give back the ended turn's running or queued count (a call of its own: the
        user's counters are on another cluster slot). Lost, a refused submit of the user
        recounts (docs/operations.md, "Quotas")."""
        try:
            await self.quotas.turn_ended(record.userId, record.sessionId)
        except REDIS_ERRORS:
            log.warning("turn %s ended; its quota count not given back", record.turnId)

"""The rounds of one attempt (:class:`RoundRunner`): from the last committed round, each
round's model call (:mod:`turnbus.worker.streaming`), its tool calls
(:mod:`turnbus.worker.pipeline`), its commit or the pause (:mod:`turnbus.worker.round_writes`),
until the turn ends, pauses or uses its last round. The last round's rows and events
stay in the attempt's state for the finish.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from turnbus.shared import caps
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.events import RoundStarted, Usage
from turnbus.shared.meta import approval_tools
from turnbus.shared.quotas import TOKENS, QuotaStore, counted_tokens
from turnbus.shared.records import TurnRecord, now_ms
from turnbus.worker.cancellation import shield_until_done
from turnbus.worker.commit import RoundCalls, TurnCommit, round_calls_from
from turnbus.worker.health import WorkerMetrics
from turnbus.worker.models.base import ModelClient, RoundResult, ToolUse, UsageCounts
from turnbus.worker.outcome import TurnOutcome
from turnbus.worker.pipeline import RoundTools, ToolPipeline
from turnbus.worker.registry import ToolRegistry
from turnbus.worker.retry import REDIS_ERRORS
from turnbus.worker.round_writes import RoundWrites
from turnbus.worker.state import AttemptState, meta_bytes_reader, prompt_row, round_rows
from turnbus.worker.streaming import ModelRound
from turnbus.worker.tools import NotesTools

__all__ = ["RoundRunner"]

log = logging.getLogger(__name__)

# Stop reasons after which the model goes on: another round follows (a tool_use without
# tool calls ends the turn all the same).
_CONTINUE_STOPS = frozenset({"tool_use", "pause_turn"})


def _resumed_round(
    row: dict[str, Any], edits: Mapping[str, dict[str, Any] | None] | None = None
) -> RoundResult:
    """A round as a previous attempt stored it before its calls started; ``edits``: the
    input an approver gave a call instead of the model's (the history then shows the
    call as it ran)."""
    content = [b for b in row.get("content") or [] if isinstance(b, dict)]
    for i, block in enumerate(content):
        edited = (edits or {}).get(str(block.get("id")))
        if block.get("type") == "tool_use" and edited is not None:
            content[i] = {**block, "input": edited}
    uses = [
        ToolUse(
            str(b.get("id")),
            str(b.get("name")),
            b["input"] if isinstance(b.get("input"), dict) else {},
        )
        for b in content
        if b.get("type") == "tool_use"
    ]
    stop = row.get("stopReason")
    return RoundResult(
        stop_reason=stop if isinstance(stop, str) else "tool_use",
        content=content,
        tool_uses=uses,
        usage=UsageCounts(),
    )


class RoundRunner:
    """Plays the rounds of an attempt; shared by all the turns of a worker."""

    def __init__(
        self,
        commit: TurnCommit,
        model: ModelClient,
        *,
        store: EnvelopeStore,
        metrics: WorkerMetrics | None = None,
        tools: ToolRegistry | None = None,
    ) -> None:
        # The rounds run on the commit's client, keys and settings.
        self.commit = commit
        self.redis = commit.redis
        self.keys = commit.keys
        self.settings = commit.settings
        self.store = store
        self.quotas = QuotaStore(commit.redis, commit.keys)
        self.tools = tools or ToolRegistry()
        self.writes = RoundWrites(commit)
        self.model_round = ModelRound(
            model, commit.settings, tools=self.tools, writes=self.writes, metrics=metrics
        )
        self.pipeline = ToolPipeline(self.tools, commit, metrics=metrics)

    async def play(self, state: AttemptState) -> TurnOutcome:
        """Play the turn's rounds until it ends (from the last committed one). The last
        round's rows and events stay in ``state`` for the finish."""
        record = state.record
        tid = record.turnId
        progress = state.history.progress(tid)
        if not progress.has_prompt:
            # Stored with the first commit (or the finish): one call fewer per turn.
            state.pending_rows.append(prompt_row(record))
        elif progress.last_round > 0 and progress.last_stop not in _CONTINUE_STOPS:
            # The previous attempt committed the final round but died before ending the turn.
            return TurnOutcome("completed", stop_reason=progress.last_stop or "end_turn")
        tools = NotesTools(
            self.redis,
            self.keys,
            self.settings,
            self.store,
            user=record.userId,
            session=record.sessionId,
            turn_id=tid,
            lease_token=state.lease.token,
            events=state.outbox.append,  # working_notes goes with the round's next write
            # The notes are written by the round's commit, unless each write must wait
            # for its replicas on a call of its own (TURNBUS_WAIT_REPLICAS).
            fold=meta_bytes_reader(state) if self.settings.wait_replicas <= 0 else None,
        )
        state.tools = tools
        first = progress.last_round + 1
        # A previous attempt that was running this round's tools left the round's
        # assistant message: the round goes on from it, the model is not asked again.
        resumed: RoundCalls | None = None
        if state.start_calls is not None:
            resumed = round_calls_from(state.start_calls)
        elif record.attempt > 1:
            resumed = await self.commit.round_calls(record.userId, record.sessionId, tid)
        if resumed is not None and resumed.round != first:
            resumed = None
        for rnd in range(first, caps.MAX_MODEL_ROUNDS + 1):
            # Later rounds are announced by the previous commit; round 1 of a first
            # attempt by the start script, and so is the round after a resumed one when
            # the caller's answer left no call to run.
            announced = (rnd == 1 and state.round_announced) or (
                resumed is not None and resumed.paused  # announced before the pause
            )
            if rnd == first and not announced:
                state.outbox.append(RoundStarted(turnId=tid, round=rnd, at=now_ms()))
                await shield_until_done(self.writes.flush(state))
            if resumed is not None and rnd == first:
                result = _resumed_round(resumed.assistant, resumed.approved)
            else:
                result = await self.model_round.run(state, rnd, tools)
            state.usage.add(result.usage)
            if record.quotas and TOKENS in record.quotas.split():
                await self._count_tokens(record, result.usage)
            done = await self._run_tools(
                state, rnd, result, tools, resumed if rnd == first else None
            )
            results, notes_results = done.results, done.notes_results
            state.cut = None  # the round is whole: it goes to the history, or to a pause
            u = state.usage
            state.outbox.append(
                Usage(
                    turnId=tid,
                    inputTokens=u.input_tokens,
                    outputTokens=u.output_tokens,
                    cacheReadTokens=u.cache_read_tokens,
                    cacheWriteTokens=u.cache_write_tokens,
                )
            )
            if done.pending:
                return await self.writes.pause(state, rnd, result, done)
            rows = round_rows(tid, rnd, result, results, notes_results)
            ends = result.stop_reason not in _CONTINUE_STOPS or (
                result.stop_reason == "tool_use" and not result.tool_uses
            )
            if ends or rnd == caps.MAX_MODEL_ROUNDS:
                # The last round: its rows and events go with the finish, in one call.
                state.pending_rows.extend(rows)
                if ends:
                    return TurnOutcome("completed", stop_reason=result.stop_reason)
                break
            if rnd == first and resumed is not None and state.next_round_announced:
                # The start script announced the next round: the resumed round's rows
                # and events go with that round's commit (or the finish), one call fewer.
                state.pending_rows.extend(rows)
                continue
            state.outbox.append(RoundStarted(turnId=tid, round=rnd + 1, at=now_ms()))
            await shield_until_done(self.writes.commit_round(state, rows))
        return TurnOutcome(
            "failed",
            reason="max_rounds",
            error=f"the turn used all {caps.MAX_MODEL_ROUNDS} model rounds without finishing",
        )

    async def _count_tokens(self, record: TurnRecord, usage: UsageCounts) -> None:
        """Add a round's tokens to its user's day (``TURNBUS_QUOTA_TOKENS_PER_DAY``).
        Redis unreachable, they are not counted: the turn goes on."""
        u = usage
        tokens = counted_tokens(
            u.input_tokens, u.output_tokens, u.cache_read_tokens, u.cache_write_tokens
        )
        if not tokens:
            return
        try:
            await self.quotas.add_tokens(record.userId, tokens)
        except REDIS_ERRORS:
            log.warning("turn %s: %d tokens not counted in its user's quota", record.turnId, tokens)

    async def _run_tools(
        self,
        state: AttemptState,
        rnd: int,
        result: RoundResult,
        tools: NotesTools,
        resumed: RoundCalls | None,
    ) -> RoundTools:
        """Run every tool_use of the round (:class:`ToolPipeline`: a stored tool_use
        always gets its result). Returns the tool_result blocks, the call ids whose
        result is the notes' text and the client calls left pending. Cancelled, the
        round's rows go with the turn's end, the unfinished calls closed as cancelled."""
        if not result.tool_uses:
            return RoundTools(results=[], notes_results=[], held_calls=[])
        record = state.record
        tid = record.turnId

        def on_cancel(closed: RoundTools) -> None:
            state.cut = None  # the round's rows, its calls closed, go with the end
            state.held_calls.extend(closed.held_calls)
            state.pending_rows.extend(
                round_rows(tid, rnd, result, closed.results, closed.notes_results)
            )

        _, allowed, client = self.tools.offer_to_turn(
            state.envelope.meta.allowedTools, record.allowedTools, record.clientTools
        )
        done = await self.pipeline.run(
            user=record.userId,
            session=record.sessionId,
            turn_id=tid,
            rnd=rnd,
            lease=state.lease,
            result=result,
            notes=tools,
            allowed=allowed,
            outbox=state.outbox,
            on_cancel=on_cancel,
            resumed=resumed,
            client={t.name: t for t in record.clientTools or () if t.name in client},
            approval=approval_tools(state.envelope.meta.allowedTools),
        )
        state.held_calls.extend(done.held_calls)
        return done

"""One attempt at one turn, from its start to its end (:class:`TurnEngine`).

:meth:`TurnEngine.attempt` owns an attempt in few Redis calls (the scripts and their
arguments are :mod:`turnbus.worker.commit`'s) and answers how it went
(:class:`~turnbus.worker.outcome.AttemptResult`, which also says what becomes of the
work entry; the engine never sees the entry):

- **start** is one script: the session lease (only for the session's oldest active
  turn), the record marked running with the attempt counted, ``turn.started``, the
  envelope overlay, and the envelope and history the first round needs. A turn that
  must wait for its session calls back the entry's ``wait``;
- **rounds** (:mod:`turnbus.worker.rounds`), raced against a cancel, the wall clock, a
  lost lease and the worker stopping (:mod:`turnbus.worker.attempt`);
- **end** (:mod:`turnbus.worker.ending`): one script under ``asyncio.shield``, the last
  round's rows and events, the final status and the one terminal event, the lease
  released.

Every Redis call is retried while Redis is unreachable (:mod:`turnbus.worker.retry`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis

from turnbus.shared import caps, tracing
from turnbus.shared.envelope import EnvelopeStore, envelope_from_hash
from turnbus.shared.events import Usage, decode_event
from turnbus.shared.keys import Keys
from turnbus.shared.records import TERMINAL_STATUSES, TurnRecord, now_ms
from turnbus.shared.replicas import ReplicaWait
from turnbus.shared.scripts import text as _s
from turnbus.shared.settings import Settings
from turnbus.worker.attempt import AttemptRunner
from turnbus.worker.commit import StartReply, TurnCommit
from turnbus.worker.ending import TurnEnding, usage_from_record
from turnbus.worker.health import WorkerMetrics
from turnbus.worker.history import HistoryCache, SessionHistory
from turnbus.worker.interrupts import CancelSignal
from turnbus.worker.lease import SessionLease
from turnbus.worker.models.base import ModelClient, UsageCounts
from turnbus.worker.outcome import AttemptResult, TurnOutcome
from turnbus.worker.registry import ToolRegistry
from turnbus.worker.retry import REDIS_UNAVAILABLE, RedisRetry
from turnbus.worker.rounds import RoundRunner
from turnbus.worker.slots import WaitForSession
from turnbus.worker.state import AttemptState, other_meta_bytes
from turnbus.worker.streaming import set_usage

__all__ = ["TurnEngine"]

log = logging.getLogger(__name__)

# An attempt's span (GenAI conventions: the agent's invocation).
TURN_SPAN = "invoke_agent turnbus"


class TurnEngine:
    """Runs turn attempts for one worker process; shared by all its turns."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        model: ModelClient,
        *,
        worker_name: str,
        store: EnvelopeStore | None = None,
        metrics: WorkerMetrics | None = None,
        tools: ToolRegistry | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.metrics = metrics
        replicas = ReplicaWait.from_settings(settings)
        store = store or EnvelopeStore(
            redis, keys, log_maxlen=settings.log_maxlen, replicas=replicas
        )
        self.retry = RedisRetry(settings.redis_retry_ms, metrics)
        self.commit = TurnCommit(
            redis,
            keys,
            settings,
            worker_name=worker_name,
            budget=store.budget,
            retry=self.retry,
            replicas=replicas,
        )
        self.rounds = RoundRunner(
            self.commit, model, store=store, metrics=metrics, tools=tools or ToolRegistry()
        )
        self.runner = AttemptRunner(redis, keys, settings, self.rounds)
        self.ending = TurnEnding(self.commit, held_notes=self.rounds.writes.commit_held_notes)
        self.histories = HistoryCache()

    async def attempt(
        self,
        user: str,
        session: str,
        turn_id: str,
        *,
        lease: SessionLease,
        wait: WaitForSession,
        cancel: asyncio.Event,
        stop: asyncio.Event | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> AttemptResult:
        """Start the turn (calling ``wait(head)`` while another turn of its session runs
        or is older; ``False`` gives up), play its rounds, end it. ``trace``: the trace
        context the work entry carried (the attempt's span is a child of the submit's)."""
        with tracing.span(TURN_SPAN, parent=trace, kind="consumer") as span:
            if span.recording:
                span.set("gen_ai.operation.name", "invoke_agent")
                span.set("gen_ai.agent.name", "turnbus")
                span.set("gen_ai.conversation.id", session)
                span.set("turnbus.session.id", session)
                span.set("turnbus.turn.id", turn_id)
            started = await self._start(user, session, turn_id, lease, wait)
            if isinstance(started, AttemptResult):
                result = started
            else:
                result = await self._run_started(started, lease, cancel, stop, span)
            if span.recording:
                span.set("turnbus.attempt.result", result.kind)
                span.set("turnbus.turn.status", result.status)
                span.set("turnbus.turn.reason", result.reason)
                if result.status == "failed" or result.status == "timed_out":
                    span.failed(result.reason or result.status)
            return result

    async def _start(
        self, user: str, session: str, turn_id: str, lease: SessionLease, wait: WaitForSession
    ) -> StartReply | AttemptResult:
        """The start script, run again after each ``wait`` while the session is busy;
        the reply of a start that took the turn, else how the attempt ended."""
        messages_key = self.keys.messages(user, session)
        while True:
            reply = await self.retry.run(
                "start",
                lambda: self.commit.start(
                    user,
                    session,
                    turn_id,
                    lease,
                    self.histories.check_args(messages_key),
                    # A Redis outage long enough to stop an attempt, recent enough to
                    # be why this one starts: the new attempt says so.
                    self.retry.recent_outage_ms(
                        self.settings.lease_ms + self.settings.claim_idle_ms
                    ),
                ),
                turn=turn_id,
            )
            if reply.status in ("started", "exhausted", "action_timeout"):
                return reply
            if reply.status == "not_found":
                return AttemptResult("gone")
            if reply.status in ("terminal", "waiting"):
                return AttemptResult("dropped")
            head, paused = reply.head, False
            if reply.status == "not_head" and head and head != turn_id:
                paused = await self._clear_dead_head(user, session, head)
            if not await wait(head if reply.status == "not_head" else turn_id, paused):
                return AttemptResult("stopped")

    async def _run_started(
        self,
        reply: StartReply,
        lease: SessionLease,
        cancel: asyncio.Event,
        stop: asyncio.Event | None,
        span: tracing.Span,
    ) -> AttemptResult:
        """The attempt at a turn its start took: its rounds and its end."""
        assert reply.record is not None
        lease.adopt()  # the script took it: keep it alive from now on
        messages_key = self.keys.messages(reply.record.userId, reply.record.sessionId)
        try:
            if reply.status == "exhausted":
                await self.ending.end_exhausted(reply, lease)
                return AttemptResult("ended", "failed", "worker_lost")
            if reply.status == "action_timeout":
                await self.ending.end_action_timeout(reply, lease)
                return AttemptResult("ended", "timed_out", "action_timeout")
            state = await self._state(reply.record, reply, lease)
            span.set("turnbus.turn.attempt", state.record.attempt)
            outcome = await self._play(state, cancel, stop, span)
            if outcome.status == "gone":
                return AttemptResult("gone")
            if outcome.status == "requires_action":
                # Paused (the lease released with it): the entry is done; the caller's
                # answer enqueues the turn again, for any worker.
                self.histories.put(messages_key, state.history)
                return AttemptResult("paused")
            if outcome.status == "cancelled" and isinstance(cancel, CancelSignal) and cancel.by:
                outcome.reason, outcome.by = "interrupted", cancel.by
            if not outcome.terminal:
                return AttemptResult("abandoned", reason=outcome.reason)
            await self.ending.end(state, outcome)
            # The session's next turn here starts from it (checked against Redis first).
            self.histories.put(messages_key, state.history)
            return AttemptResult("ended", outcome.status, outcome.reason)
        except BaseException:
            self.histories.drop(messages_key)
            raise
        finally:
            await asyncio.shield(self._release(lease))

    async def _play(
        self,
        state: AttemptState,
        cancel: asyncio.Event,
        stop: asyncio.Event | None,
        span: tracing.Span,
    ) -> TurnOutcome:
        """The attempt's rounds under the turn's wall clock (its running time: not the
        time spent waiting for the caller)."""
        if state.record.cancelRequested:
            if isinstance(cancel, CancelSignal):
                cancel.interrupt(state.record.by)
            else:
                cancel.set()
        wall = min(self.settings.turn_wall_clock_ms, caps.TURN_WALL_CLOCK_MAX_MS)
        started = (state.record.startedAt or now_ms()) + state.record.waitedMs
        if self.metrics is not None:
            self.metrics.running.inc()
        began = time.monotonic()
        try:
            return await self.runner.run(
                state, deadline_ms=started + wall, cancel=cancel, stop=stop
            )
        finally:
            if self.metrics is not None:
                self.metrics.running.dec()
                self.metrics.turn_seconds.observe(time.monotonic() - began)
            if span.recording:
                set_usage(span, state.usage)

    async def _state(
        self, record: TurnRecord, reply: StartReply, lease: SessionLease
    ) -> AttemptState:
        """The attempt's state from what the start script answered."""
        state = AttemptState(
            round_announced=reply.announced and record.attempt == 1,
            next_round_announced=reply.announced and record.attempt > 1,
            record=record,
            lease=lease,
            envelope=envelope_from_hash(record.sessionId, reply.envelope),
            meta_bytes=other_meta_bytes(reply.envelope),
            history=await self._history(record, reply.rows, after=reply.after),
            usage=usage_from_record(record.usage),
            start_calls=reply.calls,
        )
        if record.attempt > 1:
            state.usage = await self._usage_so_far(record, state.usage, reply.last_usage)
        return state

    async def _history(self, record: TurnRecord, raw: list[Any], *, after: bool) -> SessionHistory:
        """The history the start script answered: all its rows, or (``after``) the rows
        after those this worker held from the session's last turn here."""
        if not after:
            return SessionHistory.from_raw(raw)
        user, session = record.userId, record.sessionId
        entry = self.histories.get(self.keys.messages(user, session))
        if entry is None:  # dropped meanwhile (another turn of it here failed): read it
            return await SessionHistory.load(self.redis, self.keys, user, session)
        return SessionHistory.from_raw(raw, held=entry)

    async def _usage_so_far(
        self, record: TurnRecord, stored: UsageCounts, found: list[Any] | None = None
    ) -> UsageCounts:
        """A resumed turn's usage: the last ``usage`` event (written with each round's
        commit), else what the record holds. ``found``: what the start script found among
        the turn's last 100 events (:attr:`StartReply.last_usage`; read here when
        ``None``)."""
        key = self.keys.turn_events(record.userId, record.sessionId, record.turnId)
        last = "+"
        if found is not None:
            if not found:
                return stored
            if len(found) > 1:
                event = decode_event(found[1] or b"")
                if isinstance(event, Usage):
                    return _counts(event)
            last = "(" + _s(found[0])  # the older events are read here
        while True:
            page = await self.redis.xrevrange(key, last, "-", count=100)
            for entry_id, fields in page or []:
                event = decode_event((fields or {}).get("data") or b"")
                if isinstance(event, Usage):
                    return _counts(event)
                last = "(" + _s(entry_id)
            if len(page or []) < 100:
                return stored

    async def _release(self, lease: SessionLease) -> None:
        try:
            await lease.release()
        except REDIS_UNAVAILABLE:
            log.warning("lease release failed for %s; it will expire", lease.turn_id)

    async def _clear_dead_head(self, user: str, session: str, head: str) -> bool:
        """A head turn that already ended (or vanished) must not block the session.
        Returns whether the head waits for its caller (``requires_action``)."""
        try:
            status = await self.redis.hget(self.keys.turn(user, session, head), "status")
        except ValueError:  # not a valid id: not a turn of ours
            status = None
        if status is None or _s(status) in TERMINAL_STATUSES:
            await self.redis.lrem(self.keys.active(user, session), 1, head)
            return False
        return _s(status) == "requires_action"

    async def sweep_deleted(self, user: str, session: str, turn_id: str) -> None:
        """Events written while the session was being deleted recreate keys; drop them."""
        await self.redis.delete(self.keys.turn_events(user, session, turn_id))
        if not await self.redis.exists(self.keys.env(user, session)):
            await self.redis.delete(self.keys.log(user, session))


def _counts(event: Usage) -> UsageCounts:
    return UsageCounts(
        event.inputTokens, event.outputTokens, event.cacheReadTokens, event.cacheWriteTokens
    )

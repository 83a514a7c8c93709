"""One attempt at one turn, from its start to its end: the engine's entry.

:meth:`TurnEngine.attempt` owns an attempt from start to finish, in few Redis calls
(the scripts and their arguments are :mod:`turnbus.worker.commit`'s):

- **start** is one script: the session lease (only for the session's oldest active
  turn), the record marked running with the attempt counted, ``turn.started``, the
  envelope overlay, and the envelope and history the first round needs. A turn that
  must wait for its session calls back the consumer's ``wait``;
- **rounds** (:mod:`turnbus.worker.rounds`), raced against a cancel, the wall clock, a
  lost lease and the worker stopping (:mod:`turnbus.worker.attempt`);
- **finish** is one script: the last round's rows and events, the final status and the
  one terminal event, the envelope's status, the lease released — under
  ``asyncio.shield``; then the work entry is acked (another call: on a Redis Cluster the
  work stream is on another slot than the session).

Every Redis call is retried while Redis is unreachable (:mod:`turnbus.worker.retry`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from turnbus.shared import caps, tracing
from turnbus.shared.envelope import EnvelopeStore, envelope_from_hash
from turnbus.shared.events import Usage, decode_event
from turnbus.shared.keys import Keys
from turnbus.shared.quotas import ACTIVE
from turnbus.shared.records import TERMINAL_STATUSES, TurnRecord, TurnUsage, now_ms
from turnbus.shared.replicas import ReplicaWait
from turnbus.shared.scripts import text as _s
from turnbus.shared.settings import Settings
from turnbus.worker.attempt import AttemptRunner
from turnbus.worker.commit import StartReply, TurnCommit
from turnbus.worker.health import WorkerMetrics
from turnbus.worker.history import HistoryCache, SessionHistory
from turnbus.worker.interrupts import CancelSignal
from turnbus.worker.lease import SessionLease
from turnbus.worker.models.base import ModelClient, UsageCounts
from turnbus.worker.outcome import AttemptResult, TurnOutcome
from turnbus.worker.registry import ToolRegistry
from turnbus.worker.retry import REDIS_UNAVAILABLE, RedisRetry
from turnbus.worker.rounds import AttemptState, RoundRunner, other_meta_bytes, set_usage

__all__ = ["TurnEngine", "WaitForSession"]

log = logging.getLogger(__name__)

WaitForSession = Callable[[str], Awaitable[bool]]
# An attempt's span (GenAI conventions: the agent's invocation).
TURN_SPAN = "invoke_agent turnbus"


def _usage_from_record(u: TurnUsage | None) -> UsageCounts:
    if u is None:
        return UsageCounts()
    return UsageCounts(u.inputTokens, u.outputTokens, u.cacheReadTokens, u.cacheWriteTokens)


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
        self.histories = HistoryCache()
        # Told of each turn this engine ended with a webhook queued (the sender's poke).
        self.webhook_queued: Callable[[str, str], None] | None = None

    async def attempt(
        self,
        user: str,
        session: str,
        turn_id: str,
        *,
        entry: tuple[str, str, str],
        lease: SessionLease,
        wait: WaitForSession,
        cancel: asyncio.Event,
        stop: asyncio.Event | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> AttemptResult:
        """Start the turn (calling ``wait(head)`` while another turn of its session runs
        or is older; ``False`` gives up), play its rounds, end it. ``entry`` is the work
        entry (stream, group, id) that the finish acks; ``trace``, the trace context it
        carried (the attempt's span is a child of the submit's)."""
        with tracing.span(TURN_SPAN, parent=trace, kind="consumer") as span:
            if span.recording:
                span.set("gen_ai.operation.name", "invoke_agent")
                span.set("gen_ai.agent.name", "turnbus")
                span.set("gen_ai.conversation.id", session)
                span.set("turnbus.session.id", session)
                span.set("turnbus.turn.id", turn_id)
            result = await self._attempt(
                user,
                session,
                turn_id,
                entry=entry,
                lease=lease,
                wait=wait,
                cancel=cancel,
                stop=stop,
                span=span,
            )
            if span.recording:
                span.set("turnbus.attempt.result", result.kind)
                span.set("turnbus.turn.status", result.status)
                span.set("turnbus.turn.reason", result.reason)
                if result.status == "failed" or result.status == "timed_out":
                    span.failed(result.reason or result.status)
            return result

    async def _attempt(
        self,
        user: str,
        session: str,
        turn_id: str,
        *,
        entry: tuple[str, str, str],
        lease: SessionLease,
        wait: WaitForSession,
        cancel: asyncio.Event,
        stop: asyncio.Event | None,
        span: tracing.Span,
    ) -> AttemptResult:
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
                break
            if reply.status == "not_found":
                return AttemptResult("gone")
            if reply.status in ("terminal", "waiting"):
                return AttemptResult("dropped")
            head = reply.head
            if reply.status == "not_head" and head and head != turn_id:
                await self._clear_dead_head(user, session, head)
            if not await wait(head if reply.status == "not_head" else turn_id):
                return AttemptResult("stopped")
        assert reply.record is not None
        lease.adopt()  # the script took it: keep it alive from now on
        try:
            if reply.status == "exhausted":
                await self._end_exhausted(reply.record, reply, entry, lease)
                return AttemptResult("ended", "failed", "worker_lost")
            if reply.status == "action_timeout":
                await self._end_action_timeout(reply.record, reply, entry, lease)
                return AttemptResult("ended", "timed_out", "action_timeout")
            state = await self._state(reply.record, reply, lease)
            span.set("turnbus.turn.attempt", state.record.attempt)
            if state.record.cancelRequested:
                if isinstance(cancel, CancelSignal):
                    cancel.interrupt(state.record.by)
                else:
                    cancel.set()
            wall = min(self.settings.turn_wall_clock_ms, caps.TURN_WALL_CLOCK_MAX_MS)
            # The wall clock counts running time: not the time spent waiting for the caller.
            started = (state.record.startedAt or now_ms()) + state.record.waitedMs
            deadline_ms = started + wall
            if self.metrics is not None:
                self.metrics.running.inc()
            began = time.monotonic()
            try:
                outcome = await self.runner.run(
                    state, deadline_ms=deadline_ms, cancel=cancel, stop=stop
                )
            finally:
                if self.metrics is not None:
                    self.metrics.running.dec()
                    self.metrics.turn_seconds.observe(time.monotonic() - began)
                if span.recording:
                    set_usage(span, state.usage)
            if outcome.status == "gone":
                return AttemptResult("gone")
            if outcome.status == "requires_action":
                # Paused (the lease released with it): the entry is done; the caller's
                # answer enqueues the turn again, for any worker.
                self.histories.put(messages_key, state.history)
                await self._ack(entry)
                return AttemptResult("paused")
            if outcome.status == "cancelled" and isinstance(cancel, CancelSignal) and cancel.by:
                outcome.reason, outcome.by = "interrupted", cancel.by
            if not outcome.terminal:
                return AttemptResult("abandoned", reason=outcome.reason)
            await asyncio.shield(
                self.retry.run(
                    "finish",
                    lambda: self._finish(state.record, state, outcome, entry, lease),
                    turn=turn_id,
                )
            )
            # The session's next turn here starts from it (checked against Redis first).
            self.histories.put(messages_key, state.history)
            return AttemptResult("ended", outcome.status, outcome.reason)
        except BaseException:
            self.histories.drop(messages_key)
            raise
        finally:
            await asyncio.shield(self._release(lease))

    async def _end_exhausted(
        self,
        record: TurnRecord,
        reply: StartReply,
        entry: tuple[str, str, str],
        lease: SessionLease,
    ) -> None:
        """End a turn past the attempt cap ``worker_lost``. The dead attempts' commits
        kept their thinking for a resumed tool loop; this end strips it, as every turn's
        end does."""
        outcome = TurnOutcome(
            "failed",
            reason="worker_lost",
            error=(
                f"the turn was started {record.attempt} times (the limit is "
                f"{self.settings.max_deliveries}); its workers were lost"
            ),
        )
        history = SessionHistory.from_raw(reply.rows)
        await asyncio.shield(
            self.retry.run(
                "finish",
                lambda: self._finish(record, None, outcome, entry, lease, history=history),
                turn=record.turnId,
            )
        )

    async def _end_action_timeout(
        self,
        record: TurnRecord,
        reply: StartReply,
        entry: tuple[str, str, str],
        lease: SessionLease,
    ) -> None:
        """End a turn whose caller did not answer its pause in time ``timed_out``
        (``action_timeout``): the paused round goes into the history with its pending
        calls closed by a synthetic error result, so the next turn's history is valid."""
        timeout_ms = record.actionTimeoutMs or self.settings.action_timeout_s * 1000
        outcome = TurnOutcome(
            "timed_out",
            reason="action_timeout",
            error=f"the turn waited {timeout_ms // 1000} s for its caller's answer",
        )
        history = SessionHistory.from_raw(reply.rows)
        closing = await self.retry.run(
            "closing",
            lambda: self.commit.closing_rows(record.userId, record.sessionId, record.turnId),
            turn=record.turnId,
        )
        await asyncio.shield(
            self.retry.run(
                "finish",
                lambda: self._finish(
                    record, None, outcome, entry, lease, history=history, pending=closing
                ),
                turn=record.turnId,
            )
        )

    async def _state(
        self, record: TurnRecord, reply: StartReply, lease: SessionLease
    ) -> AttemptState:
        """The attempt's state from what the start script answered."""
        state = AttemptState(
            round_announced=reply.announced,
            record=record,
            lease=lease,
            envelope=envelope_from_hash(record.sessionId, reply.envelope),
            meta_bytes=other_meta_bytes(reply.envelope),
            history=await self._history(record, reply.rows, after=reply.after),
            usage=_usage_from_record(record.usage),
            start_calls=reply.calls,
        )
        if record.attempt > 1:
            state.usage = await self._usage_so_far(record, state.usage, reply.last_events)
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
        self,
        record: TurnRecord,
        stored: UsageCounts,
        first_page: list[tuple[str, dict[str, bytes]]] | None = None,
    ) -> UsageCounts:
        """A resumed turn's usage: the last ``usage`` event (written with each round's
        commit), else what the record holds. ``first_page``: the turn's last 100 events,
        newest first, as the start script answered them (read here when ``None``)."""
        key = self.keys.turn_events(record.userId, record.sessionId, record.turnId)
        last = "+"
        page: Any = first_page
        while True:
            if page is None:
                page = await self.redis.xrevrange(key, last, "-", count=100)
            for entry_id, fields in page or []:
                event = decode_event((fields or {}).get("data") or b"")
                if isinstance(event, Usage):
                    return UsageCounts(
                        event.inputTokens,
                        event.outputTokens,
                        event.cacheReadTokens,
                        event.cacheWriteTokens,
                    )
                last = "(" + _s(entry_id)
            if len(page or []) < 100:
                return stored
            page = None

    async def _release(self, lease: SessionLease) -> None:
        try:
            await lease.release()
        except REDIS_UNAVAILABLE:
            log.warning("lease release failed for %s; it will expire", lease.turn_id)

    async def _clear_dead_head(self, user: str, session: str, head: str) -> None:
        """A head turn that already ended (or vanished) must not block the session."""
        try:
            status = await self.redis.hget(self.keys.turn(user, session, head), "status")
        except ValueError:  # not a valid id: not a turn of ours
            status = None
        if status is None or _s(status) in TERMINAL_STATUSES:
            await self.redis.lrem(self.keys.active(user, session), 1, head)

    async def sweep_deleted(self, user: str, session: str, turn_id: str) -> None:
        """Events written while the session was being deleted recreate keys; drop them."""
        await self.redis.delete(self.keys.turn_events(user, session, turn_id))
        if not await self.redis.exists(self.keys.env(user, session)):
            await self.redis.delete(self.keys.log(user, session))

    async def _finish(
        self,
        record: TurnRecord,
        state: AttemptState | None,
        outcome: TurnOutcome,
        entry: tuple[str, str, str],
        lease: SessionLease,
        *,
        history: SessionHistory | None = None,
        pending: list[dict[str, Any]] | None = None,
    ) -> bool:
        """End the turn (:meth:`TurnCommit.finish`) with the attempt's last rows and
        events, then ack the entry. Returns ``False`` when the turn had already ended
        (nothing was written). ``history``: the session's history when there is no
        attempt ``state`` (a turn ended before any attempt ran), so its stored rows
        still lose their thinking."""
        usage = _usage_from_record(record.usage)
        pending = list(pending or ())
        if state is not None:
            await self.rounds.commit_held_notes(state)
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
        await self._ack(entry)
        if ended is not None and record.quotas and ACTIVE in record.quotas.split():
            await self._quota_turn_ended(record)
        return ended is not None

    async def _quota_turn_ended(self, record: TurnRecord) -> None:
        """Give back the ended turn's running or queued count (a call of its own: the
        user's counters are on another cluster slot). Lost, a refused submit of the user
        recounts (docs/operations.md, "Quotas")."""
        try:
            await self.rounds.quotas.turn_ended(record.userId, record.sessionId)
        except (RedisError, OSError):
            log.warning("turn %s ended; its quota count not given back", record.turnId)

    async def _ack(self, entry: tuple[str, str, str]) -> None:
        """Ack the work entry once its turn has ended (a call of its own: the work stream
        is on another cluster slot). Lost, the entry is delivered again and dropped."""
        stream, group, entry_id = entry
        if not entry_id:
            return
        try:
            await self.redis.xack(stream, group, entry_id)
        except REDIS_UNAVAILABLE:
            log.warning("ack of %s failed; it will be delivered again and dropped", entry_id)

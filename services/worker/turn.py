"""One attempt at one turn: start, the model rounds, the tools, the events, the ending.

:meth:`TurnEngine.attempt` owns an attempt from start to finish, in few Redis calls:

- **start** is one script (``lua/turn_start.lua``): the session lease (only for the
  session's oldest active turn), the record marked running with the attempt counted,
  ``turn.started``, the envelope overlay, and the envelope and history the first round
  needs. A turn that must wait for its session calls back the consumer's ``wait``;
- **rounds**: each round's system prompt is built from the envelope as it was after
  the previous round (``resolve_system``), so a note written in round k is in round
  k+1's system prompt. Events are written in batches: the round's last text, its tool
  results, its usage and the next round's start go with the round's history commit
  (one script, ``lua/turn_round.lua``), which also stores the round's notes write and
  returns the envelope when another writer changed it;
- **finish** is one script (``lua/turn_finish.lua``): the last round's rows and events,
  the final status and the one terminal event, the envelope's status, the lease
  released — under ``asyncio.shield``; then the work entry is acked (another call: on a
  Redis Cluster the work stream is on another slot than the session).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import msgspec
import redis.asyncio as aioredis
import redis.exceptions

from turnbus.shared import caps
from turnbus.shared.envelope import (
    Envelope,
    EnvelopeStore,
    LeaseNotHeld,
    SessionNotFound,
    envelope_from_hash,
)
from turnbus.shared.events import (
    Event,
    RoundStarted,
    RoundWaiting,
    TextDelta,
    ToolCall,
    ToolResult,
    Usage,
    WorkingNotes,
    decode_event,
    encode_event,
    notes_digest,
    terminal_event,
)
from turnbus.shared.keys import Keys
from turnbus.shared.meta import meta_bytes
from turnbus.shared.records import (
    TERMINAL_STATUSES,
    TurnRecord,
    TurnUsage,
    now_ms,
    record_from_hash,
)
from turnbus.shared.replicas import ReplicaWait
from turnbus.shared.scripts import LuaScript, pairs
from turnbus.shared.scripts import text as _s
from turnbus.shared.settings import Settings
from turnbus.shared.system import resolve_system_blocks
from turnbus.shared.turns import TurnNotFound, TurnStore
from turnbus.worker.events_out import EventWriter
from turnbus.worker.health import WorkerMetrics
from turnbus.worker.history import HistoryCache, HistoryFenced, SessionHistory, truncate_tool_result
from turnbus.worker.interrupts import Signal
from turnbus.worker.lease import SessionLease
from turnbus.worker.models.base import (
    ModelClient,
    ModelError,
    ModelRequest,
    ModelWaiting,
    RoundResult,
    TextChunk,
    UsageCounts,
)
from turnbus.worker.tools import (
    NOTES_TOOL_NAMES,
    NOTES_TOOL_SPECS,
    NOTES_UPDATED_NOT_PERSISTED,
    NotesTools,
    redact_notes,
    redact_tool_input,
)

__all__ = [
    "DELTA_FLUSH_BYTES",
    "DELTA_FLUSH_S",
    "AttemptResult",
    "TurnEngine",
    "TurnOutcome",
    "stop_task",
    "usage_json",
]

log = logging.getLogger(__name__)

DELTA_FLUSH_S = 0.05
DELTA_FLUSH_BYTES = 512
# Stop reasons after which the model has nothing more to say this turn.
_CONTINUE_STOPS = frozenset({"tool_use", "pause_turn"})


async def stop_task(task: asyncio.Task[Any], within: float = 5.0) -> bool:
    """Cancel ``task`` and wait until it is done; ``False`` if it outlived ``within``.

    The cancel is repeated: redis-py (8.1, Python 3.11) can swallow a cancellation that
    lands inside a command, and the task would otherwise run on.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not task.done():
        if loop.time() > deadline:
            log.error("task %s did not stop within %.1f s", task.get_name(), within)
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
    return True


_T = TypeVar("_T")
_REDIS_UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


_usage_encoder = msgspec.json.Encoder()


def usage_json(usage: UsageCounts) -> str:
    return _usage_encoder.encode(
        TurnUsage(
            inputTokens=usage.input_tokens,
            outputTokens=usage.output_tokens,
            cacheReadTokens=usage.cache_read_tokens,
            cacheWriteTokens=usage.cache_write_tokens,
        )
    ).decode()


def _other_meta_bytes(flat: dict[str, str]) -> int:
    """The bytes the budget counts for an envelope's keys other than the notes (as the
    scripts count them: every key but createdAt and updatedAt, names and values)."""
    return meta_bytes(
        {k: v for k, v in flat.items() if k not in ("createdAt", "updatedAt", "workingNotes")}
    )


def _usage_from_record(u: TurnUsage | None) -> UsageCounts:
    if u is None:
        return UsageCounts()
    return UsageCounts(u.inputTokens, u.outputTokens, u.cacheReadTokens, u.cacheWriteTokens)


@dataclasses.dataclass(slots=True)
class TurnOutcome:
    """How an attempt ended. ``status`` is a terminal status, or ``"abandoned"`` (the
    attempt stopped without ending the turn: lease lost, worker stopping) or ``"gone"``
    (the session or the turn record was deleted)."""

    status: str
    reason: str | None = None
    error: str | None = None
    stop_reason: str | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


class _DeltaWriter:
    """Coalesces a round's text into ``text.delta`` events: one XADD per 50 ms or 512 bytes
    (sent with the other turns' writes of the same moment, :class:`EventWriter`).

    The text still buffered when the round ends is not written here: :meth:`take` hands
    it over to go out with the round's next write."""

    def __init__(
        self,
        append: Callable[[list[bytes]], Awaitable[None]],
        turn_id: str,
        rnd: int,
    ) -> None:
        self._append = append
        self._turn_id = turn_id
        self._round = rnd
        self._parts: list[str] = []
        self._size = 0
        self._lock = asyncio.Lock()
        # A timer handle until it fires (cheaper than a task: most rounds end first and
        # hand their text over), then the task that writes what it found.
        self._timer: asyncio.TimerHandle | None = None
        self._timed_flush: asyncio.Task[None] | None = None

    async def add(self, text: str) -> None:
        if not text:
            return
        self._parts.append(text)
        self._size += len(text.encode("utf-8", "surrogatepass"))
        if self._size >= DELTA_FLUSH_BYTES:
            await self.flush()
        elif self._timer is None and self._timed_flush is None:
            self._timer = asyncio.get_running_loop().call_later(DELTA_FLUSH_S, self._due)

    def _due(self) -> None:
        self._timer = None
        self._timed_flush = asyncio.get_running_loop().create_task(self._flush_due())

    async def _flush_due(self) -> None:
        try:
            await self.flush()
        finally:
            self._timed_flush = None

    def _event(self) -> TextDelta | None:
        if not self._parts:
            return None
        text = "".join(self._parts)
        self._parts.clear()
        self._size = 0
        return TextDelta(turnId=self._turn_id, round=self._round, text=text)

    async def flush(self) -> None:
        async with self._lock:
            event = self._event()
            if event is not None:
                await self._append([encode_event(event)])

    async def take(self) -> list[Event]:
        """Stop the timer and return the buffered text as an event (none if empty)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._timed_flush is not None:
            await self._timed_flush  # a write in flight finishes (its error is the round's)
        async with self._lock:
            event = self._event()
        return [event] if event is not None else []

    def abort(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._timed_flush is not None:
            self._timed_flush.cancel()


async def _whole(step: Awaitable[_T]) -> _T:
    """Run a write that also updates the attempt's state (its outbox, its pending rows)
    as one unit: a cancel (the turn's, the wall clock's) that lands in the middle is
    honoured once the write and its bookkeeping are done, so the finish never writes
    the same rows or events again."""
    unit = asyncio.ensure_future(step)
    try:
        return await asyncio.shield(unit)
    except asyncio.CancelledError:
        while not unit.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({unit})
        if not unit.cancelled():
            unit.exception()  # retrieved: the cancel wins
        raise


async def _close_stream(stream: object) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


@dataclasses.dataclass(slots=True)
class _Attempt:
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
    # The start script announced round 1 (the turn's first attempt).
    round_announced: bool = False
    # This attempt's event writes (``EventWriter``): its tag and how many it numbered.
    write_tag: str = dataclasses.field(default_factory=lambda: os.urandom(4).hex())
    written: int = 0
    # The notes tools, and the bytes the envelope's keys other than the notes take (as
    # the last commit saw them: a notes write must fit the budget to be held for the
    # next commit); the calls whose notes write the next commit stores.
    tools: NotesTools | None = None
    meta_bytes: int = 0
    held_calls: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class AttemptResult:
    """How :meth:`TurnEngine.attempt` ended, for the consumer:

    - ``ended``: the turn ended here (``status``); its entry is acked;
    - ``dropped``: the turn had already ended; ``gone``: its record or session is gone
      (the consumer acks the entry; for ``gone`` it also sweeps recreated keys);
    - ``abandoned``: the attempt stopped without ending the turn (``reason``), the
      entry stays pending; ``stopped``: the worker is stopping before the turn started.
    """

    kind: Literal["ended", "dropped", "gone", "abandoned", "stopped"]
    status: str | None = None
    reason: str | None = None


WaitForSession = Callable[[str], Awaitable[bool]]


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
        turns: TurnStore | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.model = model
        self.worker_name = worker_name
        self.store = store or EnvelopeStore(
            redis,
            keys,
            log_maxlen=settings.log_maxlen,
            replicas=ReplicaWait.from_settings(settings),
        )
        self.turns = turns or TurnStore(redis, keys, settings)
        self.metrics = metrics
        self._start = LuaScript(redis, "turn_start.lua")
        self._commit = LuaScript(redis, "turn_round.lua")
        self._finish = LuaScript(redis, "turn_finish.lua")
        self.events = EventWriter(redis, settings.events_maxlen)
        self.histories = HistoryCache()

    # -- one attempt ---------------------------------------------------------------------

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
    ) -> AttemptResult:
        """Start the turn (calling ``wait(head)`` while another turn of its session runs
        or is older; ``False`` gives up), play its rounds, end it. ``entry`` is the work
        entry (stream, group, id) that the finish acks."""
        start_keys = [
            self.keys.turn(user, session, turn_id),
            self.keys.active(user, session),
            lease.key,
            self.keys.turn_events(user, session, turn_id),
            self.keys.env(user, session),
            self.keys.log(user, session),
            self.keys.messages(user, session),
            self.keys.outbox(user, session),
        ]
        outbox_member = Keys.outbox_member(user, session, turn_id)
        messages_key = start_keys[6]

        def start() -> Awaitable[Any]:
            args: list[str | bytes | int] = [
                turn_id,
                lease.token,
                str(lease.lease_ms),
                self.worker_name,
                str(now_ms()),
                str(self.settings.max_deliveries),
                str(self.settings.events_maxlen),
                str(self.settings.log_maxlen),
                str(self.store.budget),
                session,
                outbox_member,
                *self.histories.check_args(messages_key),
            ]
            return self._start(keys=start_keys, args=args)

        while True:
            reply = await self._retry("start", start)
            status = _s(reply[0])
            if status in ("started", "exhausted"):
                break
            if status == "not_found":
                return AttemptResult("gone")
            if status == "terminal":
                return AttemptResult("dropped")
            head = _s(reply[1]) if len(reply) > 1 else ""
            if status == "not_head" and head and head != turn_id:
                await self._clear_dead_head(user, session, head)
            if not await wait(head if status == "not_head" else turn_id):
                return AttemptResult("stopped")
        record = record_from_hash(pairs(reply[1]))
        lease.adopt()  # the script took it: keep it alive from now on
        try:
            if status == "exhausted":
                outcome = TurnOutcome(
                    "failed",
                    reason="worker_lost",
                    error=(
                        f"the turn was started {record.attempt} times (the limit is "
                        f"{self.settings.max_deliveries}); its workers were lost"
                    ),
                )
                usage = _usage_from_record(record.usage)
                # The dead attempts' commits kept their thinking for a resumed tool loop;
                # this end strips it, as every turn's end does.
                history = SessionHistory.from_raw(
                    self.redis, self.keys, user, session, list(reply[2])
                )
                await asyncio.shield(
                    self._retry(
                        "finish",
                        lambda: self.finish(
                            record, None, outcome, usage, entry, lease, history=history
                        ),
                    )
                )
                return AttemptResult("ended", "failed", "worker_lost")
            flat = pairs(reply[2])
            state = _Attempt(
                round_announced=len(reply) > 5 and _s(reply[5]) == "1",
                record=record,
                lease=lease,
                envelope=envelope_from_hash(session, flat),
                meta_bytes=_other_meta_bytes(flat),
                history=await self._history(
                    user, session, reply[3], after=len(reply) > 6 and _s(reply[6]) == "after"
                ),
                usage=_usage_from_record(record.usage),
            )
            if record.attempt > 1:
                state.usage = await self._usage_so_far(record, state.usage)
            if record.cancelRequested:
                cancel.set()
            wall = min(self.settings.turn_wall_clock_ms, caps.TURN_WALL_CLOCK_MAX_MS)
            deadline_ms = (record.startedAt or now_ms()) + wall
            if self.metrics is not None:
                self.metrics.running.inc()
            began = time.monotonic()
            try:
                outcome = await self.run(state, deadline_ms=deadline_ms, cancel=cancel, stop=stop)
            finally:
                if self.metrics is not None:
                    self.metrics.running.dec()
                    self.metrics.turn_seconds.observe(time.monotonic() - began)
            if outcome.status == "gone":
                return AttemptResult("gone")
            if not outcome.terminal:
                return AttemptResult("abandoned", reason=outcome.reason)
            await asyncio.shield(
                self._retry(
                    "finish",
                    lambda: self.finish(state.record, state, outcome, state.usage, entry, lease),
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

    async def _retry(
        self, what: str, call: Callable[[], Awaitable[_T]], lease: SessionLease | None = None
    ) -> _T:
        """Run ``call``; while Redis is unreachable (refused or lost connections, no pooled
        connection free) retry it, backing off, for up to ``redis_retry_ms`` — the lease
        heartbeat keeps renewing meanwhile — instead of abandoning the attempt."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.redis_retry_ms / 1000
        delay = 0.05
        while True:
            try:
                return await call()
            except _REDIS_UNAVAILABLE as exc:
                lost = lease is not None and lease.lost.is_set()
                if lost or loop.time() + delay > deadline:
                    raise
                log.warning("%s: Redis unavailable (%s); retrying in %.2f s", what, exc, delay)
                if self.metrics is not None:
                    self.metrics.redis_retries.inc()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _history(
        self, user: str, session: str, raw: list[Any], *, after: bool
    ) -> SessionHistory:
        """The history the start script answered: all its rows, or (``after``) the rows
        after those this worker held from the session's last turn here."""
        if not after:
            return SessionHistory.from_raw(self.redis, self.keys, user, session, raw)
        entry = self.histories.get(self.keys.messages(user, session))
        if entry is None:  # dropped meanwhile (another turn of it here failed): read it
            return await SessionHistory.load(self.redis, self.keys, user, session)
        return SessionHistory.from_raw(self.redis, self.keys, user, session, raw, held=entry)

    async def _usage_so_far(self, record: TurnRecord, stored: UsageCounts) -> UsageCounts:
        """A resumed turn's usage: the last ``usage`` event (written with each round's
        commit), else what the record holds."""
        key = self.keys.turn_events(record.userId, record.sessionId, record.turnId)
        last = "+"
        while True:
            page: Any = await self.redis.xrevrange(key, last, "-", count=100)
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

    async def _release(self, lease: SessionLease) -> None:
        try:
            await lease.release()
        except _REDIS_UNAVAILABLE:
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

    # -- run -----------------------------------------------------------------------------

    async def run(
        self,
        state: _Attempt,
        *,
        deadline_ms: int,
        cancel: asyncio.Event,
        stop: asyncio.Event | None = None,
    ) -> TurnOutcome:
        """Play the turn's rounds until it ends; a cancel, the wall clock, a lost lease or
        ``stop`` (the worker's grace period ran out) interrupt the model stream at once."""
        record, lease = state.record, state.lease
        loop = asyncio.get_running_loop()
        body = loop.create_task(self._rounds(state), name=f"turn:{record.turnId}")
        # What interrupts the rounds resolves one future (a Signal calls back); a plain
        # Event is waited on by a task of its own.
        interrupted: asyncio.Future[str] = loop.create_future()
        removers: list[Callable[[], None]] = []
        watchers: dict[asyncio.Task[Any], str] = {}

        def interrupt(why: str) -> Callable[[], None]:
            def fire() -> None:
                if not interrupted.done():
                    interrupted.set_result(why)

            return fire

        for event, why in ((cancel, "cancel"), (lease.lost, "lease_lost"), (stop, "stop")):
            if isinstance(event, Signal):
                removers.append(event.on_set(interrupt(why)))
            elif event is not None:
                watchers[loop.create_task(event.wait())] = why
        timeout = max((deadline_ms - now_ms()) / 1000, 0)
        waits: set[asyncio.Future[Any]] = {body, interrupted, *watchers}
        try:
            done, _ = await asyncio.wait(
                waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            # Cancelled from outside (the worker stopping): the body must stop too, and
            # redis-py can swallow a single cancel, so it is repeated until it lands.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(stop_task(body))
            raise
        finally:
            for remove in removers:
                remove()
            for watcher in watchers:
                watcher.cancel()
            if not interrupted.done():
                interrupted.cancel()
        if body in done:
            outcome = self._body_outcome(body, record.turnId)
            if outcome.status == "abandoned" and not await self._record_exists(record):
                outcome = TurnOutcome("gone")
            return outcome
        await stop_task(body)
        if interrupted in done:
            why = interrupted.result()
        else:
            why = next((watchers[w] for w in done if w in watchers), "timeout")
        if why == "lease_lost" and not await self._record_exists(record):
            return TurnOutcome("gone")
        if why == "cancel":
            return TurnOutcome("cancelled")
        if why == "timeout":
            return TurnOutcome(
                "timed_out",
                reason="wall_clock",
                error=f"the turn ran past its wall clock of {self.settings.turn_wall_clock_ms} ms",
            )
        return TurnOutcome("abandoned", reason=why)

    def _body_outcome(self, body: asyncio.Task[TurnOutcome], turn_id: str) -> TurnOutcome:
        exc = body.exception()
        if exc is None:
            return body.result()
        if isinstance(exc, ModelError):
            return TurnOutcome("failed", reason=exc.reason, error=exc.message)
        if isinstance(exc, HistoryFenced | LeaseNotHeld):
            return TurnOutcome("abandoned", reason="lease_lost")
        if isinstance(exc, TurnNotFound | SessionNotFound):
            return TurnOutcome("gone")
        if isinstance(exc, _REDIS_UNAVAILABLE):
            # Not the turn's fault: leave it for redelivery, resumed from its last
            # committed round (bounded by the attempt cap).
            log.warning("turn %s interrupted: Redis unavailable (%s)", turn_id, exc)
            return TurnOutcome("abandoned", reason="redis_unavailable")
        log.error("turn %s failed inside the engine", turn_id, exc_info=exc)
        return TurnOutcome(
            "failed",
            reason="internal",
            error=f"internal error in the turn engine ({type(exc).__name__})",
        )

    async def _record_exists(self, record: TurnRecord) -> bool:
        key = self.keys.turn(record.userId, record.sessionId, record.turnId)
        return bool(await self.redis.exists(key))

    async def _rounds(self, state: _Attempt) -> TurnOutcome:
        record = state.record
        user, session, tid = record.userId, record.sessionId, record.turnId
        progress = state.history.progress(tid)
        if not progress.has_prompt:
            # Stored with the first commit (or the finish): one call fewer per turn.
            state.pending_rows.append(
                {
                    "role": "user",
                    "content": [{"type": "text", "text": record.message}],
                    "turnId": tid,
                    "round": 0,
                    "kind": "prompt",
                }
            )
        elif progress.last_round > 0 and progress.last_stop not in _CONTINUE_STOPS:
            # The previous attempt committed the final round but died before ending the turn.
            return TurnOutcome("completed", stop_reason=progress.last_stop or "end_turn")
        tools = NotesTools(
            self.redis,
            self.keys,
            self.settings,
            self.store,
            user=user,
            session=session,
            turn_id=tid,
            lease_token=state.lease.token,
            events=state.outbox.append,  # working_notes goes with the round's next write
            # The notes are written by the round's commit, unless each write must wait
            # for its replicas on a call of its own (TURNBUS_WAIT_REPLICAS).
            fold=(lambda: state.meta_bytes) if self.settings.wait_replicas <= 0 else None,
        )
        state.tools = tools
        first = progress.last_round + 1
        for rnd in range(first, caps.MAX_MODEL_ROUNDS + 1):
            # Later rounds are announced by the previous commit; round 1 of a first
            # attempt by the start script.
            if rnd == first and not (rnd == 1 and state.round_announced):
                state.outbox.append(RoundStarted(turnId=tid, round=rnd, at=now_ms()))
                await _whole(self._flush(state))
            result = await self._round(state, rnd, tools)
            state.usage.add(result.usage)
            results, notes_results = await self._run_tools(state, rnd, result, tools)
            rows: list[dict[str, Any]] = [
                {
                    "role": "assistant",
                    "content": result.content,
                    "turnId": tid,
                    "round": rnd,
                    "kind": "assistant",
                    "stopReason": result.stop_reason,
                }
            ]
            if results:
                row: dict[str, Any] = {
                    "role": "user",
                    "content": results,
                    "turnId": tid,
                    "round": rnd,
                    "kind": "tool_results",
                }
                if notes_results:
                    row["notesResults"] = notes_results  # stored as their digest
                rows.append(row)
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
            ends = result.stop_reason not in _CONTINUE_STOPS or (
                result.stop_reason == "tool_use" and not result.tool_uses
            )
            if ends or rnd == caps.MAX_MODEL_ROUNDS:
                # The last round: its rows and events go with the finish, in one call.
                state.pending_rows.extend(rows)
                if ends:
                    return TurnOutcome("completed", stop_reason=result.stop_reason)
                break
            state.outbox.append(RoundStarted(turnId=tid, round=rnd + 1, at=now_ms()))
            await _whole(self._commit_round(state, rows))
        return TurnOutcome(
            "failed",
            reason="max_rounds",
            error=f"the turn used all {caps.MAX_MODEL_ROUNDS} model rounds without finishing",
        )

    async def _round(self, state: _Attempt, rnd: int, tools: NotesTools) -> RoundResult:
        record = state.record
        tid = record.turnId
        meta = state.envelope.meta
        notes = tools.in_turn_notes if tools.has_in_turn_notes else meta.workingNotes
        fold = {"persona": meta.personaSnapshot, "notes": notes, "skills": meta.attachedSkills}
        blocks = resolve_system_blocks(**fold)
        request = ModelRequest(
            system_blocks=blocks,
            # The blocks joined are resolve_system's string: built once, not twice.
            system="".join(block["text"] for block in blocks),
            messages=state.history.model_messages(state.pending_rows),
            tools=list(NOTES_TOOL_SPECS),
            model=meta.selectedModel,
            max_tokens=self.settings.anthropic_max_tokens,
            reasoning_effort=meta.reasoningEffort,
        )
        if self.metrics is not None:
            self.metrics.rounds.inc()
        writer = _DeltaWriter(lambda data: self._append(state, "text", data), tid, rnd)
        result: RoundResult | None = None
        stream = self.model.stream_round(request)
        try:
            async for item in stream:
                if isinstance(item, TextChunk):
                    await writer.add(item.text)
                elif isinstance(item, RoundResult):
                    result = item
                elif isinstance(item, ModelWaiting):
                    # Before any text of the round: followers learn why nothing streams.
                    waiting = RoundWaiting(
                        turnId=tid,
                        round=rnd,
                        reason=item.reason,
                        waitMs=int(item.wait_s * 1000),
                        at=now_ms(),
                    )
                    state.outbox.append(waiting)
                    await _whole(self._flush(state))
            state.outbox.extend(await writer.take())
        finally:
            writer.abort()
            await _close_stream(stream)
        if result is None:
            raise ModelError("provider_error", "the model stream ended without a result")
        return result

    async def _flush(self, state: _Attempt) -> None:
        """Write the events waiting in the outbox, in one round trip (shared with the
        other turns' writes of the same moment)."""
        if not state.outbox:
            return
        await self._append(state, "events", [encode_event(event) for event in state.outbox])
        state.outbox.clear()

    async def _append(self, state: _Attempt, what: str, data: list[bytes]) -> None:
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

        await self._retry(what, write, state.lease)

    async def _run_tools(
        self, state: _Attempt, rnd: int, result: RoundResult, tools: NotesTools
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Execute every tool_use of the round (a stored tool_use always gets its result).
        Returns the tool_result blocks and the call ids whose result is the notes' text."""
        tid = state.record.turnId
        results: list[dict[str, Any]] = []
        notes_results: list[str] = []
        for use in result.tool_uses:
            state.outbox.append(
                ToolCall(
                    turnId=tid,
                    round=rnd,
                    callId=use.id,
                    name=use.name,
                    input=redact_tool_input(use.name, use.input),
                )
            )
            # The tools run in-process, in one Redis call: the call goes out with its
            # result (and the round's commit), one write for the followers, not three.
            outcome = await tools.execute(use.name, use.input)
            if self.metrics is not None:
                label = use.name if use.name in NOTES_TOOL_NAMES else "unknown"
                self.metrics.tool_calls.labels(label).inc()
            output, truncated = truncate_tool_result(outcome.output, outcome.max_bytes)
            if outcome.holds_notes:
                notes_results.append(use.id)
            if outcome.deferred:
                state.held_calls.append(use.id)
            state.outbox.append(
                ToolResult(
                    turnId=tid,
                    round=rnd,
                    callId=use.id,
                    name=use.name,
                    output=redact_notes(output) if outcome.holds_notes else output,
                    isError=outcome.is_error,
                    truncated=truncated,
                )
            )
            block: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": use.id,
                "content": output,
            }
            if outcome.is_error:
                block["is_error"] = True
            results.append(block)
        return results, notes_results

    async def _commit_round(self, state: _Attempt, rows: list[dict[str, Any]]) -> None:
        """One call: the round's rows (and a pending prompt), its events, the notes write
        the round's tools held, the envelope (when another writer changed it)."""
        record = state.record
        user, session, tid = record.userId, record.sessionId, record.turnId
        tools = state.tools
        commit_keys = [
            self.keys.messages(user, session),
            state.lease.key,
            self.keys.turn(user, session, tid),
            self.keys.turn_events(user, session, tid),
            self.keys.env(user, session),
            self.keys.log(user, session),
        ]
        while True:
            args, kept_rows, kept_sizes = state.history.commit_args(
                [*state.pending_rows, *rows],
                state.lease.token,
                usage_json(state.usage),
                live_turn=tid,
            )
            held = tools.held if tools is not None else None
            commit_args = [
                *args[:3],
                str(state.envelope.updatedAt or ""),
                str(self.settings.events_maxlen),
                *self._notes_args(state, held),
                *args[4:],
            ]
            reply = await self._retry(
                "commit", self._committer(state, args, commit_keys, commit_args), state.lease
            )
            status = _s(reply[0])
            if status != "too_large":
                break
            # The budget filled since the last commit (a host write): the held write is
            # refused, and its results say so before the round is stored.
            assert tools is not None
            tools.not_persisted()
            self._notes_refused(state, rows)
        if status == "fenced":
            raise HistoryFenced(self.keys.messages(user, session))
        state.history.committed(kept_rows, kept_sizes)
        state.pending_rows.clear()
        state.outbox.clear()
        state.held_calls.clear()
        if tools is not None and held is not None:
            tools.committed()
        if status == "same":
            # Nobody else wrote the envelope: the worker's copy holds, with its own write.
            if held is not None and reply[1]:
                meta = msgspec.structs.replace(state.envelope.meta, workingNotes=held or None)
                state.envelope = msgspec.structs.replace(
                    state.envelope, updatedAt=int(reply[1]), meta=meta
                )
            return
        flat = pairs(reply[1])
        if not flat:
            raise SessionNotFound(session)
        state.envelope = envelope_from_hash(session, flat)
        state.meta_bytes = _other_meta_bytes(flat)

    def _committer(
        self,
        state: _Attempt,
        args: list[str | bytes],
        keys: list[str],
        commit_args: list[str | bytes],
    ) -> Callable[[], Awaitable[Any]]:
        tries = 0
        record = state.record
        env_key = self.keys.env(record.userId, record.sessionId)

        async def commit() -> Any:
            nonlocal tries
            tries += 1
            if tries > 1 and await self._landed(state, args):
                # The previous try ran but its reply was lost: never append twice.
                envelope = await self.redis.hgetall(env_key)
                return [b"ok", [x for kv in envelope.items() for x in kv]]
            return await self._commit(keys=keys, args=commit_args)

        return commit

    def _notes_args(self, state: _Attempt, held: str | None) -> list[str | bytes]:
        """The commit's notes write (``held``: the notes, "" = a clear; ``None``: none)
        and its events: the outbox's ``working_notes`` events go to the session log too,
        those of the held write completed with its clock (their ``updatedAt`` 0)."""
        events = [encode_event(e) for e in state.outbox]
        logged = [str(i) for i, e in enumerate(state.outbox, 1) if isinstance(e, WorkingNotes)]
        notes: list[str | bytes] = ["", "", "", ""]
        if held is not None:
            digest = notes_digest(held)
            notes = ["1", held, str(digest.bytes), digest.sha256]
        return [
            str(len(events)),
            *notes,
            state.record.sessionId,
            str(self.settings.log_maxlen),
            str(self.store.budget),
            str(now_ms()),
            str(len(logged)),
            *logged,
            *events,
        ]

    def _notes_refused(self, state: _Attempt, rows: list[dict[str, Any]]) -> None:
        """A held notes write the commit refused: its results and events say
        "persistence unavailable", as for a write refused at once."""
        calls = set(state.held_calls)
        state.held_calls.clear()
        for i, event in enumerate(state.outbox):
            if isinstance(event, ToolResult) and event.callId in calls:
                state.outbox[i] = msgspec.structs.replace(event, output=NOTES_UPDATED_NOT_PERSISTED)
            elif isinstance(event, WorkingNotes) and event.persisted and event.updatedAt == 0:
                state.outbox[i] = msgspec.structs.replace(
                    event, persisted=False, updatedAt=now_ms()
                )
        for row in [*state.pending_rows, *rows]:
            if row.get("kind") != "tool_results":
                continue
            for block in row["content"]:
                if block.get("tool_use_id") in calls:
                    block["content"] = NOTES_UPDATED_NOT_PERSISTED

    async def _landed(self, state: _Attempt, args: list[str | bytes]) -> bool:
        """Whether a commit whose reply was lost was stored: its rows end the history."""
        rows = [r.decode() if isinstance(r, bytes) else r for r in args[4:]]
        if not rows:
            return False
        key = self.keys.messages(state.record.userId, state.record.sessionId)
        tail = await self.redis.lrange(key, -len(rows), -1)
        return [_s(t) for t in tail] == rows

    # -- finish --------------------------------------------------------------------------

    async def finish(
        self,
        record: TurnRecord,
        state: _Attempt | None,
        outcome: TurnOutcome,
        usage: UsageCounts,
        entry: tuple[str, str, str],
        lease: SessionLease,
        *,
        history: SessionHistory | None = None,
    ) -> bool:
        """End the turn in one call: the attempt's last rows and events, the final status
        and the one terminal event, the envelope's status and usage (only while the lease
        holds this attempt's token: a turn ended without it must not overwrite the status
        of the turn that may be running), the lease released; then the entry is acked.
        Returns ``False`` when the turn had already ended (nothing was written).
        ``history``: the session's history when there is no attempt ``state`` (a turn
        ended before any attempt ran), so its stored rows still lose their thinking."""
        user, session, tid = record.userId, record.sessionId, record.turnId
        if (
            state is not None
            and state.tools is not None
            and (
                state.tools.held is not None
                or any(isinstance(e, WorkingNotes) for e in state.outbox)
            )
        ):
            # A notes write the last round held (no commit follows it) is stored by a
            # commit of its own, with the rows and events so far, before the end (which
            # also puts the round's working_notes events on the session log).
            try:
                await self._commit_round(state, [])
            except (HistoryFenced, SessionNotFound):
                state.tools.not_persisted()  # the end, too, will write nothing there
        at = now_ms()
        event: Event = terminal_event(
            tid,
            outcome.status,
            at=at,
            reason=outcome.reason,
            message=outcome.error,
            stop_reason=outcome.stop_reason,
        )
        usage_text = usage_json(usage)
        fields: dict[str, str] = {"status": outcome.status, "usage": usage_text}
        for key, value in (
            ("reason", outcome.reason),
            ("error", outcome.error),
            ("stopReason", outcome.stop_reason),
        ):
            if value is not None:
                fields[key] = value
        patch = {"turnRunId": tid, "turnStatus": outcome.status, "usage": usage_text}
        mode, drop, rows, events = "", "0", [], []
        kept: tuple[list[dict[str, Any]], list[int]] | None = None
        if state is not None:
            history = state.history
            events = [encode_event(e) for e in state.outbox]
        pending = state.pending_rows if state is not None else []
        # The turn ends: its rows are stored without thinking (rewritten if an earlier
        # commit of the turn kept some for a resumed tool loop).
        if history is not None and (pending or history.holds_thinking()):
            args, kept_rows, kept_sizes = history.commit_args(pending, lease.token)
            mode, drop, rows = str(args[1]), str(args[2]), args[4:]
            kept = (kept_rows, kept_sizes)
        finish_keys = [
            self.keys.turn(user, session, tid),
            self.keys.active(user, session),
            self.keys.turn_events(user, session, tid),
            self.keys.log(user, session),
            lease.key,
            self.keys.env(user, session),
            self.keys.messages(user, session),
        ]
        finish_args: list[str | bytes | int] = [
            tid,
            lease.token,
            str(at),
            str(len(fields)),
            encode_event(event),
            str(self.settings.events_maxlen),
            str(self.settings.log_maxlen),
            str(self.settings.events_ttl_s),
            "",
            "",
            session,
            str(self.store.budget),
            str(len(patch)),
            mode,
            drop,
            str(len(events)),
            *events,
            *(x for kv in fields.items() for x in kv),
            *(x for kv in patch.items() for x in kv),
            *rows,
        ]
        # The terminal event is acknowledged (the entry acked) once the replicas have it.
        reply = await self.turns.replicas.write(
            self.redis, lambda link: self._finish(keys=finish_keys, args=finish_args, on=link)
        )
        lease.released()  # the script deleted it if this attempt still held it
        if history is not None and kept is not None:
            history.committed(*kept)
        if state is not None:
            state.pending_rows.clear()
            state.outbox.clear()
        await self._ack(entry)
        return _s(reply[0]) == "ended"

    async def _ack(self, entry: tuple[str, str, str]) -> None:
        """Ack the work entry once its turn has ended (a call of its own: the work stream
        is on another cluster slot). Lost, the entry is delivered again and dropped."""
        stream, group, entry_id = entry
        if not entry_id:
            return
        try:
            await self.redis.xack(stream, group, entry_id)
        except _REDIS_UNAVAILABLE:
            log.warning("ack of %s failed; it will be delivered again and dropped", entry_id)

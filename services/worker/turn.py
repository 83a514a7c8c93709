"""One attempt at one turn: the model rounds, the tools, the events and the ending.

:meth:`TurnEngine.start` marks the turn running; :meth:`TurnEngine.run` plays rounds —
each with a fresh envelope read and ``resolve_system``, so a note written in round k is
in the system prompt of round k+1 — until the model ends the turn, the round cap, the
wall clock, a cancel, or a lost lease; :meth:`TurnEngine.finish` writes the one terminal
event and the final status. The consumer runs ``finish``, the XACK and the lease release
under ``asyncio.shield``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any

import msgspec
import redis.asyncio as aioredis
import redis.exceptions

from shared import caps
from shared.envelope import EnvelopeStore, LeaseNotHeld, SessionNotFound
from shared.events import (
    Event,
    RoundStarted,
    TextDelta,
    ToolCall,
    ToolResult,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnStarted,
    TurnTimedOut,
    Usage,
)
from shared.keys import Keys
from shared.meta import MetaInvalid, MetaTooLarge
from shared.settings import Settings
from shared.system import resolve_system, resolve_system_blocks
from shared.turns import TurnNotFound, TurnRecord, TurnStore, now_ms
from worker.health import WorkerMetrics
from worker.history import HistoryFenced, SessionHistory, truncate_tool_result
from worker.lease import SessionLease
from worker.models.base import (
    ModelClient,
    ModelError,
    ModelRequest,
    RoundResult,
    TextChunk,
    UsageCounts,
)
from worker.tools import NOTES_TOOL_NAMES, NOTES_TOOL_SPECS, NotesTools

__all__ = [
    "DELTA_FLUSH_BYTES",
    "DELTA_FLUSH_S",
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


_REDIS_UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class _UsageJson(msgspec.Struct):
    inputTokens: int = 0
    outputTokens: int = 0
    cacheReadTokens: int = 0
    cacheWriteTokens: int = 0


_usage_encoder = msgspec.json.Encoder()
_usage_decoder = msgspec.json.Decoder(_UsageJson)


def usage_json(usage: UsageCounts) -> str:
    return _usage_encoder.encode(
        _UsageJson(
            inputTokens=usage.input_tokens,
            outputTokens=usage.output_tokens,
            cacheReadTokens=usage.cache_read_tokens,
            cacheWriteTokens=usage.cache_write_tokens,
        )
    ).decode()


def _usage_from_json(raw: str | None) -> UsageCounts:
    if not raw:
        return UsageCounts()
    try:
        u = _usage_decoder.decode(raw)
    except msgspec.DecodeError:
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
        return self.status in ("completed", "failed", "cancelled", "timed_out")


class _DeltaWriter:
    """Coalesces a round's text into ``text.delta`` events: one XADD per 50 ms or 512 bytes."""

    def __init__(self, turns: TurnStore, user: str, session: str, turn_id: str, rnd: int) -> None:
        self._turns = turns
        self._user = user
        self._session = session
        self._turn_id = turn_id
        self._round = rnd
        self._parts: list[str] = []
        self._size = 0
        self._lock = asyncio.Lock()
        self._timer: asyncio.Task[None] | None = None
        self._timer_flushing = False

    async def add(self, text: str) -> None:
        if not text:
            return
        self._parts.append(text)
        self._size += len(text.encode("utf-8", "surrogatepass"))
        if self._size >= DELTA_FLUSH_BYTES:
            await self.flush()
        elif self._timer is None:
            self._timer = asyncio.create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(DELTA_FLUSH_S)
        self._timer_flushing = True
        try:
            await self.flush()
        finally:
            self._timer = None
            self._timer_flushing = False

    async def flush(self) -> None:
        async with self._lock:
            if not self._parts:
                return
            text = "".join(self._parts)
            self._parts.clear()
            self._size = 0
            await self._turns.append_event(
                self._user,
                self._session,
                self._turn_id,
                TextDelta(turnId=self._turn_id, round=self._round, text=text),
            )

    async def close(self) -> None:
        """Flush what is buffered; never leaves a timer behind."""
        timer = self._timer
        if timer is not None:
            if self._timer_flushing:
                await timer
            else:
                timer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await timer
            self._timer = None
        await self.flush()

    def abort(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def _close_stream(stream: object) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


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
        self.store = store or EnvelopeStore(redis, keys, log_maxlen=settings.log_maxlen)
        self.turns = turns or TurnStore(redis, keys, settings)
        self.metrics = metrics

    # -- start ---------------------------------------------------------------------------

    async def start(
        self, prior: TurnRecord, lease_token: str | None = None
    ) -> tuple[TurnRecord, int] | None:
        """Mark the turn running (attempt + 1) and announce it; returns the record and the
        wall-clock deadline (ms), or ``None`` when the turn already ended. With
        ``lease_token`` the envelope's status is written only while that lease is held.

        Raises :class:`TurnNotFound` when the record is gone.
        """
        user, session, tid = prior.userId, prior.sessionId, prior.turnId
        record = await self.turns.start(user, session, tid, self.worker_name)
        if record is None:
            return None
        first_start = record.startedAt or now_ms()
        wall = min(self.settings.turn_wall_clock_ms, caps.TURN_WALL_CLOCK_MAX_MS)
        await self.turns.append_event(
            user,
            session,
            tid,
            TurnStarted(turnId=tid, attempt=record.attempt, worker=self.worker_name, at=now_ms()),
        )
        await self._overlay(user, session, {"turnRunId": tid, "turnStatus": "running"}, lease_token)
        return record, first_start + wall

    async def _overlay(
        self, user: str, session: str, patch: dict[str, str], lease_token: str | None
    ) -> None:
        try:
            await self.store.worker_overlay(user, session, patch, lease_token=lease_token)
        except (SessionNotFound, MetaInvalid, MetaTooLarge, LeaseNotHeld):
            log.warning("worker overlay of %s refused", sorted(patch), exc_info=True)

    # -- run -----------------------------------------------------------------------------

    async def run(
        self,
        record: TurnRecord,
        lease: SessionLease,
        *,
        deadline_ms: int,
        cancel: asyncio.Event,
        stop: asyncio.Event | None = None,
    ) -> tuple[TurnOutcome, UsageCounts]:
        """Play the turn's rounds until it ends; the caller writes the ending with
        :meth:`finish`. A cancel, the wall clock, a lost lease or ``stop`` (the worker's
        grace period ran out) interrupt the model stream at once."""
        usage = _usage_from_json(record.usage)
        body = asyncio.create_task(self._rounds(record, lease, usage), name=f"turn:{record.turnId}")
        watchers: dict[asyncio.Task[Any], str] = {
            asyncio.create_task(cancel.wait()): "cancel",
            asyncio.create_task(lease.lost.wait()): "lease_lost",
        }
        if stop is not None:
            watchers[asyncio.create_task(stop.wait())] = "stop"
        timeout = max((deadline_ms - now_ms()) / 1000, 0)
        try:
            done, _ = await asyncio.wait(
                {body, *watchers}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            # Cancelled from outside (the worker stopping): the body must stop too, and
            # redis-py can swallow a single cancel, so it is repeated until it lands.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(stop_task(body))
            raise
        finally:
            for watcher in watchers:
                watcher.cancel()
        if body in done:
            outcome = self._body_outcome(body, record.turnId)
            if outcome.status == "abandoned" and not await self._record_exists(record):
                outcome = TurnOutcome("gone")
            return outcome, usage
        await stop_task(body)
        why = next((watchers[w] for w in done if w in watchers), "timeout")
        if why == "lease_lost" and not await self._record_exists(record):
            return TurnOutcome("gone"), usage
        if why == "cancel":
            return TurnOutcome("cancelled"), usage
        if why == "timeout":
            return TurnOutcome(
                "timed_out",
                reason="wall_clock",
                error=f"the turn ran past its wall clock of {self.settings.turn_wall_clock_ms} ms",
            ), usage
        return TurnOutcome("abandoned", reason=why), usage

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
            # committed round (bounded by the delivery cap).
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

    async def _cancel_requested(self, record: TurnRecord) -> bool:
        key = self.keys.turn(record.userId, record.sessionId, record.turnId)
        flag = await self.redis.hget(key, "cancelRequested")
        return flag in ("1", b"1")

    async def _rounds(
        self, record: TurnRecord, lease: SessionLease, usage: UsageCounts
    ) -> TurnOutcome:
        user, session, tid = record.userId, record.sessionId, record.turnId
        history = await SessionHistory.load(self.redis, self.keys, user, session)
        progress = history.progress(tid)
        if not progress.has_prompt:
            prompt = {
                "role": "user",
                "content": [{"type": "text", "text": record.message}],
                "turnId": tid,
                "round": 0,
                "kind": "prompt",
            }
            await history.commit([prompt], lease.token, turn_id=tid)
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
            lease_token=lease.token,
        )
        for rnd in range(progress.last_round + 1, caps.MAX_MODEL_ROUNDS + 1):
            if await self._cancel_requested(record):
                return TurnOutcome("cancelled")
            result = await self._round(record, rnd, history, tools)
            usage.add(result.usage)
            results = await self._run_tools(record, rnd, result, tools)
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
                rows.append(
                    {
                        "role": "user",
                        "content": results,
                        "turnId": tid,
                        "round": rnd,
                        "kind": "tool_results",
                    }
                )
            await history.commit(rows, lease.token, turn_id=tid, usage_json=usage_json(usage))
            await self.turns.append_event(
                user,
                session,
                tid,
                Usage(
                    turnId=tid,
                    inputTokens=usage.input_tokens,
                    outputTokens=usage.output_tokens,
                    cacheReadTokens=usage.cache_read_tokens,
                    cacheWriteTokens=usage.cache_write_tokens,
                ),
            )
            if result.stop_reason not in _CONTINUE_STOPS or (
                result.stop_reason == "tool_use" and not result.tool_uses
            ):
                return TurnOutcome("completed", stop_reason=result.stop_reason)
        return TurnOutcome(
            "failed",
            reason="max_rounds",
            error=f"the turn used all {caps.MAX_MODEL_ROUNDS} model rounds without finishing",
        )

    async def _round(
        self, record: TurnRecord, rnd: int, history: SessionHistory, tools: NotesTools
    ) -> RoundResult:
        user, session, tid = record.userId, record.sessionId, record.turnId
        envelope = await self.store.read(user, session)
        if envelope is None:
            raise SessionNotFound(session)
        meta = envelope.meta
        notes = tools.in_turn_notes if tools.has_in_turn_notes else meta.workingNotes
        fold = {"persona": meta.personaSnapshot, "notes": notes, "skills": meta.attachedSkills}
        request = ModelRequest(
            system_blocks=resolve_system_blocks(**fold),
            system=resolve_system(**fold),
            messages=history.model_messages(),
            tools=list(NOTES_TOOL_SPECS),
            model=meta.selectedModel,
            max_tokens=self.settings.anthropic_max_tokens,
            reasoning_effort=meta.reasoningEffort,
        )
        await self.turns.append_event(
            user, session, tid, RoundStarted(turnId=tid, round=rnd, at=now_ms())
        )
        if self.metrics is not None:
            self.metrics.rounds.inc()
        writer = _DeltaWriter(self.turns, user, session, tid, rnd)
        result: RoundResult | None = None
        stream = self.model.stream_round(request)
        try:
            async for item in stream:
                if isinstance(item, TextChunk):
                    await writer.add(item.text)
                elif isinstance(item, RoundResult):
                    result = item
            await writer.close()
        finally:
            writer.abort()
            await _close_stream(stream)
        if result is None:
            raise ModelError("provider_error", "the model stream ended without a result")
        return result

    async def _run_tools(
        self, record: TurnRecord, rnd: int, result: RoundResult, tools: NotesTools
    ) -> list[dict[str, Any]]:
        """Execute every tool_use of the round (a stored tool_use always gets its result)."""
        user, session, tid = record.userId, record.sessionId, record.turnId
        results: list[dict[str, Any]] = []
        for use in result.tool_uses:
            await self.turns.append_event(
                user,
                session,
                tid,
                ToolCall(turnId=tid, round=rnd, callId=use.id, name=use.name, input=use.input),
            )
            outcome = await tools.execute(use.name, use.input)
            if self.metrics is not None:
                label = use.name if use.name in NOTES_TOOL_NAMES else "unknown"
                self.metrics.tool_calls.labels(label).inc()
            output, truncated = truncate_tool_result(outcome.output)
            await self.turns.append_event(
                user,
                session,
                tid,
                ToolResult(
                    turnId=tid,
                    round=rnd,
                    callId=use.id,
                    name=use.name,
                    output=output,
                    isError=outcome.is_error,
                    truncated=truncated,
                ),
            )
            block: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": use.id,
                "content": output,
            }
            if outcome.is_error:
                block["is_error"] = True
            results.append(block)
        return results

    # -- finish --------------------------------------------------------------------------

    async def finish(
        self,
        record: TurnRecord,
        outcome: TurnOutcome,
        usage: UsageCounts,
        *,
        lease_token: str | None,
    ) -> bool:
        """Write the final status through the overlay, then the one terminal event.

        The envelope's status is written only while ``lease_token`` holds the session
        lease (``None``: never): a turn ended without it must not overwrite the status of
        the turn that may be running.
        Returns ``False`` when the turn had already ended (nothing was written by finalize).
        """
        user, session, tid = record.userId, record.sessionId, record.turnId
        at = now_ms()
        event: Event
        if outcome.status == "completed":
            event = TurnCompleted(turnId=tid, stopReason=outcome.stop_reason or "end_turn", at=at)
        elif outcome.status == "cancelled":
            event = TurnCancelled(turnId=tid, at=at)
        elif outcome.status == "timed_out":
            event = TurnTimedOut(turnId=tid, at=at)
        else:
            event = TurnFailed(
                turnId=tid, reason=outcome.reason or "internal", message=outcome.error or "", at=at
            )
        usage_text = usage_json(usage)
        if lease_token is not None:
            await self._overlay(
                user,
                session,
                {"turnRunId": tid, "turnStatus": outcome.status, "usage": usage_text},
                lease_token,
            )
        entry = await self.turns.finalize(
            user,
            session,
            tid,
            event,
            status=outcome.status,  # type: ignore[arg-type]
            reason=outcome.reason,
            error=outcome.error,
            stop_reason=outcome.stop_reason,
            usage=usage_text,
        )
        return entry is not None

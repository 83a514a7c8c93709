"""The rounds of one attempt: the model streamed, the tools run, the rows of history.

Each round's system prompt is built from the envelope as it was after the previous
round (``resolve_system``), so a note written in round k is in round k+1's system
prompt. Events are written in batches: the round's last text, its tool results, its
usage and the next round's start go with the round's commit (one script,
:meth:`TurnCommit.commit_round`), which also stores the round's notes write and returns
the envelope when another writer changed it. The last round's rows and events go with
the finish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
from redis.exceptions import RedisError

from turnbus.shared import caps, tracing
from turnbus.shared.envelope import Envelope, EnvelopeStore, SessionNotFound, envelope_from_hash
from turnbus.shared.events import (
    Event,
    RoundStarted,
    RoundWaiting,
    TextDelta,
    ToolResult,
    Usage,
    WorkingNotes,
    encode_event,
)
from turnbus.shared.meta import approval_tools, meta_bytes
from turnbus.shared.quotas import TOKENS, QuotaStore, counted_tokens
from turnbus.shared.records import PendingCall, TurnRecord, now_ms
from turnbus.shared.system import resolve_system_blocks
from turnbus.worker.cancellation import shield_until_done
from turnbus.worker.commit import (
    ACTION_CLOSED,
    RoundCalls,
    StoredResult,
    TurnCommit,
    round_calls_from,
)
from turnbus.worker.events_out import EventWriter
from turnbus.worker.health import WorkerMetrics
from turnbus.worker.history import HistoryFenced, SessionHistory, assistant_row, stored_row
from turnbus.worker.lease import SessionLease
from turnbus.worker.models.base import (
    ModelClient,
    ModelError,
    ModelRequest,
    ModelWaiting,
    RoundResult,
    TextChunk,
    ToolUse,
    UsageCounts,
)
from turnbus.worker.models.router import provider_and_model
from turnbus.worker.outcome import TurnOutcome
from turnbus.worker.pipeline import CANCELLED, RoundTools, ToolPipeline
from turnbus.worker.registry import ToolRegistry
from turnbus.worker.tools import NOTES_UPDATED_NOT_PERSISTED, NotesTools

log = logging.getLogger(__name__)

__all__ = [
    "DELTA_FLUSH_BYTES",
    "DELTA_FLUSH_S",
    "AttemptState",
    "CutRound",
    "RoundRunner",
    "other_meta_bytes",
    "set_usage",
]

_json = msgspec.json.Encoder()
# A model round's span (GenAI conventions: ``chat {model}``, named once the model is known).
ROUND_SPAN = "chat"
DELTA_FLUSH_S = 0.05
DELTA_FLUSH_BYTES = 512
# Stop reasons after which the model goes on: another round follows (a tool_use without
# tool calls ends the turn all the same).
_CONTINUE_STOPS = frozenset({"tool_use", "pause_turn"})


def other_meta_bytes(flat: dict[str, str]) -> int:
    """The bytes the budget counts for an envelope's keys other than the notes (as the
    scripts count them: every key but createdAt and updatedAt, names and values)."""
    return meta_bytes(
        {k: v for k, v in flat.items() if k not in ("createdAt", "updatedAt", "workingNotes")}
    )


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
            return _round_rows(turn_id, self.round, self.result, results, [])
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
    # The start script announced round 1 (the turn's first attempt).
    round_announced: bool = False
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


def _meta_bytes_of(state: weakref.ref[AttemptState]) -> Callable[[], int]:
    """The notes tools' view of the attempt's ``meta_bytes``, through a weak reference:
    the state holds the tools, so a closure over the state would make a cycle of every
    attempt's objects that only the garbage collector frees, in passes that stop the
    worker for tens of milliseconds once hundreds of turns have ended."""

    def current() -> int:
        alive = state()
        return alive.meta_bytes if alive is not None else 0

    return current


class DeltaWriter:
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

    def abort(self) -> list[Event]:
        """Stop; returns the text not handed over, as an event (none if empty)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._timed_flush is not None:
            self._timed_flush.cancel()
        event = self._event()
        return [event] if event is not None else []


async def _close_stream(stream: object) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def _prompt_row(record: TurnRecord) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": record.message}],
        "turnId": record.turnId,
        "round": 0,
        "kind": "prompt",
    }


def _round_rows(
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


def set_usage(span: tracing.Span, usage: UsageCounts) -> None:
    """A round's (or a turn's) token counts, as the GenAI conventions name them."""
    span.set("gen_ai.usage.input_tokens", usage.input_tokens)
    span.set("gen_ai.usage.output_tokens", usage.output_tokens)
    span.set("gen_ai.usage.cache_read.input_tokens", usage.cache_read_tokens)
    span.set("gen_ai.usage.cache_creation.input_tokens", usage.cache_write_tokens)


def _content_json(content: object) -> str:
    """Messages or content blocks as a span attribute (captured content only)."""
    return _json.encode(content).decode()


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
        # The rounds run on the commit's client, keys, settings and retries.
        self.commit = commit
        self.redis = commit.redis
        self.keys = commit.keys
        self.settings = commit.settings
        self.retry = commit.retry
        self.model = model
        self.store = store
        self.quotas = QuotaStore(commit.redis, commit.keys)
        self.metrics = metrics
        self.events = EventWriter(commit.redis, commit.settings.events_maxlen)
        self.tools = tools or ToolRegistry()
        self.pipeline = ToolPipeline(self.tools, commit, metrics=metrics)

    async def play(self, state: AttemptState) -> TurnOutcome:
        """Play the turn's rounds until it ends (from the last committed one). The last
        round's rows and events stay in ``state`` for the finish."""
        record = state.record
        tid = record.turnId
        progress = state.history.progress(tid)
        if not progress.has_prompt:
            # Stored with the first commit (or the finish): one call fewer per turn.
            state.pending_rows.append(_prompt_row(record))
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
            fold=_meta_bytes_of(weakref.ref(state)) if self.settings.wait_replicas <= 0 else None,
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
            # attempt by the start script.
            announced = (rnd == 1 and state.round_announced) or (
                resumed is not None and resumed.paused  # announced before the pause
            )
            if rnd == first and not announced:
                state.outbox.append(RoundStarted(turnId=tid, round=rnd, at=now_ms()))
                await shield_until_done(self.flush(state))
            if resumed is not None and rnd == first:
                result = _resumed_round(resumed.assistant, resumed.approved)
            else:
                result = await self._round(state, rnd, tools)
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
                return await self._pause(state, rnd, result, done)
            rows = _round_rows(tid, rnd, result, results, notes_results)
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
            await shield_until_done(self.commit_round(state, rows))
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
        except (RedisError, OSError):
            log.warning("turn %s: %d tokens not counted in its user's quota", record.turnId, tokens)

    async def _round(self, state: AttemptState, rnd: int, tools: NotesTools) -> RoundResult:
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
            tools=self.tools.offer_to_turn(
                meta.allowedTools, record.allowedTools, record.clientTools
            )[0],
            model=meta.selectedModel,
            max_tokens=self.settings.anthropic_max_tokens,
            reasoning_effort=meta.reasoningEffort,
        )
        if self.metrics is not None:
            self.metrics.rounds.inc()
        with tracing.span(ROUND_SPAN, kind="client") as span:
            if span.recording:
                self._round_attributes(span, request, tid, rnd)
            try:
                result = await self._stream(state, request, rnd)
            except ModelError as exc:
                span.failed(exc.reason)
                raise
            if span.recording:
                span.set("gen_ai.response.finish_reasons", [result.stop_reason])
                set_usage(span, result.usage)
                if tracing.capture_content():
                    span.set("gen_ai.output.messages", _content_json(result.content))
        return result

    def _round_attributes(
        self, span: tracing.Span, request: ModelRequest, turn_id: str, rnd: int
    ) -> None:
        provider, model = provider_and_model(self.settings, request.model)
        span.rename(f"chat {model}")
        span.set("gen_ai.operation.name", "chat")
        span.set("gen_ai.provider.name", provider)
        span.set("gen_ai.request.model", model)
        span.set("gen_ai.request.max_tokens", request.max_tokens)
        span.set("turnbus.turn.id", turn_id)
        span.set("turnbus.round", rnd)
        if tracing.capture_content():
            span.set("gen_ai.system_instructions", request.system)
            span.set("gen_ai.input.messages", _content_json(request.messages))

    async def _stream(self, state: AttemptState, request: ModelRequest, rnd: int) -> RoundResult:
        """One round's model stream: its text as coalesced ``text.delta`` events, a wait
        announced; its result."""
        tid = state.record.turnId
        writer = DeltaWriter(lambda data: self._append(state, "text", data), tid, rnd)
        result: RoundResult | None = None
        cut = state.cut = CutRound(rnd)
        stream = self.model.stream_round(request)
        try:
            async for item in stream:
                if isinstance(item, TextChunk):
                    cut.parts.append(item.text)
                    await writer.add(item.text)
                elif isinstance(item, RoundResult):
                    result = cut.result = item
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
                    await shield_until_done(self.flush(state))
            state.outbox.extend(await writer.take())
        finally:
            cut.unsent = writer.abort()
            await _close_stream(stream)
        if result is None:
            raise ModelError("provider_error", "the model stream ended without a result")
        return result

    async def flush(self, state: AttemptState) -> None:
        """Write the events waiting in the outbox, in one round trip (shared with the
        other turns' writes of the same moment)."""
        if not state.outbox:
            return
        await self._append(state, "events", [encode_event(event) for event in state.outbox])
        state.outbox.clear()

    async def _append(self, state: AttemptState, what: str, data: list[bytes]) -> None:
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
                _round_rows(tid, rnd, result, closed.results, closed.notes_results)
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

    async def _pause(
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
        closing = _round_rows(tid, rnd, result, ordered, done.notes_results)
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

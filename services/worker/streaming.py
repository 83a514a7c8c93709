"""One model round of a turn (:class:`ModelRound`): its request built from a fresh
envelope (``resolve_system``: a note written in round k is in round k+1's system
prompt), the model's stream read, its text written as coalesced ``text.delta`` events
(:class:`DeltaWriter`), its span.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec

from turnbus.shared import tracing
from turnbus.shared.events import Event, RoundWaiting, TextDelta, encode_event
from turnbus.shared.records import now_ms
from turnbus.shared.settings import Settings
from turnbus.shared.system import resolve_system_blocks
from turnbus.worker.cancellation import shield_until_done
from turnbus.worker.health import WorkerMetrics
from turnbus.worker.models.base import (
    ModelClient,
    ModelError,
    ModelRequest,
    ModelWaiting,
    RoundResult,
    TextChunk,
    UsageCounts,
)
from turnbus.worker.models.router import provider_and_model
from turnbus.worker.registry import ToolRegistry
from turnbus.worker.round_writes import RoundWrites
from turnbus.worker.state import AttemptState, CutRound
from turnbus.worker.tools import NotesTools

__all__ = ["DELTA_FLUSH_BYTES", "DELTA_FLUSH_S", "DeltaWriter", "ModelRound", "set_usage"]

_json = msgspec.json.Encoder()
# A model round's span (GenAI conventions: ``chat {model}``, named once the model is known).
ROUND_SPAN = "chat"
DELTA_FLUSH_S = 0.05
DELTA_FLUSH_BYTES = 512


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


def set_usage(span: tracing.Span, usage: UsageCounts) -> None:
    """A round's (or a turn's) token counts, as the GenAI conventions name them."""
    span.set("gen_ai.usage.input_tokens", usage.input_tokens)
    span.set("gen_ai.usage.output_tokens", usage.output_tokens)
    span.set("gen_ai.usage.cache_read.input_tokens", usage.cache_read_tokens)
    span.set("gen_ai.usage.cache_creation.input_tokens", usage.cache_write_tokens)


def _content_json(content: object) -> str:
    """Messages or content blocks as a span attribute (captured content only)."""
    return _json.encode(content).decode()


class ModelRound:
    """Plays one model round of a turn; shared by all the turns of a worker."""

    def __init__(
        self,
        model: ModelClient,
        settings: Settings,
        *,
        tools: ToolRegistry,
        writes: RoundWrites,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.model = model
        self.settings = settings
        self.tools = tools
        self.writes = writes
        self.metrics = metrics

    async def run(self, state: AttemptState, rnd: int, tools: NotesTools) -> RoundResult:
        """Ask the model for round ``rnd`` and read its stream; its result."""
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
        writer = DeltaWriter(lambda data: self.writes.append(state, "text", data), tid, rnd)
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
                    await shield_until_done(self.writes.flush(state))
            state.outbox.extend(await writer.take())
        finally:
            cut.unsent = writer.abort()
            await _close_stream(stream)
        if result is None:
            raise ModelError("provider_error", "the model stream ended without a result")
        return result

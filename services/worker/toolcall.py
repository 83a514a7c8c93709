"""One tool call of a round (:class:`CallRunner`): bounded in time and size, its
failure an error result (:class:`CallOutcome`), its span; a side-effecting call's
result stored before it is handed back (:meth:`TurnCommit.record_result`). Which calls
run, and in what order, is the round's (:mod:`turnbus.worker.pipeline`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable

import msgspec

from turnbus.shared import tracing
from turnbus.shared.events import ToolResult
from turnbus.worker.cancellation import shield_until_done
from turnbus.worker.commit import TurnCommit
from turnbus.worker.history import truncate_tool_result
from turnbus.worker.lease import SessionLease
from turnbus.worker.models.base import ToolUse
from turnbus.worker.tools import NotesTools, redact_notes
from turnbus.worker.toolsource import RegisteredTool, ToolContext, ToolSource

__all__ = ["TOOL_SPAN", "CallOutcome", "CallRunner", "result_event", "trace_settled"]

log = logging.getLogger(__name__)

_RAISED = "ERROR {name} raised {kind}: {message}"
_TIMED_OUT = "ERROR {name} timed out after {timeout:g} s (the call was cancelled)"
# A tool call's span (GenAI conventions: ``execute_tool {name}``, named when it opens).
TOOL_SPAN = "execute_tool"
_json = msgspec.json.Encoder()


@dataclasses.dataclass(slots=True)
class CallOutcome:
    """One call's result as the model, the events and the metrics see it."""

    output: str
    is_error: bool = False
    truncated: bool = False
    outcome: str = "ok"  # the metrics' label: ok, error, timeout, exception, invalid, ...
    duration_ms: int = 0
    holds_notes: bool = False  # the output is the notes' text (stored as its digest)
    deferred: bool = False  # a notes write held for the round's commit
    evented: bool = False  # its tool.result event is written already


class CallRunner:
    """Runs single tool calls for every turn of a worker."""

    def __init__(self, commit: TurnCommit) -> None:
        self.commit = commit

    async def notes_call(self, notes: NotesTools, use: ToolUse, turn_id: str) -> CallOutcome:
        """A notes tool's call (the notes tools run one after the other)."""
        return await _traced(use, turn_id, self._run_notes_call(notes, use))

    async def _run_notes_call(self, notes: NotesTools, use: ToolUse) -> CallOutcome:
        began = time.monotonic()
        outcome = await notes.execute(use.name, use.input)
        output, truncated = truncate_tool_result(outcome.output, outcome.max_bytes)
        return CallOutcome(
            output,
            is_error=outcome.is_error,
            truncated=truncated,
            outcome="error" if outcome.is_error else "ok",
            duration_ms=int((time.monotonic() - began) * 1000),
            holds_notes=outcome.holds_notes,
            deferred=outcome.deferred,
        )

    async def call(
        self,
        tool: RegisteredTool,
        source: ToolSource,
        use: ToolUse,
        context: ToolContext,
        *,
        rnd: int,
        lease: SessionLease,
    ) -> CallOutcome:
        """One call, bounded in time and size; its failure is an error result. A
        side-effecting call's result is stored before it is handed back."""

        async def run() -> CallOutcome:
            outcome = await self._bounded(tool, source, use, context)
            if not tool.idempotent:
                event = result_event(context.turn_id, rnd, use, outcome)
                await shield_until_done(
                    self.commit.record_result(
                        context.user_id,
                        context.session_id,
                        context.turn_id,
                        lease=lease,
                        call_id=use.id,
                        output=outcome.output,
                        is_error=outcome.is_error,
                        truncated=outcome.truncated,
                        event=event,
                    )
                )
                outcome.evented = True
            return outcome

        return await _traced(use, context.turn_id, run())

    async def _bounded(
        self, tool: RegisteredTool, source: ToolSource, use: ToolUse, context: ToolContext
    ) -> CallOutcome:
        """The tool's own call under its timeout; whatever it raises is its result."""
        began = time.monotonic()
        scope = asyncio.timeout(tool.timeout_s)
        try:
            async with scope:
                reply = await source.call(tool, use.input, context)
            output, truncated = truncate_tool_result(reply.output, tool.max_result_bytes)
            outcome = CallOutcome(
                output,
                is_error=reply.is_error,
                truncated=truncated,
                outcome="error" if reply.is_error else "ok",
            )
        except TimeoutError as exc:
            if not scope.expired():  # the tool's own TimeoutError, not its bound
                outcome = self._raised(tool, use, exc)
            else:
                outcome = CallOutcome(
                    _TIMED_OUT.format(name=tool.name, timeout=tool.timeout_s),
                    is_error=True,
                    outcome="timeout",
                )
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the turn's cancel (or its wall clock): the round closes the call
            outcome = self._raised(tool, use, exc)  # the tool's own CancelledError
        except (Exception, SystemExit, KeyboardInterrupt) as exc:
            # The user's code: whatever it raises is its result, never the worker's end.
            outcome = self._raised(tool, use, exc)
        outcome.duration_ms = int((time.monotonic() - began) * 1000)
        return outcome

    def _raised(self, tool: RegisteredTool, use: ToolUse, exc: BaseException) -> CallOutcome:
        log.warning("tool %s raised (call %s)", tool.name, use.id, exc_info=exc)
        output, truncated = truncate_tool_result(
            _RAISED.format(name=tool.name, kind=type(exc).__name__, message=exc)
        )
        return CallOutcome(output, is_error=True, truncated=truncated, outcome="exception")


async def _traced(use: ToolUse, turn_id: str, run: Awaitable[CallOutcome]) -> CallOutcome:
    """A call run in its span."""
    with tracing.span(TOOL_SPAN) as span:
        if span.recording:
            tool_started(span, use, turn_id)
        outcome = await run
        if span.recording:
            tool_ended(span, outcome)
        return outcome


def tool_started(span: tracing.Span, use: ToolUse, turn_id: str) -> None:
    span.rename(f"execute_tool {use.name}")
    span.set("gen_ai.operation.name", "execute_tool")
    span.set("gen_ai.tool.name", use.name)
    span.set("gen_ai.tool.call.id", use.id)
    span.set("gen_ai.tool.type", "function")
    span.set("turnbus.turn.id", turn_id)
    if tracing.capture_content():
        span.set("gen_ai.tool.call.arguments", _json.encode(use.input).decode())


def tool_ended(span: tracing.Span, outcome: CallOutcome) -> None:
    span.set("turnbus.tool.outcome", outcome.outcome)
    if outcome.is_error:
        span.failed(outcome.outcome)
    if tracing.capture_content():
        span.set("gen_ai.tool.call.result", outcome.output)


def trace_settled(use: ToolUse, turn_id: str, outcome: CallOutcome) -> None:
    """The span of a call settled without running (refused, invalid, a stored result)."""
    with tracing.span(TOOL_SPAN) as span:
        if span.recording:
            tool_started(span, use, turn_id)
            tool_ended(span, outcome)


def result_event(turn_id: str, rnd: int, use: ToolUse, outcome: CallOutcome) -> ToolResult:
    return ToolResult(
        turnId=turn_id,
        round=rnd,
        callId=use.id,
        name=use.name,
        output=redact_notes(outcome.output) if outcome.holds_notes else outcome.output,
        isError=outcome.is_error,
        truncated=outcome.truncated,
        durationMs=outcome.duration_ms,
    )

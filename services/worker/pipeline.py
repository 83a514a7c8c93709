"""A round's tool calls: checked, run concurrently, each bounded, one result each.

Every ``tool_use`` of a round gets exactly one ``tool_result``, in the model's order,
whatever happens to its call:

- a tool the session may not use (unknown, or not in its ``allowedTools``): an error
  result naming the tools it has;
- input that fails the tool's JSON Schema: an error result naming the field;
- an exception: an error result with its type and message (the traceback goes to the
  worker's log only);
- past the tool's ``timeout_s``: an error result (the call is cancelled);
- a cancel of the turn (or its wall clock): a synthetic "cancelled" result for each call
  not finished, stored with the turn's end, so the history never holds a ``tool_use``
  without its result.

Results are cut to the tool's ``max_result_bytes`` with the ``[truncated: …]`` marker.
The notes tools run in the model's order, one after the other; the others concurrently.

**Crash safety.** Before the round's first call to a registered tool starts, one call
(:meth:`TurnCommit.record_intent`, fenced by the session lease) stores the round's
assistant message, with its ``tool_use`` blocks, and the intent of each side-effecting
call, and writes the round's events so far (``tool.call`` among them). A side-effecting
call's result is stored as soon as it is known (:meth:`TurnCommit.record_result`, with
its ``tool.result`` event). An attempt resumed after a lost worker carries on with that
round instead of asking the model again (:class:`RoundCalls`): a stored result is
reused; a side-effecting call with an intent and no result is not run again and gets
:data:`OUTCOME_UNKNOWN`; an idempotent call runs again with the same call id (its key).
The results reach the history with the round's commit, as every round's do.

**Approvals.** A call to a tool that requires approval (the tool's own flag, or the
session's ``approval`` names) is left pending, as a client tool's call is, and the turn
pauses. The resumed round runs it when the approver let it (``RoundCalls.approved``,
an edit's input already in the round), its intent stored first as for any call
(:meth:`TurnCommit.record_approved`); a rejected one's answer is its stored error result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jsonschema  # type: ignore[import-untyped]

from turnbus.shared.events import Event, ToolCall
from turnbus.shared.records import ClientTool
from turnbus.worker.cancellation import shield_until_done
from turnbus.worker.commit import RoundCalls, TurnCommit
from turnbus.worker.health import WorkerMetrics
from turnbus.worker.history import assistant_row, stored_row, truncate_tool_result
from turnbus.worker.lease import SessionLease
from turnbus.worker.models.base import RoundResult, ToolUse
from turnbus.worker.registry import ToolRegistry
from turnbus.worker.toolcall import CallOutcome, CallRunner, result_event, trace_settled
from turnbus.worker.tools import NOTES_TOOL_NAMES, NotesTools, redact_notes, redact_tool_input
from turnbus.worker.toolsource import RegisteredTool, ToolContext, ToolSource

__all__ = [
    "CANCELLED",
    "NOTES_LOST",
    "OUTCOME_UNKNOWN",
    "RoundTools",
    "ToolPipeline",
]

log = logging.getLogger(__name__)

OUTCOME_UNKNOWN = (
    "the outcome of this call is unknown: the worker running it was lost before it "
    "reported; check before retrying"
)
CANCELLED = "cancelled: the turn ended before this call finished"
NOTES_LOST = (
    "ERROR working_notes_update: the worker running this call was lost before the notes "
    "were stored; call it again to store them"
)
_NOT_AVAILABLE = "ERROR tool {name!r} is not available in this session; its tools are: {names}"
_INVALID = "ERROR invalid input for {name}: {message}"


@dataclasses.dataclass(slots=True)
class RoundTools:
    """What one round's calls left: the tool_result blocks in the model's order, the
    ids whose result is the notes' text, and those whose notes write awaits the commit;
    ``pending``: the calls that wait for the caller, to the turn's client tools or
    waiting for an approval (``approval``: their ids); their results are not among
    ``results``: the turn pauses."""

    results: list[dict[str, Any]]
    notes_results: list[str]
    held_calls: list[str]
    pending: list[ToolUse] = dataclasses.field(default_factory=list)
    approval: frozenset[str] = frozenset()


def _first_error(validator: Any, value: Any) -> str | None:
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return None
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    return f"{error.message} (at `${path}`)"


class ToolPipeline:
    """Runs the rounds' tool calls of every turn of a worker."""

    def __init__(
        self,
        registry: ToolRegistry,
        commit: TurnCommit,
        *,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.registry = registry
        self.commit = commit
        self.metrics = metrics
        self.calls = CallRunner(commit)
        self._validators: dict[str, Any] = {}

    def _validator(self, tool: RegisteredTool) -> Any:
        validator = self._validators.get(tool.name)
        if validator is None:
            cls = jsonschema.validators.validator_for(tool.input_schema)
            validator = self._validators[tool.name] = cls(tool.input_schema)
        return validator

    async def run(
        self,
        *,
        user: str,
        session: str,
        turn_id: str,
        rnd: int,
        lease: SessionLease,
        result: RoundResult,
        notes: NotesTools,
        allowed: frozenset[str],
        outbox: list[Event],
        on_cancel: Callable[[RoundTools], None],
        resumed: RoundCalls | None = None,
        client: Mapping[str, ClientTool] | None = None,
        approval: frozenset[str] = frozenset(),
    ) -> RoundTools:
        """Run the round's calls; returns their results in the model's order. ``outbox``
        holds the events not written yet (the intent write takes them along); on a
        cancel, ``on_cancel`` gets the round's results with the unfinished calls closed
        as cancelled, before the cancel goes on. ``client``: the turn's client tools
        (by name); a valid call to one is left pending (``RoundTools.pending``) unless
        a previous attempt stored its answer. So is a call to a tool that requires
        approval (its own flag, or among ``approval``) that no approver has let run."""
        uses = result.tool_uses
        client = client or {}
        outcomes: list[CallOutcome | None] = [None] * len(uses)
        runnable: dict[int, tuple[RegisteredTool, ToolSource]] = {}
        notes_calls: list[int] = []
        pending: list[int] = []
        waiting: set[str] = set()
        approved: list[int] = []
        for i, use in enumerate(uses):
            if resumed is None:
                outbox.append(
                    ToolCall(
                        turnId=turn_id,
                        round=rnd,
                        callId=use.id,
                        name=use.name,
                        input=redact_tool_input(use.name, use.input),
                    )
                )
            outcome = self._check(use, allowed, resumed, client)
            if outcome is not None:
                outcomes[i] = outcome
                trace_settled(use, turn_id, outcome)
            elif use.name in client:
                pending.append(i)
            elif use.name in NOTES_TOOL_NAMES:
                notes_calls.append(i)
            else:
                found = self.registry.get(use.name)
                assert found is not None  # _check refused it otherwise
                if found[0].requires_approval or use.name in approval:
                    if resumed is None or use.id not in resumed.approved:
                        pending.append(i)
                        waiting.add(use.id)
                        continue
                    approved.append(i)
                runnable[i] = found
        approved_side = [uses[i].id for i in approved if not runnable[i][0].idempotent]
        if approved_side:
            # Run after the approver's answer: the intent first, as before any call.
            events = list(outbox)
            outbox.clear()
            await shield_until_done(
                self.commit.record_approved(
                    user,
                    session,
                    turn_id,
                    lease=lease,
                    side_effecting=approved_side,
                    events=events,
                )
            )
        if runnable and resumed is None:
            side_effecting = [uses[i].id for i, (t, _) in runnable.items() if not t.idempotent]
            events = list(outbox)
            outbox.clear()
            row = stored_row(assistant_row(turn_id, rnd, result.content, result.stop_reason))
            await shield_until_done(
                self.commit.record_intent(
                    user,
                    session,
                    turn_id,
                    lease=lease,
                    rnd=rnd,
                    assistant=row,
                    side_effecting=side_effecting,
                    events=events,
                )
            )
        tasks: dict[int, asyncio.Task[CallOutcome]] = {}
        loop = asyncio.get_running_loop()
        for i, (tool, source) in runnable.items():
            context = ToolContext(
                user_id=user, session_id=session, turn_id=turn_id, call_id=uses[i].id
            )
            coro = self.calls.call(tool, source, uses[i], context, rnd=rnd, lease=lease)
            tasks[i] = loop.create_task(coro, name=f"tool:{tool.name}:{uses[i].id}")
        try:
            for i in notes_calls:
                outcomes[i] = await self.calls.notes_call(notes, uses[i], turn_id)
            for i, task in tasks.items():
                outcomes[i] = await task
        except BaseException as exc:
            for task in tasks.values():
                task.cancel()
            if isinstance(exc, asyncio.CancelledError):
                for i, task in tasks.items():
                    if task.done() and not task.cancelled() and task.exception() is None:
                        outcomes[i] = task.result()
                closed = [
                    o
                    if o is not None
                    else CallOutcome(CANCELLED, is_error=True, outcome="cancelled")
                    for o in outcomes
                ]
                on_cancel(self._gather(turn_id, rnd, uses, closed, outbox))
            raise
        assert len([o for o in outcomes if o is not None]) + len(pending) == len(uses)
        tools = self._gather(turn_id, rnd, uses, outcomes, outbox)
        tools.pending = [uses[i] for i in pending]
        tools.approval = frozenset(waiting)
        return tools

    def _check(
        self,
        use: ToolUse,
        allowed: frozenset[str],
        resumed: RoundCalls | None,
        client: Mapping[str, ClientTool],
    ) -> CallOutcome | None:
        """The outcome a call gets without running: refused, invalid, or settled by a
        previous attempt of the turn (``resumed``) or by the caller's answer; ``None``:
        it runs (or, for a client tool, waits for the caller)."""
        if use.name not in allowed or (
            use.name not in NOTES_TOOL_NAMES
            and use.name not in client
            and self.registry.get(use.name) is None
        ):
            names = ", ".join(sorted(allowed))
            output, truncated = truncate_tool_result(
                _NOT_AVAILABLE.format(name=use.name, names=names)
            )
            return CallOutcome(output, is_error=True, truncated=truncated, outcome="refused")
        if resumed is not None:
            stored = resumed.results.get(use.id)
            if stored is not None:
                return CallOutcome(
                    stored.output,
                    is_error=stored.is_error,
                    truncated=stored.truncated,
                    outcome="reused",
                    evented=True,
                )
            if use.id in resumed.intents:
                return CallOutcome(OUTCOME_UNKNOWN, is_error=True, outcome="unknown_outcome")
            if use.name == "working_notes_update" and _redacted_notes(use.input):
                return CallOutcome(NOTES_LOST, is_error=True, outcome="lost")
        if use.input_error is not None:
            # The provider could not read the call's arguments (invalid JSON, not an
            # object): the model hears why, and the tool does not run.
            output, truncated = truncate_tool_result(f"{use.name}: {use.input_error}")
            return CallOutcome(output, is_error=True, truncated=truncated, outcome="invalid")
        if use.name in NOTES_TOOL_NAMES:
            return None
        if use.name in client:
            schema = client[use.name].inputSchema
            validator = jsonschema.validators.validator_for(schema)(schema)
            message = _first_error(validator, use.input)
        else:
            found = self.registry.get(use.name)
            assert found is not None
            message = _first_error(self._validator(found[0]), use.input)
        if message is not None:
            output, truncated = truncate_tool_result(
                _INVALID.format(name=use.name, message=message)
            )
            return CallOutcome(output, is_error=True, truncated=truncated, outcome="invalid")
        return None

    def _gather(
        self,
        turn_id: str,
        rnd: int,
        uses: list[ToolUse],
        outcomes: Sequence[CallOutcome | None],
        outbox: list[Event],
    ) -> RoundTools:
        """The settled calls' results and events (a call still pending has none)."""
        tools = RoundTools(results=[], notes_results=[], held_calls=[])
        for use, outcome in zip(uses, outcomes, strict=True):
            if outcome is None:
                continue
            if self.metrics is not None:
                known = use.name in NOTES_TOOL_NAMES or self.registry.get(use.name) is not None
                label = use.name if known else "unknown"  # the model's names are unbounded
                self.metrics.tool_calls.labels(label, outcome.outcome).inc()
                self.metrics.tool_seconds.labels(label, outcome.outcome).observe(
                    outcome.duration_ms / 1000
                )
            if outcome.holds_notes:
                tools.notes_results.append(use.id)
            if outcome.deferred:
                tools.held_calls.append(use.id)
            if not outcome.evented:
                outbox.append(result_event(turn_id, rnd, use, outcome))
            block: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": use.id,
                "content": outcome.output,
            }
            if outcome.is_error:
                block["is_error"] = True
            tools.results.append(block)
        return tools


def _redacted_notes(tool_input: dict[str, Any]) -> bool:
    notes = tool_input.get("notes")
    return isinstance(notes, str) and redact_notes(notes) == notes

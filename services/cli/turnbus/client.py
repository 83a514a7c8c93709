"""A Python client of the turnbus HTTP API, sync (:class:`Client`) and async (:class:`AsyncClient`).

Built on ``httpx``, which turnbus already depends on (nothing more to install)::

    from turnbus import Client

    with Client("http://127.0.0.1:8000", token) as tb:
        session = tb.create_session()
        turn = tb.submit_turn(session.session_id, "remember the build is green")
        for event in tb.events(session.session_id, turn.turn_id):
            print(event)

- Every turn is submitted with an ``Idempotency-Key`` (a fresh UUID unless you pass
  one), so a submit that is retried after a lost connection or a ``503`` gives the
  same turn, never a second one.
- :meth:`Client.events` yields the ``shared.events`` union (``TextDelta``,
  ``ToolCall``, ``WorkingNotes``, ``TurnCompleted``, …; ``UnknownEvent`` for a type
  this client does not know) and ends after the terminal event. When the stream
  breaks (a gateway restart, ``stream.dropped``, a network error) it reconnects with
  ``Last-Event-ID`` after a growing, jittered delay, so every event comes exactly once.
  A cursor older than the stream holds yields a :class:`~turnbus.shared.events.Resync` event
  first: rebuild whatever you derived from earlier events.
- A refused request raises an :class:`ApiError` subclass carrying the API's code, one
  class per code of the API (``ERROR_CLASSES``): :class:`SessionBusy` (``409``,
  ``active_turn_id``), :class:`TurnNotWaiting` (``409``, a :class:`Conflict`),
  :class:`SessionQueueFull` (``429``, ``retry_after`` seconds), :class:`QuotaExceeded`
  (``429``, ``field``, ``retry_after``), :class:`InvalidAnswer` (``422``, ``call_id``,
  an :class:`Unprocessable`), :class:`BadRequest`, :class:`NotFound`,
  :class:`Unauthorized`, :class:`Conflict`, :class:`PayloadTooLarge`,
  :class:`Unavailable`. A stream that cannot be resumed after ``max_reconnects`` tries
  in a row raises :class:`StreamLost`.

Both clients run the same calls and streams, written once without I/O in
:mod:`turnbus._client_core`; the classes here only do the I/O those ask for.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import httpx

from turnbus import _client_core as _core
from turnbus._client_core import (
    ERROR_CLASSES,
    ActiveTurn,
    ApiError,
    Approval,
    ApprovalAnswer,
    BadRequest,
    ClientToolFunction,
    ClientToolSpec,
    Conflict,
    InvalidAnswer,
    Multitask,
    Notes,
    NotFound,
    PayloadTooLarge,
    PendingCall,
    QuotaExceeded,
    Session,
    SessionBusy,
    SessionPage,
    SessionQueueFull,
    SessionSummary,
    StreamEvent,
    StreamLost,
    Tool,
    ToolResultAnswer,
    TurnAccepted,
    TurnbusError,
    TurnNotWaiting,
    TurnRecord,
    TurnUsage,
    TurnWebhook,
    Unauthorized,
    Unavailable,
    Unprocessable,
)
from turnbus.shared.events import TurnRequiresAction
from turnbus.shared.records import PendingCall as EventCall

# Decides a call that awaits approval: an Approval, or True (approve) / False (reject).
ApprovalCallback = Callable[[PendingCall], Approval | bool]
# The async client's may also be a coroutine function.
AsyncApprovalCallback = Callable[[PendingCall], Approval | bool | Awaitable[Approval | bool]]

__all__ = [
    "ERROR_CLASSES",
    "ActiveTurn",
    "ApiError",
    "Approval",
    "ApprovalAnswer",
    "ApprovalCallback",
    "AsyncApprovalCallback",
    "AsyncClient",
    "AsyncEventStream",
    "BadRequest",
    "Client",
    "ClientToolSpec",
    "Conflict",
    "EventStream",
    "InvalidAnswer",
    "NotFound",
    "Notes",
    "PayloadTooLarge",
    "PendingCall",
    "QuotaExceeded",
    "Session",
    "SessionBusy",
    "SessionPage",
    "SessionQueueFull",
    "SessionSummary",
    "StreamLost",
    "Tool",
    "ToolResultAnswer",
    "TurnAccepted",
    "TurnNotWaiting",
    "TurnRecord",
    "TurnUsage",
    "TurnWebhook",
    "TurnbusError",
    "Unauthorized",
    "Unavailable",
    "Unprocessable",
]

# A submit's client tools, by name: a function (its docstring and type hints describe it)
# or a declaration as it is.
ClientTools = Mapping[str, ClientToolFunction | ClientToolSpec]

T = TypeVar("T")
HttpT = TypeVar("HttpT", httpx.Client, httpx.AsyncClient)
TransportT = TypeVar("TransportT", httpx.BaseTransport, httpx.AsyncBaseTransport)


class _ClientBase(Generic[HttpT, TransportT]):
    """What both clients hold: the base URL, the core with its options, an httpx client."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 10.0,
        stream_read_timeout: float = 60.0,
        max_reconnects: int = 10,
        backoff_s: float = 0.2,
        backoff_max_s: float = 5.0,
        transport: TransportT | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._core = _core.ClientCore(
            stream_timeout=httpx.Timeout(timeout, read=stream_read_timeout),
            max_reconnects=max_reconnects,
            backoff_s=backoff_s,
            backoff_max_s=backoff_max_s,
        )
        self._http: HttpT = self._open(transport, base_url=self.base_url, timeout=timeout,
                                headers={"Authorization": f"Bearer {token}"})  # fmt: skip

    def _open(self, transport: TransportT | None, **options: Any) -> HttpT:
        raise NotImplementedError


# --- the sync client --------------------------------------------------------------------


def _do(http: httpx.Client, step: _core.Step) -> object:
    """One step of a flow, done with ``http``; its value."""
    match step:
        case _core.Send(request, stream):
            return http.send(request.build(http), stream=stream)
        case _core.Body(response, "lines"):
            return response.iter_lines()
        case _core.NextLine(lines):
            return next(lines, None)
        case _core.Body(response, "read"):
            return response.read()
        case _core.Body(response, "close"):
            response.close()
        case _core.Sleep(seconds):
            time.sleep(seconds)
        case _:
            raise TypeError(f"not an I/O step: {step!r}")
    return None


def _drive(http: httpx.Client, run: _core.Run[Any]) -> None:
    """Do the steps ``run`` asks for until its flow ends or emits an event."""
    while (step := run.next_step()) is not None:
        try:
            run.answer(_do(http, step))
        except BaseException as exc:  # the flow's to handle: it retries or raises it
            run.fail(exc)


def _pending(call: EventCall) -> PendingCall:
    """An event's pending call as the client's :class:`PendingCall`."""
    return PendingCall(call_id=call.callId, name=call.name, input=call.input, kind=call.kind)


def _pause_key(event: TurnRequiresAction) -> str:
    """The Idempotency-Key of the automatic answer to one pause: a retry (or a second
    sight of the same event) is a replay, never a second answer."""
    return f"auto:{event.turnId}:{event.round}:{event.at}"


class EventStream(_core.StreamView):
    """The events of one stream, as an iterator; reconnects by itself.

    ``last_event_id`` is the id of the last entry yielded (pass it as ``after=`` to
    pick up later); ``reconnects`` counts the reconnections so far. A stream of
    :meth:`Client.run_turn` with ``client_tools`` answers each ``turn.requires_action``
    before it yields it.
    """

    def __init__(
        self,
        http: httpx.Client,
        feed: _core.EventFeed,
        answer: Callable[[TurnRequiresAction], None] | None = None,
    ) -> None:
        super().__init__(feed)
        self._http = http
        self._answer = answer

    def __iter__(self) -> Iterator[StreamEvent]:
        return self

    def __next__(self) -> StreamEvent:
        _drive(self._http, self._run)
        if (event := self._run.event()) is None:
            raise StopIteration
        if self._answer is not None and isinstance(event, TurnRequiresAction):
            self._answer(event)
        return event

    def close(self) -> None:
        if (response := self._stop()) is not None:
            response.close()

    def __del__(self) -> None:
        self.close()  # a stream left unfinished lets its connection go, as a generator would


class Client(_ClientBase[httpx.Client, httpx.BaseTransport]):
    """A synchronous client; use it as a context manager or call :meth:`close`."""

    def _open(self, transport: httpx.BaseTransport | None, **options: Any) -> httpx.Client:
        return httpx.Client(transport=transport, **options)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _run(self, flow: _core.Flow[T]) -> T:
        run = _core.Run(flow)
        _drive(self._http, run)
        return run.result()

    # sessions

    def create_session(
        self, meta: Mapping[str, Any] | None = None, *, title: str | None = None
    ) -> Session:
        """A new session, with ``meta`` (host keys by their wire names) and ``title``.
        Untitled, it takes its title from its first turn's message."""
        return self._run(self._core.create_session(meta, title))

    def list_sessions(self, *, limit: int | None = None, cursor: str | None = None) -> SessionPage:
        """A page of your sessions, newest first; pass its ``next_cursor`` for the next page
        (``None`` on the last). ``limit``: 1 to 100, default 20."""
        return self._run(self._core.list_sessions(limit, cursor))

    def get_session(self, session_id: str) -> Session:
        return self._run(self._core.get_session(session_id))

    def delete_session(self, session_id: str) -> None:
        self._run(self._core.delete_session(session_id))

    def notes(self, session_id: str) -> Notes:
        return self._run(self._core.notes(session_id))

    def system(self, session_id: str) -> str:
        return self._run(self._core.system(session_id))

    def messages(self, session_id: str) -> list[dict[str, Any]]:
        return self._run(self._core.messages(session_id))

    def tools(self) -> list[Tool]:
        """The tools a session may be offered: the notes tools, then every tool a live
        worker registered (a session's ``allowedTools`` narrows them)."""
        return self._run(self._core.tools())

    # turns

    def submit_turn(self, session_id: str, message: str, *, multitask: Multitask = "reject",
                    idempotency_key: str | None = None,
                    client_tools: ClientTools | None = None) -> TurnAccepted:  # fmt: skip
        """Submit a turn; retried on a lost connection or a 503 under the same key.
        ``client_tools`` declares tools this caller runs (by name: a function, whose
        docstring and type hints describe it, or a :class:`ClientToolSpec`): a call to
        one pauses the turn until :meth:`submit_actions` answers it."""
        specs = _core.client_tool_specs(client_tools)
        return self._run(
            self._core.submit_turn(session_id, message, multitask, idempotency_key, specs)
        )

    def submit_actions(
        self,
        session_id: str,
        turn_id: str,
        *,
        tool_results: Sequence[ToolResultAnswer] = (),
        approvals: Sequence[ApprovalAnswer] = (),
        idempotency_key: str | None = None,
    ) -> TurnRecord:
        """Answer every call a paused turn waits on, at once: a result for each client
        call, a decision for each call awaiting approval; the turn record, queued again.
        Retried under the same key, so a retry answers as the first did."""
        return self._run(
            self._core.submit_actions(
                session_id, turn_id, list(tool_results), idempotency_key, list(approvals)
            )
        )

    def pending_actions(self, session_id: str, turn_id: str) -> list[PendingCall]:
        """The calls the turn waits on (none unless its status is ``requires_action``)."""
        return self._run(self._core.pending_actions(session_id, turn_id))

    def get_turn(self, session_id: str, turn_id: str) -> TurnRecord:
        return self._run(self._core.get_turn(session_id, turn_id))

    def cancel_turn(self, session_id: str, turn_id: str) -> TurnRecord:
        return self._run(self._core.cancel_turn(session_id, turn_id))

    def events(self, session_id: str, turn_id: str, *, after: str | None = None) -> EventStream:
        """A turn's events from the start (or after ``after``), ending after the terminal one."""
        return EventStream(self._http, self._core.turn_events(session_id, turn_id, after))

    def session_events(self, session_id: str, *, after: str | None = None) -> EventStream:
        """The session log, open-ended: patches, notes, turns' terminal events."""
        return EventStream(self._http, self._core.session_events(session_id, after))

    def run_turn(
        self,
        session_id: str,
        message: str,
        *,
        multitask: Multitask = "reject",
        client_tools: Mapping[str, ClientToolFunction] | None = None,
        on_approval: ApprovalCallback | None = None,
    ) -> EventStream:
        """Submit a turn and follow it, in one request (the submit answers with the
        turn's events); a dropped stream resumes with ``GET …/events``. A refused
        submit raises here, as :meth:`submit_turn` does. With ``client_tools`` (name →
        function), each ``turn.requires_action`` is answered by calling the functions
        with the calls' inputs as keyword arguments (a ``str`` result as it is, anything
        else as JSON, an exception as an error result), and the stream goes on to the
        turn's end. With ``on_approval``, each call awaiting approval is decided by it:
        it gets the :class:`PendingCall` and returns an :class:`Approval` (or ``True``
        to approve, ``False`` to reject); a raise, or no callback, rejects the call."""
        specs = _core.client_tool_specs(client_tools)
        feed = self._run(self._core.run_turn(session_id, message, multitask, specs))
        if not client_tools and on_approval is None:
            return EventStream(self._http, feed)
        tools, turn_id = dict(client_tools or {}), feed.turn_id
        assert turn_id is not None

        def answer(event: TurnRequiresAction) -> None:
            results: list[ToolResultAnswer] = []
            approvals: list[ApprovalAnswer] = []
            for call in event.calls:
                if call.kind == "approval":
                    if on_approval is None:
                        approvals.append(_core.no_approver(call.callId))
                        continue
                    try:
                        verdict, failed = on_approval(_pending(call)), None
                    except Exception as exc:
                        verdict, failed = None, exc
                    approvals.append(_core.approval_answer(call.callId, verdict, failed))
                    continue
                fn = tools.get(call.name)
                if fn is None:
                    results.append(_core.no_client_tool(call.callId, call.name))
                    continue
                try:
                    outcome, failed = fn(**call.input), None
                except Exception as exc:
                    outcome, failed = None, exc
                results.append(_core.client_tool_answer(call.callId, outcome, failed))
            try:
                self.submit_actions(
                    session_id,
                    turn_id,
                    tool_results=results,
                    approvals=approvals,
                    idempotency_key=_pause_key(event),
                )
            except ApiError as exc:
                if not _core.answer_once(exc):
                    raise

        return EventStream(self._http, feed, answer)


# --- the async client -------------------------------------------------------------------

_closing: set[asyncio.Task[None]] = set()  # the responses of abandoned streams, closing


async def _ado(http: httpx.AsyncClient, step: _core.Step) -> object:
    """One step of a flow, done with ``http``; its value."""
    match step:
        case _core.Send(request, stream):
            return await http.send(request.build(http), stream=stream)
        case _core.Body(response, "lines"):
            return response.aiter_lines()
        case _core.NextLine(lines):
            return await anext(lines, None)
        case _core.Body(response, "read"):
            return await response.aread()
        case _core.Body(response, "close"):
            await response.aclose()
        case _core.Sleep(seconds):
            await asyncio.sleep(seconds)
        case _:
            raise TypeError(f"not an I/O step: {step!r}")
    return None


async def _adrive(http: httpx.AsyncClient, run: _core.Run[Any]) -> None:
    """Do the steps ``run`` asks for until its flow ends or emits an event."""
    while (step := run.next_step()) is not None:
        try:
            run.answer(await _ado(http, step))
        except BaseException as exc:  # the flow's to handle: it retries or raises it
            run.fail(exc)


class AsyncEventStream(_core.StreamView):
    """The async twin of :class:`EventStream`."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        feed: _core.EventFeed,
        answer: Callable[[TurnRequiresAction], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(feed)
        self._http = http
        self._answer = answer

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self

    async def __anext__(self) -> StreamEvent:
        await _adrive(self._http, self._run)
        if (event := self._run.event()) is None:
            raise StopAsyncIteration
        if self._answer is not None and isinstance(event, TurnRequiresAction):
            await self._answer(event)
        return event

    async def aclose(self) -> None:
        if (response := self._stop()) is not None:
            await response.aclose()

    def __del__(self) -> None:
        # A stream left unfinished lets its connection go, as an async generator would:
        # the response is closed by a task on the running loop.
        response = self._stop()
        if response is None:
            return
        with contextlib.suppress(RuntimeError):  # no loop runs: nothing to hand it to
            task = asyncio.get_running_loop().create_task(response.aclose())
            _closing.add(task)
            task.add_done_callback(_closing.discard)


class AsyncClient(_ClientBase[httpx.AsyncClient, httpx.AsyncBaseTransport]):
    """An asyncio client; ``async with`` it or await :meth:`aclose`. Its methods are
    :class:`Client`'s, awaited, but for ``events`` and ``session_events``."""

    def _open(
        self, transport: httpx.AsyncBaseTransport | None, **options: Any
    ) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=transport, **options)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _run(self, flow: _core.Flow[T]) -> T:
        run = _core.Run(flow)
        await _adrive(self._http, run)
        return run.result()

    async def create_session(
        self, meta: Mapping[str, Any] | None = None, *, title: str | None = None
    ) -> Session:
        return await self._run(self._core.create_session(meta, title))

    async def list_sessions(
        self, *, limit: int | None = None, cursor: str | None = None
    ) -> SessionPage:
        """A page of your sessions, newest first (see :meth:`Client.list_sessions`)."""
        return await self._run(self._core.list_sessions(limit, cursor))

    async def get_session(self, session_id: str) -> Session:
        return await self._run(self._core.get_session(session_id))

    async def delete_session(self, session_id: str) -> None:
        await self._run(self._core.delete_session(session_id))

    async def notes(self, session_id: str) -> Notes:
        return await self._run(self._core.notes(session_id))

    async def system(self, session_id: str) -> str:
        return await self._run(self._core.system(session_id))

    async def messages(self, session_id: str) -> list[dict[str, Any]]:
        return await self._run(self._core.messages(session_id))

    async def tools(self) -> list[Tool]:
        """The tools a session may be offered (see :meth:`Client.tools`)."""
        return await self._run(self._core.tools())

    async def submit_turn(self, session_id: str, message: str, *, multitask: Multitask = "reject",
                          idempotency_key: str | None = None,
                          client_tools: ClientTools | None = None) -> TurnAccepted:  # fmt: skip
        specs = _core.client_tool_specs(client_tools)
        flow = self._core.submit_turn(session_id, message, multitask, idempotency_key, specs)
        return await self._run(flow)

    async def get_turn(self, session_id: str, turn_id: str) -> TurnRecord:
        return await self._run(self._core.get_turn(session_id, turn_id))

    async def cancel_turn(self, session_id: str, turn_id: str) -> TurnRecord:
        return await self._run(self._core.cancel_turn(session_id, turn_id))

    def events(
        self, session_id: str, turn_id: str, *, after: str | None = None
    ) -> AsyncEventStream:
        return AsyncEventStream(self._http, self._core.turn_events(session_id, turn_id, after))

    def session_events(self, session_id: str, *, after: str | None = None) -> AsyncEventStream:
        return AsyncEventStream(self._http, self._core.session_events(session_id, after))

    async def submit_actions(
        self,
        session_id: str,
        turn_id: str,
        *,
        tool_results: Sequence[ToolResultAnswer] = (),
        approvals: Sequence[ApprovalAnswer] = (),
        idempotency_key: str | None = None,
    ) -> TurnRecord:
        return await self._run(
            self._core.submit_actions(
                session_id, turn_id, list(tool_results), idempotency_key, list(approvals)
            )
        )

    async def pending_actions(self, session_id: str, turn_id: str) -> list[PendingCall]:
        return await self._run(self._core.pending_actions(session_id, turn_id))

    async def run_turn(
        self,
        session_id: str,
        message: str,
        *,
        multitask: Multitask = "reject",
        client_tools: Mapping[str, ClientToolFunction] | None = None,
        on_approval: AsyncApprovalCallback | None = None,
    ) -> AsyncEventStream:
        """As :meth:`Client.run_turn`; a client tool's function, and ``on_approval``,
        may be coroutine functions (their results are awaited)."""
        specs = _core.client_tool_specs(client_tools)
        feed = await self._run(self._core.run_turn(session_id, message, multitask, specs))
        if not client_tools and on_approval is None:
            return AsyncEventStream(self._http, feed)
        tools, turn_id = dict(client_tools or {}), feed.turn_id
        assert turn_id is not None

        async def answer(event: TurnRequiresAction) -> None:
            results: list[ToolResultAnswer] = []
            approvals: list[ApprovalAnswer] = []
            for call in event.calls:
                if call.kind == "approval":
                    if on_approval is None:
                        approvals.append(_core.no_approver(call.callId))
                        continue
                    try:
                        verdict, failed = on_approval(_pending(call)), None
                        if inspect.isawaitable(verdict):
                            verdict = await verdict
                    except Exception as exc:
                        verdict, failed = None, exc
                    approvals.append(_core.approval_answer(call.callId, verdict, failed))
                    continue
                fn = tools.get(call.name)
                if fn is None:
                    results.append(_core.no_client_tool(call.callId, call.name))
                    continue
                try:
                    outcome, failed = fn(**call.input), None
                    if inspect.isawaitable(outcome):
                        outcome = await outcome
                except Exception as exc:
                    outcome, failed = None, exc
                results.append(_core.client_tool_answer(call.callId, outcome, failed))
            try:
                await self.submit_actions(
                    session_id,
                    turn_id,
                    tool_results=results,
                    approvals=approvals,
                    idempotency_key=_pause_key(event),
                )
            except ApiError as exc:
                if not _core.answer_once(exc):
                    raise

        return AsyncEventStream(self._http, feed, answer)

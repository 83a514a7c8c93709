"""The core of the Python client, without I/O: what :class:`~turnbus.client.Client` and
:class:`~turnbus.client.AsyncClient` both do, written once.

A call of the API, or an event stream, is a *flow*: a generator that yields the I/O
it needs, one step at a time (:class:`Send`, :class:`Body`, :class:`NextLine`,
:class:`Sleep`), and gets back each step's value,
or the exception the step raised. The flow builds the request (method, path, params,
JSON body, ``Idempotency-Key``), turns the answer into a typed result or a typed
error, decides what to retry and how long to wait, decodes the SSE events and keeps
the stream's cursor (``Last-Event-ID``, :class:`StreamLost`). :mod:`turnbus.client`
runs the flows: the sync client does each step with ``httpx.Client`` and
``time.sleep``, the async one with ``httpx.AsyncClient`` and ``asyncio.sleep``.
"""

from __future__ import annotations

import inspect
import typing
import uuid
import warnings
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from turnbus.shared.backoff import Backoff
from turnbus.shared.error_codes import ERROR_CODES
from turnbus.shared.events import Event, UnknownEvent, decode_event, is_terminal
from turnbus.shared.records import TERMINAL_STATUSES
from turnbus.sse import SseMessage, SseParser

Multitask = Literal["reject", "enqueue", "interrupt"]
StreamEvent = Event | UnknownEvent
T = TypeVar("T")


# --- what the API answers ---------------------------------------------------------------


class ApiStruct(msgspec.Struct, rename="camel", kw_only=True):
    """A body the API answers: snake_case attributes, the wire's camelCase names on the
    wire (msgspec's ``rename``). The camelCase attributes of earlier releases still read,
    with a :class:`DeprecationWarning`; they go in the next release."""

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: an old camelCase name, or a typo.
        fields = type(self).__struct_fields__
        encoded = type(self).__struct_encode_fields__
        if name in encoded and name not in fields:
            snake = fields[encoded.index(name)]
            warnings.warn(
                f"{type(self).__name__}.{name} is deprecated; use .{snake}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(self, snake)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class Session(ApiStruct):
    """A session's envelope: ``meta`` holds the keys that are set (by their wire names,
    ``title``, ``workingNotes``, …, as ``PUT …/meta`` takes them)."""

    session_id: str
    updated_at: int
    created_at: int = 0
    meta: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def title(self) -> str | None:
        """The session's title: the host's, or the one its first message gave."""
        value = self.meta.get("title")
        return value if isinstance(value, str) else None


class TurnAccepted(ApiStruct):
    """``202`` to a submitted turn; ``replayed`` when the Idempotency-Key named an earlier one."""

    turn_id: str
    status: str
    events_url: str
    replayed: bool = False


class Notes(ApiStruct):
    notes: str | None
    bytes: int


class ActiveTurn(ApiStruct):
    """The session's oldest unfinished turn: ``running`` once a worker has started it."""

    turn_id: str
    status: Literal["queued", "running", "requires_action"]


class SessionSummary(ApiStruct):
    """One row of the sessions list; ``title`` is None while the session has none."""

    session_id: str
    title: str | None
    created_at: int
    updated_at: int
    active_turn: ActiveTurn | None
    notes_bytes: int


class SessionPage(ApiStruct):
    """A page of the sessions list, newest first; ``next_cursor`` is None on the last."""

    sessions: list[SessionSummary]
    next_cursor: str | None


class TurnUsage(ApiStruct):
    """The turn's token counts so far (summed over its rounds and attempts)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0


class PendingCall(ApiStruct):
    """A call a paused turn waits on (``pending_calls`` of its record): answer it with
    :meth:`~turnbus.Client.submit_actions`. ``kind`` is ``client`` for a client tool."""

    call_id: str
    name: str
    input: dict[str, Any] = msgspec.field(default_factory=dict)
    kind: str = "client"


class WebhookAttempt(ApiStruct):
    """One POST of a turn's webhook: when (ms), how long it took, and the receiver's HTTP
    status or the error that stood in for one."""

    at: int
    duration_ms: int
    status: int | None = None
    error: str | None = None


class TurnWebhook(ApiStruct):
    """The turn's webhook (``webhook`` of its record) and its delivery: ``state`` is
    ``pending`` until a POST is answered 2xx (``delivered``) or the retry window closes
    (``failed``); ``id`` is the ``webhook-id`` header, the same on every retry."""

    url: str
    id: str | None = None
    state: str | None = None
    attempts: list[WebhookAttempt] = msgspec.field(default_factory=list)
    next_attempt_at: int | None = None


class ClientToolSpec(ApiStruct):
    """A client tool as a submit declares it (and the turn record shows it)."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object"})


class TurnRecord(ApiStruct):
    """The turn record, as ``GET …/turns/{tid}`` answers it."""

    turn_id: str
    session_id: str
    user_id: str
    status: str
    message: str
    created_at: int
    multitask: str = "reject"
    shard: int = 0
    attempt: int = 0
    started_at: int | None = None
    ended_at: int | None = None
    worker: str | None = None
    reason: str | None = None
    error: str | None = None
    stop_reason: str | None = None
    usage: TurnUsage | None = None
    cancel_requested: bool = False
    allowed_tools: str | None = None  # the token's narrowing of the tools (a JSON array)
    client_tools: list[ClientToolSpec] | None = None
    # While the turn waits for its caller (status requires_action): the calls it waits
    # on, since when, and until when (ms); the ms it has waited in all, its answers.
    pending_calls: list[PendingCall] | None = None
    paused_at: int | None = None
    action_timeout_ms: int | None = None
    action_deadline: int | None = None
    waited_ms: int = 0
    resumes: int = 0
    # The user's quota counters this turn feeds (``active``, ``tokens``), space separated.
    quotas: str | None = None
    by: str | None = None  # the turn that interrupted this one (reason "interrupted")
    webhook: TurnWebhook | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


class Tool(ApiStruct):
    """A tool the caller's sessions may be offered, as ``GET /v1/tools`` lists it:
    ``source`` is "notes", "python" or an MCP server's name; an ``idempotent`` tool is
    rerun after a lost worker, the others never without the model being told."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] = msgspec.field(default_factory=dict)
    source: str = ""
    idempotent: bool = False
    timeout_s: float = 30.0
    max_result_bytes: int = 16 * 1024
    requires_approval: bool = False


class _Tools(msgspec.Struct):
    tools: list[Tool]


class _Messages(msgspec.Struct):
    messages: list[dict[str, Any]]


class _ErrorDetail(msgspec.Struct):
    code: str = "unknown"
    message: str = ""
    field: str | None = None
    activeTurnId: str | None = None
    turnId: str | None = None
    callId: str | None = None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


_session_decoder = msgspec.json.Decoder(Session)
_page_decoder = msgspec.json.Decoder(SessionPage)
_accepted_decoder = msgspec.json.Decoder(TurnAccepted)
_notes_decoder = msgspec.json.Decoder(Notes)
_tools_decoder = msgspec.json.Decoder(_Tools)
_messages_decoder = msgspec.json.Decoder(_Messages)
_record_decoder = msgspec.json.Decoder(TurnRecord)
_error_decoder = msgspec.json.Decoder(_ErrorBody)
_encoder = msgspec.json.Encoder()


# --- errors -----------------------------------------------------------------------------


class TurnbusError(Exception):
    """Any failure of a client call."""


class ApiError(TurnbusError):
    """The gateway refused the request: ``status``, the API's ``code`` and its sentence,
    with what the answer named where it helps: ``field``, ``turn_id``,
    ``active_turn_id``, ``call_id``, and ``retry_after`` (seconds; None when it did
    not say). The class raised is the code's (:data:`ERROR_CLASSES`)."""

    def __init__(
        self, status: int, code: str, message: str, *, field: str | None = None,
        turn_id: str | None = None, active_turn_id: str | None = None,
        call_id: str | None = None, retry_after: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.turn_id = turn_id
        self.active_turn_id = active_turn_id
        self.call_id = call_id
        self.retry_after = retry_after


class BadRequest(ApiError):
    """``400``: a malformed body, header, cursor or limit (``field`` names it)."""


class Unauthorized(ApiError):
    """``401``: no token, a bad or an expired one."""


class NotFound(ApiError):
    """``404``: no such session or turn for this user."""


class Conflict(ApiError):
    """``409 conflict``: an Idempotency-Key reused with another body (``turn_id``), a
    stale meta write."""


class TurnNotWaiting(Conflict):
    """``409 turn_not_waiting``: an answer to a turn that is not waiting for one (it
    was answered already, or has ended)."""


class SessionBusy(ApiError):
    """``409 session_busy``: the session has an active turn (``active_turn_id``);
    wait, cancel it, or enqueue."""

    def __init__(self, status: int, code: str, message: str, *,
                 active_turn_id: str | None = None, **details: Any) -> None:  # fmt: skip
        super().__init__(status, code, message, **details)
        self.active_turn_id: str = active_turn_id or ""


class PayloadTooLarge(ApiError):
    """``413``: the body, or a value in it, is over its cap."""


class Unprocessable(ApiError):
    """``422``: the body does not fit the schema or is refused (``field`` names what):
    ``unprocessable``, ``unknown_provider``, ``unknown_tool``, ``clock_ahead``, …"""


class InvalidAnswer(Unprocessable):
    """``422`` to an answer of a paused turn: a call unknown, missing, answered twice
    or in the wrong list (``call_id`` names it); nothing was written."""


class SessionQueueFull(ApiError):
    """``429 session_queue_full``: too many turns wait on the session; retry after
    ``retry_after`` seconds (None when the gateway did not say)."""


class QuotaExceeded(ApiError):
    """``429 quota_exceeded``: over one of the user's quotas, named by ``field``
    (``runningTurns``, ``queuedTurns``, ``turnsPerMinute``, ``tokensPerDay``); retry after
    ``retry_after`` seconds (None when the gateway did not say)."""


class Unavailable(ApiError):
    """``503``: the gateway cannot reach Redis, or no replica confirmed the write;
    retried by the calls that are safe to retry."""


# The class a refusal raises: its code's own, else its status's (so does a code this
# client does not know yet).
_STATUS_ERRORS: dict[int, type[ApiError]] = {
    400: BadRequest,
    401: Unauthorized,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: Unprocessable,
    429: SessionQueueFull,
    503: Unavailable,
}
_CODE_ERRORS: dict[str, type[ApiError]] = {
    "session_busy": SessionBusy,
    "turn_not_waiting": TurnNotWaiting,
    "quota_exceeded": QuotaExceeded,
    "unknown_call": InvalidAnswer,
    "missing_call": InvalidAnswer,
    "duplicate_call": InvalidAnswer,
    "wrong_answer": InvalidAnswer,
}
ERROR_CLASSES: dict[str, type[ApiError]] = {
    code: _CODE_ERRORS.get(code) or _STATUS_ERRORS.get(entry.status, ApiError)
    for code, entry in ERROR_CODES.items()
}


class StreamLost(TurnbusError):
    """An event stream could not be resumed after ``max_reconnects`` tries in a row."""

    def __init__(self, message: str, last_event_id: str | None) -> None:
        super().__init__(message)
        self.last_event_id = last_event_id


def _retry_after(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        return None


def api_error(resp: httpx.Response) -> ApiError:
    """The typed error for a refused response (its body must have been read)."""
    status = resp.status_code
    try:
        detail = _error_decoder.decode(resp.content).error
    except msgspec.DecodeError:
        detail = _ErrorDetail(code="unknown", message=resp.reason_phrase or "")
    cls = ERROR_CLASSES.get(detail.code) or _STATUS_ERRORS.get(status, ApiError)
    return cls(
        status, detail.code, detail.message, field=detail.field, turn_id=detail.turnId,
        active_turn_id=detail.activeTurnId, call_id=detail.callId,
        retry_after=_retry_after(resp.headers.get("retry-after")),
    )  # fmt: skip


# --- the steps of a flow ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """A request to send, relative to the client's base URL, with its headers."""

    method: str
    path: str
    params: Mapping[str, str | int] | None = None
    content: bytes | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout: httpx.Timeout | None = None  # None: the client's

    def build(self, http: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        timeout = httpx.USE_CLIENT_DEFAULT if self.timeout is None else self.timeout
        return http.build_request(
            self.method, self.path, params=self.params, content=self.content,
            headers=self.headers, timeout=timeout,
        )  # fmt: skip


def _json_request(
    method: str, path: str, body: object, headers: Mapping[str, str] | None = None, **options: Any
) -> Request:
    content = _encoder.encode(body)
    headers = {"content-type": "application/json", **(headers or {})}
    return Request(method, path, content=content, headers=headers, **options)


class Step:
    """One thing a flow asks of the client that runs it."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Send(Step):
    """Send ``request``: the response, its body read; with ``stream``, the response as
    soon as its headers are in, its body left to read."""

    request: Request
    stream: bool = False


@dataclass(frozen=True, slots=True)
class Body(Step):
    """Do ``action`` with a streamed response's body: ``"lines"``, an iterator of its
    lines (an async one for the async client); ``"read"``, read the rest of it (which
    closes the response); ``"close"``, close the response."""

    response: httpx.Response
    action: Literal["lines", "read", "close"]


@dataclass(frozen=True, slots=True)
class NextLine(Step):
    """The next line of a ``Body(response, "lines")`` iterator; None at the end of the body."""

    lines: Any


@dataclass(frozen=True, slots=True)
class Sleep(Step):
    seconds: float


@dataclass(frozen=True, slots=True)
class Emit(Step):
    """No I/O: hand ``event`` to the stream's reader; the flow waits for the next read."""

    event: StreamEvent


Flow = Generator[Step, Any, T]


class Run(Generic[T]):
    """A flow, run a step at a time by a client: :meth:`next_step` gives the I/O to do;
    :meth:`answer` hands back its value, :meth:`fail` the exception it raised (any, a
    cancel too), which the flow gets raised where it asked. :meth:`next_step` gives None
    when the flow has ended (:meth:`result`) or emitted an event (:meth:`event`)."""

    def __init__(self, flow: Flow[T]) -> None:
        self._flow = flow
        self._answer: Any = None
        self._error: BaseException | None = None
        self._event: StreamEvent | None = None
        self._done = False
        self._result: Any = None

    def next_step(self) -> Step | None:
        try:
            if self._error is not None:
                error, self._error = self._error, None
                step = self._flow.throw(error)
            else:
                answer, self._answer = self._answer, None
                step = self._flow.send(answer)
        except StopIteration as stop:
            self._done, self._result = True, stop.value
            return None
        if isinstance(step, Emit):
            self._event = step.event
            return None
        return step

    def answer(self, value: object) -> None:
        self._answer = value

    def fail(self, error: BaseException) -> None:
        self._error = error

    def result(self) -> T:
        assert self._done, "the flow has not ended"
        result: T = self._result
        return result

    def event(self) -> StreamEvent | None:
        """The event the flow emitted; None once it has ended."""
        event, self._event = self._event, None
        return event

    def close(self) -> None:
        self._flow.close()


# --- retries and streams ----------------------------------------------------------------


_RETRYABLE = (httpx.TransportError,)


def _should_retry_status(status: int) -> bool:
    return status in (502, 503, 504)


class Cursor:
    """Where a stream stands: the last entry id seen, and whether it has ended."""

    def __init__(self, after: str | None, ends: bool) -> None:
        self.last_event_id = after
        self.ends = ends  # a turn stream ends after its terminal event; a session log never
        self.done = False
        self.reconnects = 0

    def headers(self) -> dict[str, str]:
        return {"Last-Event-ID": self.last_event_id} if self.last_event_id else {}

    def take(self, message: SseMessage) -> StreamEvent | None:
        """The event a message carries (None for ``stream.dropped``: reconnect)."""
        if message.event == "stream.dropped":
            return None
        event = decode_event(message.data)
        if message.id:
            self.last_event_id = message.id
        if self.ends and is_terminal(event):
            self.done = True
        return event


def _path(session_id: str, suffix: str = "") -> str:
    return f"/v1/sessions/{quote(session_id, safe='')}{suffix}"


def _turn_path(session_id: str, turn_id: str, suffix: str = "") -> str:
    return _path(session_id, f"/turns/{quote(turn_id, safe='')}{suffix}")


def _list_params(limit: int | None, cursor: str | None) -> dict[str, str | int]:
    params: dict[str, str | int] = {}
    if limit is not None:
        params["limit"] = limit
    if cursor is not None:
        params["cursor"] = cursor
    return params


def _turn_body(
    message: str, multitask: Multitask, client_tools: list[ClientToolSpec] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {"message": message, "multitask": multitask}
    if client_tools:
        body["clientTools"] = client_tools
    return body


class ToolResultAnswer(msgspec.Struct, rename="camel", omit_defaults=True):
    """The caller's result of one pending call, as ``POST …/actions`` takes it."""

    call_id: str
    output: str
    is_error: bool = False


class ApprovalAnswer(msgspec.Struct, rename="camel", omit_defaults=True):
    """A decision on one call awaiting approval, as ``POST …/actions`` takes it."""

    call_id: str
    decision: Literal["approve", "reject", "edit"]
    input: dict[str, Any] | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Approval:
    """What an ``on_approval`` callback decides for a call: ``Approval.approve()`` runs
    it with the model's input, ``Approval.edit(input)`` with ``input``,
    ``Approval.reject(reason)`` gives the model an error result carrying ``reason``.
    (A callback may also return ``True`` for approve, ``False`` for reject.)"""

    decision: Literal["approve", "reject", "edit"]
    input: dict[str, Any] | None = None
    reason: str | None = None

    @classmethod
    def approve(cls) -> Approval:
        return cls("approve")

    @classmethod
    def edit(cls, tool_input: dict[str, Any]) -> Approval:
        return cls("edit", input=tool_input)

    @classmethod
    def reject(cls, reason: str | None = None) -> Approval:
        return cls("reject", reason=reason)


ClientToolFunction = Callable[..., Any]


def client_tool_spec(name: str, fn: ClientToolFunction) -> ClientToolSpec:
    """A client tool declared from its function: the docstring is its description, the
    keyword parameters (their type hints, as JSON Schema) its input."""
    properties: dict[str, Any] = {}
    required: list[str] = []
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError):
        hints = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            continue
        hint = hints.get(param.name)
        properties[param.name] = msgspec.json.schema(hint) if hint is not None else {}
        if param.default is param.empty:
            required.append(param.name)
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return ClientToolSpec(name=name, description=inspect.getdoc(fn) or "", input_schema=schema)


def client_tool_specs(
    client_tools: Mapping[str, ClientToolFunction | ClientToolSpec] | None,
) -> list[ClientToolSpec] | None:
    """The declarations of ``client_tools`` (a function, or a spec given as it is)."""
    if not client_tools:
        return None
    return [
        tool if isinstance(tool, ClientToolSpec) else client_tool_spec(name, tool)
        for name, tool in client_tools.items()
    ]


def client_tool_answer(
    call_id: str, outcome: object, failed: BaseException | None
) -> ToolResultAnswer:
    """A pending call's answer from what its function returned (a ``str`` as it is,
    anything else as JSON) or raised (an error result with its type and message)."""
    if failed is not None:
        return ToolResultAnswer(call_id, f"ERROR {type(failed).__name__}: {failed}", True)
    if isinstance(outcome, str):
        return ToolResultAnswer(call_id, outcome)
    return ToolResultAnswer(call_id, _encoder.encode(outcome).decode())


def no_client_tool(call_id: str, name: str) -> ToolResultAnswer:
    return ToolResultAnswer(
        call_id, f"ERROR this client has no function for the tool {name!r}", True
    )


def approval_answer(call_id: str, verdict: object, failed: BaseException | None) -> ApprovalAnswer:
    """A pending approval's answer from what the ``on_approval`` callback returned (an
    :class:`Approval` or a ``bool``); anything else, or a raise, rejects the call: a
    call never runs without a clear approval."""
    if failed is not None:
        reason = f"the approval callback raised {type(failed).__name__}: {failed}"
        return ApprovalAnswer(call_id, "reject", reason=reason)
    if verdict is True:
        return ApprovalAnswer(call_id, "approve")
    if verdict is False:
        return ApprovalAnswer(call_id, "reject")
    if isinstance(verdict, Approval):
        return ApprovalAnswer(call_id, verdict.decision, verdict.input, verdict.reason)
    reason = f"the approval callback returned {type(verdict).__name__}, not an Approval"
    return ApprovalAnswer(call_id, "reject", reason=reason)


def no_approver(call_id: str) -> ApprovalAnswer:
    return ApprovalAnswer(call_id, "reject", reason="this client has no on_approval callback")


def answer_once(error: ApiError) -> bool:
    """Whether an automatic answer's refusal says another answer got there first (the
    turn moved on): then it is not an error of the stream's."""
    return isinstance(error, Conflict)


def _body(decoder: msgspec.json.Decoder[T]) -> Callable[[httpx.Response], T]:
    return lambda resp: decoder.decode(resp.content)


def _accepted(resp: httpx.Response) -> TurnAccepted:
    accepted = _accepted_decoder.decode(resp.content)
    accepted.replayed = resp.headers.get("idempotent-replayed") == "true"
    return accepted


class EventFeed:
    """One event stream: where it stands (:class:`Cursor`), the response open on it, and
    the flow that reads it and reconnects, with ``Last-Event-ID``, after a backoff."""

    def __init__(
        self, core: ClientCore, url: str, cursor: Cursor, opened: httpx.Response | None = None,
        turn_id: str | None = None,
    ) -> None:  # fmt: skip
        self._core = core
        self.url = url
        self.cursor = cursor
        self.turn_id = turn_id
        # Open on the stream: at first, a response already streaming this turn's events (a
        # submit that asked for them); reconnects GET ``url``. Whoever stops the flow early
        # closes it.
        self.response = opened

    def flow(self) -> Flow[None]:
        """Emits the stream's events; ends after a turn's terminal event."""
        cursor, backoff = self.cursor, self._core.backoff()
        while True:
            try:
                failure = yield from self._connection(backoff)
            except _RETRYABLE as exc:
                failure = f"{type(exc).__name__}: {exc}"
            if self.response is not None:
                response, self.response = self.response, None
                yield Body(response, "close")
            if failure is None:
                return
            delay = next(backoff, None)
            if delay is None:
                raise StreamLost(
                    f"could not resume the event stream after {backoff.max_tries} tries: {failure}",
                    cursor.last_event_id,
                )
            cursor.reconnects += 1
            yield Sleep(delay)

    def _connection(self, backoff: Backoff) -> Flow[str | None]:
        """One connection's events, emitted; None once the stream has ended, else why it broke."""
        cursor = self.cursor
        if self.response is None:
            headers, timeout = cursor.headers(), self._core.stream_timeout
            self.response = yield Send(Request("GET", self.url, headers=headers, timeout=timeout),
                                       stream=True)  # fmt: skip
        response = self.response
        if response.status_code == 204:  # already past the terminal event
            return None
        if response.status_code != 200:
            yield Body(response, "read")
            if not _should_retry_status(response.status_code):
                raise api_error(response)
            return f"the gateway answered {response.status_code}"
        parser = SseParser()
        lines = yield Body(response, "lines")
        while (line := (yield NextLine(lines))) is not None:
            for message in parser.feed_lines(line):
                event = cursor.take(message)
                if event is None:
                    return "the gateway dropped the stream"
                backoff.reset()
                yield Emit(event)
                if cursor.done:
                    return None
        return "the stream ended before the turn did" if cursor.ends else "the stream ended"


class StreamView:
    """An event stream as its reader sees it; the base of both clients' streams."""

    def __init__(self, feed: EventFeed) -> None:
        self._feed = feed
        self._run: Run[None] = Run(feed.flow())

    @property
    def last_event_id(self) -> str | None:
        return self._feed.cursor.last_event_id

    @property
    def reconnects(self) -> int:
        return self._feed.cursor.reconnects

    def _stop(self) -> httpx.Response | None:
        """Stop the flow; the response it left open, for the caller to close."""
        self._run.close()
        response, self._feed.response = self._feed.response, None
        return response


# --- the calls --------------------------------------------------------------------------


class ClientCore:
    """The calls of the HTTP API as flows, and the options they share."""

    def __init__(
        self, *, stream_timeout: httpx.Timeout, max_reconnects: int, backoff_s: float,
        backoff_max_s: float,
    ) -> None:  # fmt: skip
        self.stream_timeout = stream_timeout
        self._max_reconnects = max_reconnects
        self._backoff_s, self._backoff_max_s = backoff_s, backoff_max_s

    def backoff(self) -> Backoff:
        """Delays between tries: ``backoff_s`` doubling to ``backoff_max_s``, each drawn in
        its upper half, ``max_reconnects`` of them at most; reset on progress."""
        return Backoff(
            self._backoff_s, self._backoff_max_s, jitter=0.5, max_tries=self._max_reconnects
        )

    def _send(self, request: Request, *, retry: bool, stream: bool = False) -> Flow[httpx.Response]:
        """``request`` sent until a 2xx answers it, which is returned; a refusal raises its
        typed error. With ``retry`` (the call is safe to repeat) a lost connection or a
        502/503/504 is tried again, after a backoff."""
        backoff = self.backoff()
        while True:
            try:
                resp: httpx.Response = yield Send(request, stream=stream)
            except _RETRYABLE:
                delay = next(backoff, None) if retry else None
                if delay is None:
                    raise
            else:
                if resp.is_success:
                    return resp
                if stream:
                    yield Body(resp, "read")
                retryable = retry and _should_retry_status(resp.status_code)
                delay = next(backoff, None) if retryable else None
                if delay is None:
                    raise api_error(resp)
            yield Sleep(delay)

    def _call(
        self, request: Request, read: Callable[[httpx.Response], T], *, retry: bool = True
    ) -> Flow[T]:
        return read((yield from self._send(request, retry=retry)))

    # sessions

    def create_session(self, meta: Mapping[str, Any] | None, title: str | None) -> Flow[Session]:
        fields = dict(meta or {})
        if title is not None:
            fields["title"] = title
        body = {"meta": fields} if fields else {}
        request = _json_request("POST", "/v1/sessions", body)
        return self._call(request, _body(_session_decoder), retry=False)  # not idempotent

    def list_sessions(self, limit: int | None, cursor: str | None) -> Flow[SessionPage]:
        request = Request("GET", "/v1/sessions", params=_list_params(limit, cursor))
        return self._call(request, _body(_page_decoder))

    def get_session(self, session_id: str) -> Flow[Session]:
        return self._call(Request("GET", _path(session_id)), _body(_session_decoder))

    def delete_session(self, session_id: str) -> Flow[None]:
        return self._call(Request("DELETE", _path(session_id)), lambda resp: None, retry=False)

    def notes(self, session_id: str) -> Flow[Notes]:
        return self._call(Request("GET", _path(session_id, "/notes")), _body(_notes_decoder))

    def system(self, session_id: str) -> Flow[str]:
        return self._call(Request("GET", _path(session_id, "/system")), lambda resp: resp.text)

    def messages(self, session_id: str) -> Flow[list[dict[str, Any]]]:
        request = Request("GET", _path(session_id, "/messages"))
        return self._call(request, lambda resp: _messages_decoder.decode(resp.content).messages)

    def tools(self) -> Flow[list[Tool]]:
        return self._call(
            Request("GET", "/v1/tools"), lambda resp: _tools_decoder.decode(resp.content).tools
        )

    # turns

    def submit_turn(
        self, session_id: str, message: str, multitask: Multitask, idempotency_key: str | None,
        client_tools: list[ClientToolSpec] | None = None,
    ) -> Flow[TurnAccepted]:  # fmt: skip
        """Retried under the same key: a retry is a replay, never a second turn."""
        key = idempotency_key or str(uuid.uuid4())
        request = _json_request("POST", _path(session_id, "/turns"),
                                _turn_body(message, multitask, client_tools),
                                headers={"Idempotency-Key": key})  # fmt: skip
        return self._call(request, _accepted)

    def submit_actions(
        self, session_id: str, turn_id: str, tool_results: list[ToolResultAnswer],
        idempotency_key: str | None, approvals: list[ApprovalAnswer] | None = None,
    ) -> Flow[TurnRecord]:  # fmt: skip
        """Retried under the same key: a retry answers as the first did."""
        key = idempotency_key or str(uuid.uuid4())
        body: dict[str, Any] = {"toolResults": tool_results}
        if approvals:
            body["approvals"] = approvals
        request = _json_request("POST", _turn_path(session_id, turn_id, "/actions"), body,
                                headers={"Idempotency-Key": key})  # fmt: skip
        return self._call(request, _body(_record_decoder))

    def pending_actions(self, session_id: str, turn_id: str) -> Flow[list[PendingCall]]:
        def read(resp: httpx.Response) -> list[PendingCall]:
            record = _record_decoder.decode(resp.content)
            return list(record.pending_calls or []) if record.status == "requires_action" else []

        return self._call(Request("GET", _turn_path(session_id, turn_id)), read)

    def get_turn(self, session_id: str, turn_id: str) -> Flow[TurnRecord]:
        return self._call(Request("GET", _turn_path(session_id, turn_id)), _body(_record_decoder))

    def cancel_turn(self, session_id: str, turn_id: str) -> Flow[TurnRecord]:
        request = Request("POST", _turn_path(session_id, turn_id, "/cancel"))
        return self._call(request, _body(_record_decoder))

    def turn_events(self, session_id: str, turn_id: str, after: str | None) -> EventFeed:
        return EventFeed(self, _turn_path(session_id, turn_id, "/events"), Cursor(after, True))

    def session_events(self, session_id: str, after: str | None) -> EventFeed:
        return EventFeed(self, _path(session_id, "/events"), Cursor(after, False))

    def run_turn(
        self, session_id: str, message: str, multitask: Multitask,
        client_tools: list[ClientToolSpec] | None = None,
    ) -> Flow[EventFeed]:  # fmt: skip
        """A submit that asks for the turn's events, under a new key (so a retry is a
        replay); the feed of the events it answers with."""
        request = _json_request(
            "POST", _path(session_id, "/turns"), _turn_body(message, multitask, client_tools),
            headers={"Accept": "text/event-stream", "Idempotency-Key": str(uuid.uuid4())},
            timeout=self.stream_timeout,
        )  # fmt: skip
        resp = yield from self._send(request, retry=True, stream=True)
        turn_id = resp.headers["x-turn-id"]
        url = _turn_path(session_id, turn_id, "/events")
        return EventFeed(self, url, Cursor(None, True), opened=resp, turn_id=turn_id)

"""A Python client of the turnbus HTTP API, sync (:class:`Client`) and async (:class:`AsyncClient`).

Built on ``httpx``, which turnbus already depends on (nothing more to install)::

    from turnbus import Client

    with Client("http://127.0.0.1:8000", token) as tb:
        session = tb.create_session()
        turn = tb.submit_turn(session.sessionId, "remember the build is green")
        for event in tb.events(session.sessionId, turn.turnId):
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
- A refused request raises an :class:`ApiError` subclass carrying the API's code:
  :class:`SessionBusy` (``409``, ``active_turn_id``), :class:`SessionQueueFull`
  (``429``, ``retry_after`` seconds), :class:`NotFound`, :class:`Unauthorized`,
  :class:`Conflict`, :class:`Unavailable`. A stream that cannot be resumed after
  ``max_reconnects`` tries in a row raises :class:`StreamLost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Mapping
from typing import Any, Literal
from urllib.parse import quote

import httpx
import msgspec

from turnbus.shared.events import Event, UnknownEvent, decode_event, is_terminal
from turnbus.shared.records import SessionPage, SessionSummary, TurnRecord
from turnbus.sse import SseMessage, aiter_sse, iter_sse

__all__ = [
    "ApiError",
    "AsyncClient",
    "AsyncEventStream",
    "Client",
    "Conflict",
    "EventStream",
    "NotFound",
    "Notes",
    "Session",
    "SessionBusy",
    "SessionPage",
    "SessionQueueFull",
    "SessionSummary",
    "StreamLost",
    "TurnAccepted",
    "TurnbusError",
    "Unauthorized",
    "Unavailable",
]

Multitask = Literal["reject", "enqueue"]
StreamEvent = Event | UnknownEvent


# --- what the API answers ---------------------------------------------------------------


class Session(msgspec.Struct, kw_only=True):
    """A session's envelope: ``meta`` holds the keys that are set."""

    sessionId: str
    updatedAt: int
    createdAt: int = 0
    meta: dict[str, Any] = msgspec.field(default_factory=dict)


class TurnAccepted(msgspec.Struct, kw_only=True):
    """``202`` to a submitted turn; ``replayed`` when the Idempotency-Key named an earlier one."""

    turnId: str
    status: str
    eventsUrl: str
    replayed: bool = False


class Notes(msgspec.Struct, kw_only=True):
    notes: str | None
    bytes: int


class _Messages(msgspec.Struct):
    messages: list[dict[str, Any]]


class _ErrorDetail(msgspec.Struct):
    code: str = "unknown"
    message: str = ""
    field: str | None = None
    activeTurnId: str | None = None
    turnId: str | None = None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


_session_decoder = msgspec.json.Decoder(Session)
_page_decoder = msgspec.json.Decoder(SessionPage)
_accepted_decoder = msgspec.json.Decoder(TurnAccepted)
_notes_decoder = msgspec.json.Decoder(Notes)
_messages_decoder = msgspec.json.Decoder(_Messages)
_record_decoder = msgspec.json.Decoder(TurnRecord)
_error_decoder = msgspec.json.Decoder(_ErrorBody)
_encoder = msgspec.json.Encoder()


# --- errors -----------------------------------------------------------------------------


class TurnbusError(Exception):
    """Any failure of a client call."""


class ApiError(TurnbusError):
    """The gateway refused the request: ``status``, the API's ``code`` and its sentence."""

    def __init__(self, status: int, code: str, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.field = field


class Unauthorized(ApiError):
    """``401``: no token, a bad or an expired one."""


class NotFound(ApiError):
    """``404``: no such session or turn for this user."""


class Conflict(ApiError):
    """``409 conflict``: an Idempotency-Key reused with another body, a stale meta write."""

    def __init__(self, status: int, code: str, message: str, *, turn_id: str | None = None,
                 field: str | None = None) -> None:  # fmt: skip
        super().__init__(status, code, message, field=field)
        self.turn_id = turn_id


class SessionBusy(ApiError):
    """``409 session_busy``: the session has an active turn; wait, cancel it, or enqueue."""

    def __init__(self, status: int, code: str, message: str, *, active_turn_id: str) -> None:
        super().__init__(status, code, message)
        self.active_turn_id = active_turn_id


class SessionQueueFull(ApiError):
    """``429 session_queue_full``: too many turns wait on the session; retry after
    ``retry_after`` seconds (None when the gateway did not say)."""

    def __init__(self, status: int, code: str, message: str, *, retry_after: float | None) -> None:
        super().__init__(status, code, message)
        self.retry_after = retry_after


class Unavailable(ApiError):
    """``503``: the gateway cannot reach Redis; retried by the calls that are safe to retry."""


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
    code, message = detail.code, detail.message
    if code == "session_busy":
        return SessionBusy(status, code, message, active_turn_id=detail.activeTurnId or "")
    if status == 429 or code == "session_queue_full":
        retry_after = _retry_after(resp.headers.get("retry-after"))
        return SessionQueueFull(status, code, message, retry_after=retry_after)
    if status == 401:
        return Unauthorized(status, code, message)
    if status == 404:
        return NotFound(status, code, message)
    if status == 409:
        return Conflict(status, code, message, turn_id=detail.turnId, field=detail.field)
    if status == 503:
        return Unavailable(status, code, message)
    return ApiError(status, code, message, field=detail.field)


# --- shared by both clients -------------------------------------------------------------


def _path(session_id: str, suffix: str = "") -> str:
    return f"/v1/sessions/{quote(session_id, safe='')}{suffix}"


def _list_params(limit: int | None, cursor: str | None) -> dict[str, str | int]:
    params: dict[str, str | int] = {}
    if limit is not None:
        params["limit"] = limit
    if cursor is not None:
        params["cursor"] = cursor
    return params


def _turn_path(session_id: str, turn_id: str, suffix: str = "") -> str:
    return _path(session_id, f"/turns/{quote(turn_id, safe='')}{suffix}")


class _Backoff:
    """Delays between reconnects: ``base`` doubling to ``cap``, with jitter; reset on progress."""

    def __init__(self, base_s: float, cap_s: float, max_tries: int) -> None:
        self.base_s, self.cap_s, self.max_tries = base_s, cap_s, max_tries
        self.tries = 0

    def reset(self) -> None:
        self.tries = 0

    def next_delay(self) -> float | None:
        """The delay before the next try, or None when the tries are used up."""
        self.tries += 1
        if self.tries > self.max_tries:
            return None
        delay: float = min(self.cap_s, self.base_s * 2 ** (self.tries - 1))
        return delay * random.uniform(0.5, 1.0)


class _Cursor:
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


_RETRYABLE = (httpx.TransportError,)


def _stream_submit(
    session_id: str, message: str, multitask: str, timeout: httpx.Timeout
) -> dict[str, Any]:
    """A submit that asks for the turn's events (``build_request`` arguments), under a
    new key, so a retry is a replay."""
    return {
        "method": "POST",
        "url": _path(session_id, "/turns"),
        "content": _encoder.encode({"message": message, "multitask": multitask}),
        "headers": {
            "content-type": "application/json",
            "Accept": "text/event-stream",
            "Idempotency-Key": str(uuid.uuid4()),
        },
        "timeout": timeout,
    }


def _should_retry_status(status: int) -> bool:
    return status in (502, 503, 504)


# --- the sync client --------------------------------------------------------------------


class EventStream:
    """The events of one stream, as an iterator; reconnects by itself.

    ``last_event_id`` is the id of the last entry yielded (pass it as ``after=`` to
    pick up later); ``reconnects`` counts the reconnections so far.
    """

    def __init__(
        self, client: Client, url: str, cursor: _Cursor, opened: httpx.Response | None = None
    ) -> None:
        self._client = client
        self._url = url
        self._cursor = cursor
        # A response already streaming this turn's events (a submit that asked for
        # them): read first; reconnects GET ``url``.
        self._opened = opened
        self._events = self._run()

    @property
    def last_event_id(self) -> str | None:
        return self._cursor.last_event_id

    @property
    def reconnects(self) -> int:
        return self._cursor.reconnects

    def __iter__(self) -> Iterator[StreamEvent]:
        return self

    def __next__(self) -> StreamEvent:
        return next(self._events)

    def close(self) -> None:
        self._events.close()
        if self._opened is not None:
            self._opened.close()
            self._opened = None

    def _run(self) -> Generator[StreamEvent, None, None]:
        cursor, client = self._cursor, self._client
        backoff = client._backoff()
        while not cursor.done:
            failure = "the stream ended before the turn did"
            try:
                opened, self._opened = self._opened, None
                with (
                    contextlib.closing(opened)
                    if opened is not None
                    else client._http.stream(
                        "GET", self._url, headers=cursor.headers(), timeout=client._stream_timeout
                    )
                ) as resp:
                    if resp.status_code == 204:  # already past the terminal event
                        return
                    if resp.status_code != 200:
                        resp.read()
                        if not _should_retry_status(resp.status_code):
                            raise api_error(resp)
                        failure = f"the gateway answered {resp.status_code}"
                    else:
                        for message in iter_sse(resp.iter_lines()):
                            event = cursor.take(message)
                            if event is None:
                                failure = "the gateway dropped the stream"
                                break
                            backoff.reset()
                            yield event
                            if cursor.done:
                                return
                        else:
                            if not cursor.ends:
                                failure = "the stream ended"
            except _RETRYABLE as exc:
                failure = f"{type(exc).__name__}: {exc}"
            delay = backoff.next_delay()
            if delay is None:
                raise StreamLost(
                    f"could not resume the event stream after {backoff.max_tries} tries: {failure}",
                    cursor.last_event_id,
                )
            cursor.reconnects += 1
            time.sleep(delay)


class Client:
    """A synchronous client; use it as a context manager or call :meth:`close`."""

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
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            transport=transport,
        )
        self._stream_timeout = httpx.Timeout(timeout, read=stream_read_timeout)
        self._max_reconnects = max_reconnects
        self._backoff_s, self._backoff_max_s = backoff_s, backoff_max_s

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _backoff(self) -> _Backoff:
        return _Backoff(self._backoff_s, self._backoff_max_s, self._max_reconnects)

    def _request(
        self, method: str, path: str, *, retry: bool = False, **kwargs: Any
    ) -> httpx.Response:
        """One call; with ``retry`` (safe to repeat) a lost connection or a 5xx is retried."""
        backoff = self._backoff()
        while True:
            try:
                resp = self._http.request(method, path, **kwargs)
            except _RETRYABLE:
                delay = backoff.next_delay() if retry else None
                if delay is None:
                    raise
                time.sleep(delay)
                continue
            if resp.is_success:
                return resp
            if retry and _should_retry_status(resp.status_code):
                delay = backoff.next_delay()
                if delay is not None:
                    time.sleep(delay)
                    continue
            raise api_error(resp)

    # sessions

    def create_session(self, meta: Mapping[str, Any] | None = None) -> Session:
        body = {"meta": dict(meta)} if meta else {}
        resp = self._request("POST", "/v1/sessions", content=_encoder.encode(body),
                             headers={"content-type": "application/json"})  # fmt: skip
        return _session_decoder.decode(resp.content)

    def list_sessions(self, *, limit: int | None = None, cursor: str | None = None) -> SessionPage:
        """A page of your sessions, newest first; pass its ``nextCursor`` for the next page
        (``None`` on the last). ``limit``: 1 to 100, default 20."""
        resp = self._request("GET", "/v1/sessions", retry=True, params=_list_params(limit, cursor))
        return _page_decoder.decode(resp.content)

    def get_session(self, session_id: str) -> Session:
        return _session_decoder.decode(self._request("GET", _path(session_id), retry=True).content)

    def delete_session(self, session_id: str) -> None:
        self._request("DELETE", _path(session_id))

    def notes(self, session_id: str) -> Notes:
        resp = self._request("GET", _path(session_id, "/notes"), retry=True)
        return _notes_decoder.decode(resp.content)

    def system(self, session_id: str) -> str:
        return self._request("GET", _path(session_id, "/system"), retry=True).text

    def messages(self, session_id: str) -> list[dict[str, Any]]:
        resp = self._request("GET", _path(session_id, "/messages"), retry=True)
        return _messages_decoder.decode(resp.content).messages

    # turns

    def submit_turn(
        self,
        session_id: str,
        message: str,
        *,
        multitask: Multitask = "reject",
        idempotency_key: str | None = None,
    ) -> TurnAccepted:
        """Submit a turn; retried on a lost connection or a 503 under the same key."""
        key = idempotency_key or str(uuid.uuid4())
        resp = self._request(
            "POST",
            _path(session_id, "/turns"),
            retry=True,
            content=_encoder.encode({"message": message, "multitask": multitask}),
            headers={"content-type": "application/json", "Idempotency-Key": key},
        )
        accepted = _accepted_decoder.decode(resp.content)
        accepted.replayed = resp.headers.get("idempotent-replayed") == "true"
        return accepted

    def get_turn(self, session_id: str, turn_id: str) -> TurnRecord:
        resp = self._request("GET", _turn_path(session_id, turn_id), retry=True)
        return _record_decoder.decode(resp.content)

    def cancel_turn(self, session_id: str, turn_id: str) -> TurnRecord:
        resp = self._request("POST", _turn_path(session_id, turn_id, "/cancel"), retry=True)
        return _record_decoder.decode(resp.content)

    def events(self, session_id: str, turn_id: str, *, after: str | None = None) -> EventStream:
        """A turn's events from the start (or after ``after``), ending after the terminal one."""
        return EventStream(self, _turn_path(session_id, turn_id, "/events"), _Cursor(after, True))

    def session_events(self, session_id: str, *, after: str | None = None) -> EventStream:
        """The session log, open-ended: patches, notes, turns' terminal events."""
        return EventStream(self, _path(session_id, "/events"), _Cursor(after, False))

    def run_turn(
        self, session_id: str, message: str, *, multitask: Multitask = "reject"
    ) -> EventStream:
        """Submit a turn and follow it, in one request (the submit answers with the
        turn's events); a dropped stream resumes with ``GET …/events``. A refused
        submit raises here, as :meth:`submit_turn` does."""
        request = self._http.build_request(
            **_stream_submit(session_id, message, multitask, self._stream_timeout)
        )
        backoff = self._backoff()
        while True:
            try:
                resp = self._http.send(request, stream=True)
            except _RETRYABLE:
                delay = backoff.next_delay()
                if delay is None:
                    raise
                time.sleep(delay)
                continue
            if resp.status_code == 200:
                url = _turn_path(session_id, resp.headers["x-turn-id"], "/events")
                return EventStream(self, url, _Cursor(None, True), opened=resp)
            resp.read()
            resp.close()
            delay = backoff.next_delay() if _should_retry_status(resp.status_code) else None
            if delay is None:
                raise api_error(resp)
            time.sleep(delay)


# --- the async client -------------------------------------------------------------------


class AsyncEventStream:
    """The async twin of :class:`EventStream`."""

    def __init__(
        self,
        client: AsyncClient,
        url: str,
        cursor: _Cursor,
        opened: httpx.Response | None = None,
    ) -> None:
        self._client = client
        self._url = url
        self._cursor = cursor
        self._opened = opened
        self._events = self._run()

    @property
    def last_event_id(self) -> str | None:
        return self._cursor.last_event_id

    @property
    def reconnects(self) -> int:
        return self._cursor.reconnects

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self

    async def __anext__(self) -> StreamEvent:
        return await anext(self._events)

    async def aclose(self) -> None:
        await self._events.aclose()
        if self._opened is not None:
            await self._opened.aclose()
            self._opened = None

    async def _run(self) -> AsyncGenerator[StreamEvent, None]:
        cursor, client = self._cursor, self._client
        backoff = client._backoff()
        while not cursor.done:
            failure = "the stream ended before the turn did"
            try:
                opened, self._opened = self._opened, None
                async with (
                    contextlib.aclosing(opened)
                    if opened is not None
                    else client._http.stream(
                        "GET", self._url, headers=cursor.headers(), timeout=client._stream_timeout
                    )
                ) as resp:
                    if resp.status_code == 204:
                        return
                    if resp.status_code != 200:
                        await resp.aread()
                        if not _should_retry_status(resp.status_code):
                            raise api_error(resp)
                        failure = f"the gateway answered {resp.status_code}"
                    else:
                        async for message in aiter_sse(resp.aiter_lines()):
                            event = cursor.take(message)
                            if event is None:
                                failure = "the gateway dropped the stream"
                                break
                            backoff.reset()
                            yield event
                            if cursor.done:
                                return
                        else:
                            if not cursor.ends:
                                failure = "the stream ended"
            except _RETRYABLE as exc:
                failure = f"{type(exc).__name__}: {exc}"
            delay = backoff.next_delay()
            if delay is None:
                raise StreamLost(
                    f"could not resume the event stream after {backoff.max_tries} tries: {failure}",
                    cursor.last_event_id,
                )
            cursor.reconnects += 1
            await asyncio.sleep(delay)


class AsyncClient:
    """An asyncio client; ``async with`` it or await :meth:`aclose`."""

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
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            transport=transport,
        )
        self._stream_timeout = httpx.Timeout(timeout, read=stream_read_timeout)
        self._max_reconnects = max_reconnects
        self._backoff_s, self._backoff_max_s = backoff_s, backoff_max_s

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def _backoff(self) -> _Backoff:
        return _Backoff(self._backoff_s, self._backoff_max_s, self._max_reconnects)

    async def _request(
        self, method: str, path: str, *, retry: bool = False, **kwargs: Any
    ) -> httpx.Response:
        backoff = self._backoff()
        while True:
            try:
                resp = await self._http.request(method, path, **kwargs)
            except _RETRYABLE:
                delay = backoff.next_delay() if retry else None
                if delay is None:
                    raise
                await asyncio.sleep(delay)
                continue
            if resp.is_success:
                return resp
            if retry and _should_retry_status(resp.status_code):
                delay = backoff.next_delay()
                if delay is not None:
                    await asyncio.sleep(delay)
                    continue
            raise api_error(resp)

    async def create_session(self, meta: Mapping[str, Any] | None = None) -> Session:
        body = {"meta": dict(meta)} if meta else {}
        resp = await self._request("POST", "/v1/sessions", content=_encoder.encode(body),
                                   headers={"content-type": "application/json"})  # fmt: skip
        return _session_decoder.decode(resp.content)

    async def list_sessions(
        self, *, limit: int | None = None, cursor: str | None = None
    ) -> SessionPage:
        """A page of your sessions, newest first (see :meth:`Client.list_sessions`)."""
        params = _list_params(limit, cursor)
        resp = await self._request("GET", "/v1/sessions", retry=True, params=params)
        return _page_decoder.decode(resp.content)

    async def get_session(self, session_id: str) -> Session:
        resp = await self._request("GET", _path(session_id), retry=True)
        return _session_decoder.decode(resp.content)

    async def delete_session(self, session_id: str) -> None:
        await self._request("DELETE", _path(session_id))

    async def notes(self, session_id: str) -> Notes:
        resp = await self._request("GET", _path(session_id, "/notes"), retry=True)
        return _notes_decoder.decode(resp.content)

    async def system(self, session_id: str) -> str:
        return (await self._request("GET", _path(session_id, "/system"), retry=True)).text

    async def messages(self, session_id: str) -> list[dict[str, Any]]:
        resp = await self._request("GET", _path(session_id, "/messages"), retry=True)
        return _messages_decoder.decode(resp.content).messages

    async def submit_turn(
        self,
        session_id: str,
        message: str,
        *,
        multitask: Multitask = "reject",
        idempotency_key: str | None = None,
    ) -> TurnAccepted:
        key = idempotency_key or str(uuid.uuid4())
        resp = await self._request(
            "POST",
            _path(session_id, "/turns"),
            retry=True,
            content=_encoder.encode({"message": message, "multitask": multitask}),
            headers={"content-type": "application/json", "Idempotency-Key": key},
        )
        accepted = _accepted_decoder.decode(resp.content)
        accepted.replayed = resp.headers.get("idempotent-replayed") == "true"
        return accepted

    async def get_turn(self, session_id: str, turn_id: str) -> TurnRecord:
        resp = await self._request("GET", _turn_path(session_id, turn_id), retry=True)
        return _record_decoder.decode(resp.content)

    async def cancel_turn(self, session_id: str, turn_id: str) -> TurnRecord:
        resp = await self._request("POST", _turn_path(session_id, turn_id, "/cancel"), retry=True)
        return _record_decoder.decode(resp.content)

    def events(
        self, session_id: str, turn_id: str, *, after: str | None = None
    ) -> AsyncEventStream:
        return AsyncEventStream(
            self, _turn_path(session_id, turn_id, "/events"), _Cursor(after, True)
        )

    def session_events(self, session_id: str, *, after: str | None = None) -> AsyncEventStream:
        return AsyncEventStream(self, _path(session_id, "/events"), _Cursor(after, False))

    async def run_turn(
        self, session_id: str, message: str, *, multitask: Multitask = "reject"
    ) -> AsyncEventStream:
        request = self._http.build_request(
            **_stream_submit(session_id, message, multitask, self._stream_timeout)
        )
        backoff = self._backoff()
        while True:
            try:
                resp = await self._http.send(request, stream=True)
            except _RETRYABLE:
                delay = backoff.next_delay()
                if delay is None:
                    raise
                await asyncio.sleep(delay)
                continue
            if resp.status_code == 200:
                url = _turn_path(session_id, resp.headers["x-turn-id"], "/events")
                return AsyncEventStream(self, url, _Cursor(None, True), opened=resp)
            await resp.aread()
            await resp.aclose()
            delay = backoff.next_delay() if _should_retry_status(resp.status_code) else None
            if delay is None:
                raise api_error(resp)
            await asyncio.sleep(delay)

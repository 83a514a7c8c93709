"""``turnbus chat``: a terminal client of the HTTP API.

It creates a session (or reuses one), reads a line, posts it as a turn and follows
the turn's SSE stream: text deltas print as they arrive, a ``working_notes`` event
as a one-line notice, then the terminal event. Ctrl-C during a turn cancels it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import IO, Any
from urllib.parse import quote

import httpx
import msgspec

from shared.events import (
    TextDelta,
    ToolCall,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnTimedOut,
    UnknownEvent,
    WorkingNotes,
    decode_event,
    is_terminal,
)

__all__ = ["Chat", "ChatError", "iter_sse"]

HELP = "Type a message and press Enter. Commands: /notes  /system  /help  /quit"
_RECONNECTS = 5


class ChatError(Exception):
    """The gateway refused or could not be reached; the message says what happened."""


class SseMessage(msgspec.Struct, frozen=True):
    id: str | None
    event: str | None
    data: str


def iter_sse(lines: Iterator[str]) -> Iterator[SseMessage]:
    """Parse ``text/event-stream`` lines into messages (comments and pings skipped)."""
    event_id: str | None = None
    event: str | None = None
    data: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data:
                yield SseMessage(id=event_id, event=event, data="\n".join(data))
            event, data = None, []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            data.append(value)
        elif field == "id":
            event_id = value
        elif field == "event":
            event = value


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        err = body.get("error", {}) if isinstance(body, dict) else {}
        if isinstance(err, dict) and err.get("message"):
            return f"{resp.status_code} {err.get('code', '')}: {err['message']}".replace(" :", ":")
    except ValueError:
        pass
    return f"{resp.status_code} {resp.reason_phrase}"


class Chat:
    def __init__(
        self,
        url: str,
        token: str,
        *,
        out: IO[str],
    ) -> None:
        self.url = url.rstrip("/")
        self.out = out
        self.client = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(10.0, read=60.0),
        )
        self.session = ""

    def close(self) -> None:
        self.client.close()

    def _say(self, text: str = "", end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ChatError(f"cannot reach {self.url}: {exc}") from None

    def _path(self, suffix: str = "") -> str:
        return f"/v1/sessions/{quote(self.session, safe='')}{suffix}"

    def open_session(self, session: str | None) -> str:
        if session:
            self.session = session
            resp = self._request("GET", self._path())
            if resp.status_code != 200:
                raise ChatError(f"session {session}: {_error_text(resp)}")
        else:
            resp = self._request("POST", "/v1/sessions", json={})
            if resp.status_code != 201:
                raise ChatError(f"creating a session: {_error_text(resp)}")
            self.session = str(resp.json()["sessionId"])
        return self.session

    def show_notes(self) -> None:
        resp = self._request("GET", self._path("/notes"))
        if resp.status_code != 200:
            self._say(f"! {_error_text(resp)}")
            return
        body = resp.json()
        notes = body.get("notes") or ""
        if not notes:
            self._say("(no working notes)")
        else:
            self._say(f"--- working notes ({body.get('bytes', len(notes.encode()))} bytes) ---")
            self._say(notes)
            self._say("---")

    def show_system(self) -> None:
        resp = self._request("GET", self._path("/system"))
        if resp.status_code != 200:
            self._say(f"! {_error_text(resp)}")
            return
        self._say(resp.text)

    def send(self, message: str) -> str | None:
        """Post a turn and follow it; returns the terminal event's type (None if refused)."""
        resp = self._request("POST", self._path("/turns"), json={"message": message})
        if resp.status_code != 202:
            self._say(f"! {_error_text(resp)}")
            return None
        body = resp.json()
        turn_id = str(body["turnId"])
        events_url = str(body.get("eventsUrl") or self._path(f"/turns/{turn_id}/events"))
        return self.follow(turn_id, events_url)

    def cancel(self, turn_id: str) -> None:
        with contextlib.suppress(ChatError):
            self._request("POST", self._path(f"/turns/{quote(turn_id, safe='')}/cancel"))

    def follow(self, turn_id: str, events_url: str) -> str:
        last_id: str | None = None
        cancelled = False
        reconnects = 0
        in_text = False  # the cursor is after agent text, not at a line start
        while True:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                with self.client.stream("GET", events_url, headers=headers) as resp:
                    if resp.status_code != 200:
                        resp.read()
                        raise ChatError(f"following the turn: {_error_text(resp)}")
                    for message in iter_sse(resp.iter_lines()):
                        reconnects = 0
                        if message.id:
                            last_id = message.id
                        event = decode_event(message.data)
                        if isinstance(event, TextDelta):
                            self._say(event.text if in_text else "agent> " + event.text, end="")
                            in_text = not event.text.endswith("\n")
                            continue
                        notice = _notice(event)
                        if notice is None:
                            continue
                        if in_text:
                            self._say()
                            in_text = False
                        self._say(f"  [{notice}]")
                        if is_terminal(event):
                            return _type_of(event)
            except KeyboardInterrupt:
                if cancelled:
                    raise
                cancelled = True
                self._say("\n  [cancelling; Ctrl-C again to leave]")
                in_text = False
                self.cancel(turn_id)
                continue
            except httpx.HTTPError as exc:
                reconnects += 1
                if reconnects > _RECONNECTS:
                    raise ChatError(f"lost the event stream: {exc}") from None
                continue
            # The stream ended before a terminal event: resume from the last id.
            reconnects += 1
            if reconnects > _RECONNECTS:
                raise ChatError("the event stream kept ending before the turn did")

    def _read_line(self, lines: IO[str]) -> str | None:
        """The next line, None at end of input. A terminal gets line editing (input())."""
        if lines.isatty():
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  (input() then edits and keeps history)
            try:
                return input("you> ")
            except EOFError:
                return None
        self._say("you> ", end="")
        line = lines.readline()
        return line if line else None

    def repl(self, lines: IO[str]) -> int:
        self._say(f"session {self.session} on {self.url}. {HELP}")
        while True:
            try:
                line = self._read_line(lines)
            except KeyboardInterrupt:
                line = None
            if line is None:
                self._say()
                return 0
            text = line.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                return 0
            if text == "/notes":
                self.show_notes()
            elif text == "/system":
                self.show_system()
            elif text == "/help":
                self._say(HELP)
            elif text.startswith("/") and " " not in text:
                self._say(f"unknown command {text}. {HELP}")
            else:
                self.send(text)


def _type_of(event: Any) -> str:
    if isinstance(event, UnknownEvent):
        return event.type
    tag = type(event).__struct_config__.tag
    return str(tag)


def _notice(event: Any) -> str | None:
    match event:
        case WorkingNotes(action="clear"):
            return "working notes cleared" + ("" if event.persisted else " (NOT persisted)")
        case WorkingNotes():
            saved = "" if event.persisted else " (NOT persisted)"
            return f"working notes updated: {event.bytes} bytes{saved}"
        case ToolCall():
            return f"tool {event.name}"
        case TurnCompleted():
            return f"turn.completed ({event.stopReason})"
        case TurnFailed():
            return f"turn.failed: {event.reason}" + (f" — {event.message}" if event.message else "")
        case TurnCancelled():
            return "turn.cancelled"
        case TurnTimedOut():
            return "turn.timed_out"
        case UnknownEvent() if is_terminal(event):
            return event.type
    return None

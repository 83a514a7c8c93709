"""``turnbus chat``: a terminal client of the HTTP API.

It creates a session (or reuses one, showing its last few exchanges from
``GET …/messages`` before the prompt), reads a line, posts it as a turn and follows
the turn's SSE stream: text deltas print as they arrive, a ``working_notes`` event
as a one-line notice, then the terminal event. Ctrl-C during a turn cancels it.
Everything goes through :class:`turnbus.Client` (which resumes a broken stream).
"""

from __future__ import annotations

import contextlib
from typing import IO, Any

import httpx

from shared.events import (
    Resync,
    TextDelta,
    ToolCall,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnTimedOut,
    UnknownEvent,
    WorkingNotes,
    event_type,
    is_terminal,
)
from turnbus.client import ApiError, Client, EventStream, TurnbusError

__all__ = ["Chat", "ChatError", "exchanges"]

HELP = "Type a message and press Enter. Commands: /notes  /system  /help  /quit"


class ChatError(Exception):
    """The gateway refused or could not be reached; the message says what happened."""


def _text_of(content: Any) -> str:
    """The plain text of a message's content (a string, or text blocks among others)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts = [b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text"]
    return "".join(p for p in parts if isinstance(p, str))


def _is_prompt(row: dict[str, Any]) -> bool:
    if row.get("role") != "user":
        return False
    kind = row.get("kind")
    if kind is not None:
        return bool(kind == "prompt")
    return bool(_text_of(row.get("content")))  # no tool_result-only rows


def exchanges(messages: list[dict[str, Any]], last: int) -> list[tuple[str, str]]:
    """The last ``last`` (prompt, reply text) pairs of a session's model-facing history."""
    pairs: list[tuple[str, list[str]]] = []
    for row in messages:
        if _is_prompt(row):
            pairs.append((_text_of(row.get("content")), []))
        elif pairs and row.get("role") == "assistant":
            text = _text_of(row.get("content"))
            if text:
                pairs[-1][1].append(text)
    return [(prompt, "".join(reply)) for prompt, reply in pairs[-last:]] if last > 0 else []


class Chat:
    def __init__(self, url: str, token: str, *, out: IO[str]) -> None:
        self.url = url.rstrip("/")
        self.out = out
        self.client = Client(self.url, token)
        self.session = ""

    def close(self) -> None:
        self.client.close()

    def _say(self, text: str = "", end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    def open_session(self, session: str | None) -> str:
        try:
            if session:
                self.session = self.client.get_session(session).sessionId
            else:
                self.session = self.client.create_session().sessionId
        except ApiError as exc:
            what = f"session {session}" if session else "creating a session"
            raise ChatError(f"{what}: {exc}") from None
        except httpx.HTTPError as exc:
            raise ChatError(f"cannot reach {self.url}: {exc}") from None
        return self.session

    def show_history(self, last: int) -> None:
        """The last few exchanges of the session, before the first prompt."""
        try:
            messages = self.client.messages(self.session)
        except (TurnbusError, httpx.HTTPError) as exc:
            self._say(f"! cannot read the history: {exc}")
            return
        shown = exchanges(messages, last)
        if not shown:
            return
        prompts = sum(1 for row in messages if _is_prompt(row))
        earlier = f"; {prompts - len(shown)} earlier not shown" if prompts > len(shown) else ""
        plural = "s" if len(shown) > 1 else ""
        self._say(f"--- the last {len(shown)} exchange{plural} of this session{earlier} ---")
        for prompt, reply in shown:
            self._say(f"[you]   {prompt}")
            self._say(f"[agent] {reply or '(no text)'}")
        self._say("---")

    def show_notes(self) -> None:
        try:
            body = self.client.notes(self.session)
        except (TurnbusError, httpx.HTTPError) as exc:
            self._say(f"! {exc}")
            return
        if not body.notes:
            self._say("(no working notes)")
        else:
            self._say(f"--- working notes ({body.bytes} bytes) ---")
            self._say(body.notes)
            self._say("---")

    def show_system(self) -> None:
        try:
            self._say(self.client.system(self.session))
        except (TurnbusError, httpx.HTTPError) as exc:
            self._say(f"! {exc}")

    def send(self, message: str) -> str | None:
        """Post a turn and follow it; returns the terminal event's type (None if refused)."""
        try:
            accepted = self.client.submit_turn(self.session, message)
        except ApiError as exc:
            self._say(f"! {exc}")
            return None
        except httpx.HTTPError as exc:
            raise ChatError(f"cannot reach {self.url}: {exc}") from None
        return self.follow(accepted.turnId)

    def cancel(self, turn_id: str) -> None:
        with contextlib.suppress(TurnbusError, httpx.HTTPError):
            self.client.cancel_turn(self.session, turn_id)

    def follow(self, turn_id: str) -> str:
        cancelled = False
        in_text = False  # the cursor is after agent text, not at a line start
        after: str | None = None
        while True:
            stream: EventStream = self.client.events(self.session, turn_id, after=after)
            try:
                for event in stream:
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
                        return event_type(event)
                return "ended"  # already past the terminal event
            except KeyboardInterrupt:
                if cancelled:
                    raise
                cancelled = True
                after = stream.last_event_id
                self._say("\n  [cancelling; Ctrl-C again to leave]")
                in_text = False
                self.cancel(turn_id)
            except TurnbusError as exc:
                raise ChatError(f"following the turn: {exc}") from None
            finally:
                stream.close()

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


def _notice(event: Any) -> str | None:
    match event:
        case WorkingNotes(action="clear"):
            return "working notes cleared" + ("" if event.persisted else " (NOT persisted)")
        case WorkingNotes():
            saved = "" if event.persisted else " (NOT persisted)"
            return f"working notes updated: {event.bytes} bytes{saved}"
        case ToolCall():
            return f"tool {event.name}"
        case Resync():
            return "some earlier events of this turn are gone; carrying on from the oldest kept"
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

"""``turnbus chat``: a terminal client of the HTTP API.

It creates a session (or reuses one, showing its last few exchanges from
``GET …/messages`` before the prompt; ``--list`` prints your sessions instead),
reads a line, posts it as a turn and follows the turn's SSE stream: text deltas print as they arrive, a ``working_notes`` event
as a one-line notice, then the terminal event (see :class:`TurnPrinter`, also for a
round played again by a new attempt). Ctrl-C during a turn cancels it. A turn that
pauses for its caller (``turn.requires_action``) is answered at the prompt: each call
awaiting approval asks ``approve? [y/n/e]`` (``n`` then asks for a reason, ``e`` for
the input to run it with, a JSON object); a client tool's call, which the chat cannot
run, is answered with an error result.
Everything goes through :class:`turnbus.Client` (which resumes a broken stream).
"""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import Callable
from typing import IO, Any

import httpx

from turnbus.client import (
    ApiError,
    ApprovalAnswer,
    Client,
    EventStream,
    SessionSummary,
    ToolResultAnswer,
    TurnbusError,
    TurnNotWaiting,
)
from turnbus.shared.events import (
    Resync,
    RoundStarted,
    RoundWaiting,
    TextDelta,
    ToolCall,
    ToolResult,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnRequiresAction,
    TurnStarted,
    TurnTimedOut,
    UnknownEvent,
    WorkingNotes,
    event_type,
    is_terminal,
)
from turnbus.shared.session_index import LIST_LIMIT_MAX

__all__ = ["Chat", "ChatError", "TurnPrinter", "attempt_cause", "exchanges", "session_line"]

HELP = (
    "Type a message and press Enter (it interrupts a turn of this session that is still "
    "running). Commands: /queue MESSAGE (wait for it instead)  /notes  /system  /help  /quit"
)
NO_CLIENT_TOOLS = "ERROR turnbus chat cannot run the client tool {name!r}"
# A pause's answer that the chat's input ended before: nothing runs without a yes.
INPUT_ENDED = "the person at the chat left without deciding"


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
    """The last ``last`` (prompt, reply text) pairs of a session's model-facing history;
    the text of each model round of a reply on a line of its own."""
    pairs: list[tuple[str, list[str]]] = []
    for row in messages:
        if _is_prompt(row):
            pairs.append((_text_of(row.get("content")), []))
        elif pairs and row.get("role") == "assistant":
            text = _text_of(row.get("content")).strip()
            if text:
                pairs[-1][1].append(text)
    return [(prompt, "\n".join(reply)) for prompt, reply in pairs[-last:]] if last > 0 else []


def session_line(row: SessionSummary) -> str:
    """One session of ``--list``: id, creation time (local), title, notes, active turn."""
    created = datetime.datetime.fromtimestamp(row.created_at / 1000).strftime("%Y-%m-%d %H:%M")
    parts = [row.session_id, created, row.title or "(untitled)"]
    if row.notes_bytes:
        parts.append(f"notes {row.notes_bytes} B")
    if row.active_turn is not None:
        parts.append(f"turn {row.active_turn.turn_id} {row.active_turn.status}")
    return "  ".join(parts)


class Chat:
    def __init__(self, url: str, token: str, *, out: IO[str], queue: bool = False) -> None:
        self.url = url.rstrip("/")
        self.out = out
        # A message sent while a turn of the session runs (another client's) interrupts
        # it, unless ``queue``: then it waits for it.
        self.queue = queue
        self.client = Client(self.url, token)
        self.session = ""
        self.lines: IO[str] | None = None  # where answers to a pause are read from

    def close(self) -> None:
        self.client.close()

    def _say(self, text: str = "", end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    def open_session(self, session: str | None, *, title: str | None = None) -> str:
        """Reuse ``session``, or create one (titled ``title`` when given)."""
        try:
            if session:
                self.session = self.client.get_session(session).session_id
            else:
                self.session = self.client.create_session(title=title).session_id
        except ApiError as exc:
            what = f"session {session}" if session else "creating a session"
            raise ChatError(f"{what}: {exc}") from None
        except httpx.HTTPError as exc:
            raise ChatError(f"cannot reach {self.url}: {exc}") from None
        return self.session

    def list_sessions(self, resume_hint: str) -> None:
        """Every session of the user, newest first, one line each; then how to resume one."""
        cursor: str | None = None
        shown = 0
        try:
            while True:
                page = self.client.list_sessions(limit=LIST_LIMIT_MAX, cursor=cursor)
                for row in page.sessions:
                    self._say(session_line(row))
                shown += len(page.sessions)
                cursor = page.next_cursor
                if cursor is None:
                    break
        except ApiError as exc:
            raise ChatError(f"listing sessions: {exc}") from None
        except httpx.HTTPError as exc:
            raise ChatError(f"cannot reach {self.url}: {exc}") from None
        if not shown:
            self._say("(no sessions yet)")
        else:
            self._say(f"resume one with: {resume_hint}")

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
            self._say("[agent] " + (reply or "(no text)").replace("\n", "\n        "))
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

    def send(self, message: str, *, queue: bool | None = None) -> str | None:
        """Post a turn and follow it; returns the terminal event's type (None if refused).
        It interrupts the session's running turn, or (``queue``) waits for it."""
        queued = self.queue if queue is None else queue
        try:
            accepted = self.client.submit_turn(
                self.session, message, multitask="enqueue" if queued else "interrupt"
            )
        except ApiError as exc:
            self._say(f"! {exc}")
            return None
        except httpx.HTTPError as exc:
            raise ChatError(f"cannot reach {self.url}: {exc}") from None
        return self.follow(accepted.turn_id)

    def cancel(self, turn_id: str) -> None:
        with contextlib.suppress(TurnbusError, httpx.HTTPError):
            self.client.cancel_turn(self.session, turn_id)

    def follow(self, turn_id: str) -> str:
        cancelled = False
        printer = TurnPrinter(self._say)
        after: str | None = None
        while True:
            stream: EventStream = self.client.events(self.session, turn_id, after=after)
            try:
                for event in stream:
                    ended = printer.show(event)
                    if ended is not None:
                        return ended
                    if isinstance(event, TurnRequiresAction):
                        self.answer_pause(printer, event)
                return "ended"  # already past the terminal event
            except KeyboardInterrupt:
                if cancelled:
                    raise
                cancelled = True
                after = stream.last_event_id
                printer.notice("cancelling; Ctrl-C again to leave")
                self.cancel(turn_id)
            except TurnbusError as exc:
                raise ChatError(f"following the turn: {exc}") from None
            finally:
                stream.close()

    def answer_pause(self, printer: TurnPrinter, event: TurnRequiresAction) -> None:
        """Ask about each call the turn waits on, then answer them all at once (asked
        again if the gateway refuses the answer, e.g. an edit that does not fit)."""
        while True:
            results: list[ToolResultAnswer] = []
            approvals: list[ApprovalAnswer] = []
            for call in event.calls:
                args = json.dumps(call.input, ensure_ascii=False)
                if call.kind == "approval":
                    printer.notice(f"approval needed: {call.name} {args}")
                    approvals.append(self._decide(call.callId))
                else:
                    printer.notice(f"the agent asks this client to run {call.name}; chat cannot")
                    output = NO_CLIENT_TOOLS.format(name=call.name)
                    results.append(ToolResultAnswer(call.callId, output, True))
            try:
                self.client.submit_actions(
                    self.session, event.turnId, tool_results=results, approvals=approvals
                )
                return
            except ApiError as exc:
                if isinstance(exc, TurnNotWaiting):
                    return  # answered elsewhere meanwhile
                printer.notice(f"! {exc}")
                if exc.status != 422:
                    return

    def _decide(self, call_id: str) -> ApprovalAnswer:
        while True:
            choice = self._ask("approve? [y/n/e] ")
            if choice is None:
                return ApprovalAnswer(call_id, "reject", reason=INPUT_ENDED)
            choice = choice.strip().lower()
            if choice in ("y", "yes"):
                return ApprovalAnswer(call_id, "approve")
            if choice in ("n", "no"):
                reason = (self._ask("reason: ") or "").strip()
                return ApprovalAnswer(call_id, "reject", reason=reason or None)
            if choice in ("e", "edit"):
                edited = self._ask("input (a JSON object): ")
                if edited is None:
                    return ApprovalAnswer(call_id, "reject", reason=INPUT_ENDED)
                try:
                    value = json.loads(edited)
                except ValueError as exc:
                    self._say(f"! not JSON: {exc}")
                    continue
                if not isinstance(value, dict):
                    self._say("! the input must be a JSON object")
                    continue
                return ApprovalAnswer(call_id, "edit", input=value)
            self._say("answer y (approve), n (reject) or e (edit the input)")

    def _ask(self, prompt: str) -> str | None:
        """One line of the answers' input (the repl's), None at its end."""
        lines = self.lines
        if lines is None:
            return None
        if lines.isatty():
            try:
                return input(prompt)
            except EOFError:
                return None
        self._say(prompt, end="")
        line = lines.readline()
        return line.rstrip("\n") if line else None

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
        self.lines = lines
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
            elif text.startswith("/queue "):
                self.send(text.removeprefix("/queue ").strip(), queue=True)
            elif text.startswith("/") and " " not in text:
                self._say(f"unknown command {text}. {HELP}")
            else:
                self.send(text)


class TurnPrinter:
    """Prints one turn's events as they come: text as it streams, notices on lines of
    their own, a round's text on a new line after another round's.

    A new attempt (after a worker was lost) plays again the round that was streaming
    (docs/worker.md): its text supersedes what was printed of that round. A terminal
    cannot take text back, so the replay is held against what was printed: while it
    repeats it, nothing is printed; past it, only the rest is; if it differs, a line
    says so and the round's new text follows whole."""

    def __init__(self, say: Callable[..., None]) -> None:
        self._say = say
        self._in_text = False  # the cursor is after agent text, not at a line start
        self._round: int | None = None  # the round whose text was printed last
        self._printed: dict[int, str] = {}  # each round's text as printed
        self._calls: dict[str, ToolCall] = {}  # calls whose result has not come yet
        self._attempt = 1
        self._replay: tuple[int, str] | None = None  # a replayed round, its text so far

    def show(self, event: Any) -> str | None:
        """Print ``event``; returns the terminal event's type once the turn has ended."""
        if isinstance(event, TextDelta):
            self._text(event.round, event.text)
            return None
        self._settle()
        if isinstance(event, TurnStarted) and event.attempt > 1:
            self._attempt = event.attempt
            if event.after == "answered":
                # The attempt the answer to a pause started: it plays nothing again.
                self.notice(f"attempt {event.attempt}: the turn goes on with the answers")
            else:
                self.notice(
                    f"{attempt_cause(event)}; the round it was streaming plays again, shown once"
                )
        elif isinstance(event, RoundStarted) and event.round in self._printed:
            self._replay = (event.round, "")
        elif isinstance(event, ToolCall):
            self._calls[event.callId] = event  # one line per call, once its result is in
            return None
        elif isinstance(event, ToolResult):
            self.notice(_call_line(self._calls.pop(event.callId, None), event))
            return None
        notice = _notice(event)
        if notice is not None:
            self.notice(notice)
        return event_type(event) if is_terminal(event) else None

    def notice(self, text: str) -> None:
        if self._in_text:
            self._say()
            self._in_text = False
        self._say(f"  [{text}]")

    def _text(self, rnd: int, text: str) -> None:
        if self._replay is not None and self._replay[0] == rnd:
            replayed = self._replay[1] + text
            shown = self._printed[rnd]
            if shown.startswith(replayed):
                self._replay = (rnd, replayed)  # so far the same text again
                return
            self._replay = None
            self._printed[rnd] = replayed
            if replayed.startswith(shown):
                self._write(rnd, replayed[len(shown) :], resumed=True)
            else:
                self._rewritten(rnd, replayed)
            return
        self._printed[rnd] = self._printed.get(rnd, "") + text
        self._write(rnd, text)

    def _settle(self) -> None:
        """A replayed round that ended short of what was printed: say so, print it whole."""
        if self._replay is None:
            return
        rnd, replayed = self._replay
        self._replay = None
        if replayed != self._printed[rnd]:
            self._printed[rnd] = replayed
            self._rewritten(rnd, replayed)

    def _rewritten(self, rnd: int, text: str) -> None:
        self.notice(f"attempt {self._attempt} wrote round {rnd} anew; it replaces the text above")
        self._write(rnd, text)

    def _write(self, rnd: int, text: str, *, resumed: bool = False) -> None:
        if not text:
            return
        if self._in_text and self._round != rnd:
            self._say()
            self._in_text = False
        lead = "" if self._in_text else ("agent> …" if resumed else "agent> ")
        self._say(lead + text, end="")
        self._in_text = not text.endswith("\n")
        self._round = rnd


def _short(text: str, limit: int = 60) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _call_line(call: ToolCall | None, result: ToolResult) -> str:
    """``tool lookup {"term": "lease"} → ok, 12 ms: lease: found`` (the notes' text is
    never shown: events carry only its digest)."""
    args = _short(json.dumps(call.input, ensure_ascii=False), 40) if call is not None else ""
    state = "ERROR" if result.isError else "ok"
    head = f"tool {result.name} {args}".rstrip()
    return f"{head} → {state}, {result.durationMs} ms: {_short(result.output)}"


def attempt_cause(event: TurnStarted) -> str:
    """Why a new attempt runs, as its ``turn.started`` says (the console says the same)."""
    if event.after == "redis_lost":
        return (
            f"attempt {event.attempt}: the worker lost Redis for {event.redisLostMs / 1000:.0f} s"
        )
    return f"attempt {event.attempt} after a worker was lost"


def _notice(event: Any) -> str | None:
    match event:
        case WorkingNotes(action="clear"):
            return "working notes cleared" + ("" if event.persisted else " (NOT persisted)")
        case WorkingNotes():
            saved = "" if event.persisted else " (NOT persisted)"
            return f"working notes updated: {event.bytes} bytes{saved}"
        case RoundWaiting():
            return f"waiting for the model ({event.reason}, about {event.waitMs / 1000:.0f} s)"
        case TurnRequiresAction():
            return f"the turn waits for {len(event.calls)} answer(s)"
        case Resync():
            return "some earlier events of this turn are gone; carrying on from the oldest kept"
        case TurnCompleted():
            return f"turn.completed ({event.stopReason})"
        case TurnFailed():
            return f"turn.failed: {event.reason}" + (f" — {event.message}" if event.message else "")
        case TurnCancelled(reason="interrupted", by=str(by)):
            return f"turn.cancelled (interrupted by {by})"
        case TurnCancelled():
            return "turn.cancelled"
        case TurnTimedOut():
            return "turn.timed_out"
        case UnknownEvent() if is_terminal(event):
            return event.type
    return None

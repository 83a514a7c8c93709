"""The always-on working-notes tools, bound to the turn's own user and session.

The model sees three tools (``NOTES_TOOL_SPECS``). :class:`NotesTools` executes them for
one turn: it reads and writes ``meta.workingNotes`` of the turn record's session only —
any user or session id in the model's tool input is ignored (no confused deputy).
``update`` and ``clear`` write through the worker overlay and emit one ``working_notes``
event (size and digest, never the text) for the turn stream and the session log. In a
turn (``fold``) a write is held in memory and stored by the round's commit
(``lua/turn_round.lua``), which also logs and stamps its event; else (and with
``TURNBUS_WAIT_REPLICAS``) it persists at once in a call of its own. The result strings
are the original design's, verbatim. Given the attempt's lease token, a write made at
once is fenced by the session lease: an attempt that lost its lease writes nothing and
gets :class:`~turnbus.shared.envelope.LeaseNotHeld`, which abandons the attempt (no event, no
result); a held write is fenced with its commit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from collections.abc import Callable
from typing import Any, Literal

import redis.asyncio as aioredis

from turnbus.shared import caps
from turnbus.shared.envelope import EnvelopeStore, SessionNotFound
from turnbus.shared.events import Event, WorkingNotes, encode_event, notes_digest
from turnbus.shared.keys import Keys
from turnbus.shared.meta import (
    MetaInvalid,
    MetaTooLarge,
    sanitize_working_notes,
    trim_notes,
    utf8_len,
)
from turnbus.shared.records import now_ms
from turnbus.shared.settings import Settings
from turnbus.worker.cancellation import shield_until_done
from turnbus.worker.models.base import ToolSpec
from turnbus.worker.retry import REDIS_ERRORS

__all__ = [
    "NOTES_CLEARED",
    "NOTES_EMPTY",
    "NOTES_OVER_CAP",
    "NOTES_TOOL_NAMES",
    "NOTES_TOOL_SPECS",
    "NOTES_UNAVAILABLE",
    "NOTES_UPDATED",
    "NOTES_UPDATED_NOT_PERSISTED",
    "NotesTools",
    "ToolOutcome",
    "redact_notes",
    "redact_tool_input",
]

log = logging.getLogger(__name__)

NOTES_EMPTY = "(empty — no working notes for this session)"
NOTES_UNAVAILABLE = "(unavailable)"
NOTES_UPDATED = (
    "working notes updated ({bytes} bytes) — this block is folded into every future turn "
    "of this session"
)
NOTES_UPDATED_NOT_PERSISTED = "working notes updated in-turn; persistence unavailable"
NOTES_CLEARED = "working notes cleared — this is a new mind for this session"
NOTES_OVER_CAP = (
    "ERROR working_notes_update: notes exceed the 32 KiB cap "
    "({size} bytes asked; the cap is {cap} bytes) — the stored notes are unchanged"
)
NOTES_NOT_TEXT = "ERROR working_notes_update: notes must be a string of UTF-8 text"
UNKNOWN_TOOL = "ERROR unknown tool {name!r}: the tools are {names}"

_NO_SECRETS = "Never write secrets (API keys, tokens, passwords, credentials) into the notes."

NOTES_TOOL_SPECS: list[ToolSpec] = [
    {
        "name": "working_notes_get",
        "description": (
            "Read this session's working notes: the small block of agent-authored memory "
            "that is also folded into your system prompt. Takes no arguments."
        ),
        "input_schema": {"type": "object", "properties": {}},
    },
    {
        "name": "working_notes_update",
        "description": (
            "Replace this session's working notes with `notes` (the whole block, not a "
            "diff; at most 32 KiB of UTF-8, never truncated — an over-cap write is refused). "
            "The block persists at once and is folded into every later model "
            "round of this session. An empty string clears it. " + _NO_SECRETS
        ),
        "input_schema": {
            "type": "object",
            "properties": {
                "notes": {
                    "type": "string",
                    "description": "The complete new notes block. " + _NO_SECRETS,
                }
            },
            "required": ["notes"],
        },
    },
    {
        "name": "working_notes_clear",
        "description": (
            "Wipe this session's working notes (a new mind for this session). Takes no arguments."
        ),
        "input_schema": {"type": "object", "properties": {}},
    },
]
NOTES_TOOL_NAMES = frozenset(spec["name"] for spec in NOTES_TOOL_SPECS)

_REDACTED = "[working notes: {bytes} bytes, sha256 {sha256}]"
_REDACTED_RE = re.compile(r"\[working notes: \d+ bytes, sha256 [0-9a-f]{64}\]")


def redact_notes(text: str) -> str:
    """What the events and the stored history keep of notes text: its size and digest.
    Idempotent: a redacted text stays as it is."""
    if _REDACTED_RE.fullmatch(text):
        return text
    digest = notes_digest(text)
    return _REDACTED.format(bytes=digest.bytes, sha256=digest.sha256)


def redact_tool_input(name: str, tool_input: dict[str, Any]) -> dict[str, Any]:
    """A tool call's input as events and the stored history keep it: the notes of a
    ``working_notes_update`` become their digest (the envelope holds the only copy, so
    a clear leaves none behind)."""
    notes = tool_input.get("notes")
    if name != "working_notes_update" or not isinstance(notes, str):
        return tool_input
    return {**tool_input, "notes": redact_notes(notes)}


# Store failures that mean "persistence unavailable", never a crashed turn.
_STORE_ERRORS = (
    *REDIS_ERRORS,
    SessionNotFound,
    MetaTooLarge,
    MetaInvalid,
)


@dataclasses.dataclass(frozen=True, slots=True)
class ToolOutcome:
    """A tool's result. ``max_bytes`` is where the engine cuts its output: the generic
    tool-result cap, except for the notes, which reach the model whole (up to their own
    32 KiB cap)."""

    output: str
    is_error: bool = False
    max_bytes: int = caps.TOOL_RESULT_MAX_BYTES
    # The output is the notes' text: events and the stored history carry its digest.
    holds_notes: bool = False
    # A notes write held for the round's commit: its result holds once that commit did.
    deferred: bool = False


_UNSET: Any = object()


class NotesTools:
    """The notes tools of one turn, bound to the turn record's ``(user, session, turn)``."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        store: EnvelopeStore,
        *,
        user: str,
        session: str,
        turn_id: str,
        lease_token: str | None = None,
        events: Callable[[Event], None] | None = None,
        fold: Callable[[], int] | None = None,
    ) -> None:
        self._redis = redis
        self._events = events
        self._keys = keys
        self._settings = settings
        self._store = store
        self.user = user
        self.session = session
        self.turn_id = turn_id
        self.lease_token = lease_token
        # Notes written this turn that the envelope does not hold (yet): the turn's own
        # view of them (``None`` = cleared in-turn), until a later write persists.
        self._in_turn: str | None = _UNSET
        # ``fold`` (with ``events``): writes are held for the round's commit, which
        # stores them (``lua/turn_round.lua``); it answers the bytes the envelope's other
        # keys take, for the budget check a write must pass to be held.
        self._fold = fold
        self._pending: str = _UNSET  # the held value ("" = cleared)
        self._in_turn_held = False  # ``_in_turn`` is the held value

    @property
    def has_in_turn_notes(self) -> bool:
        """Whether this turn holds notes the envelope does not (persistence failed)."""
        return self._in_turn is not _UNSET

    @property
    def in_turn_notes(self) -> str | None:
        return None if self._in_turn is _UNSET else self._in_turn

    @property
    def held(self) -> str | None:
        """The notes write held for the next commit ("" = a clear), ``None`` if none."""
        return None if self._pending is _UNSET else self._pending

    def committed(self) -> None:
        """The commit stored the held write: the envelope holds the notes again."""
        self._pending = _UNSET
        if self._in_turn_held:
            self._in_turn = _UNSET
            self._in_turn_held = False

    def not_persisted(self) -> None:
        """The commit refused the held write (the meta budget filled meanwhile): the
        notes stay the turn's own, as for a write that failed at once."""
        self._pending = _UNSET
        self._in_turn_held = False

    async def execute(self, name: str, tool_input: dict[str, Any]) -> ToolOutcome:
        """Run one tool call. Never raises for a store failure: the model gets honest text."""
        if name == "working_notes_get":
            return await self._get()
        if name == "working_notes_update":
            return await self._update(tool_input.get("notes"))
        if name == "working_notes_clear":
            return await self._write("", "clear")
        names = ", ".join(sorted(NOTES_TOOL_NAMES))
        return ToolOutcome(UNKNOWN_TOOL.format(name=name, names=names), is_error=True)

    async def _get(self) -> ToolOutcome:
        if self.has_in_turn_notes:
            notes = self.in_turn_notes
        else:
            try:
                envelope = await self._store.read(self.user, self.session)
            except REDIS_ERRORS:
                log.warning("working_notes_get: store unavailable", exc_info=True)
                return ToolOutcome(NOTES_UNAVAILABLE)
            if envelope is None:
                return ToolOutcome(NOTES_UNAVAILABLE)
            notes = envelope.meta.workingNotes
        if not notes:
            return ToolOutcome(NOTES_EMPTY)
        return ToolOutcome(notes, max_bytes=caps.WORKING_NOTES_MAX_BYTES, holds_notes=True)

    async def _update(self, notes: object) -> ToolOutcome:
        if not isinstance(notes, str):
            return ToolOutcome(NOTES_NOT_TEXT, is_error=True)
        stripped = trim_notes(notes)
        size = utf8_len(stripped)
        if size is None:
            return ToolOutcome(NOTES_NOT_TEXT, is_error=True)
        if size > caps.WORKING_NOTES_MAX_BYTES:
            return ToolOutcome(
                NOTES_OVER_CAP.format(size=size, cap=caps.WORKING_NOTES_MAX_BYTES), is_error=True
            )
        if not stripped:
            return await self._write("", "clear")
        return await self._write(stripped, "update")

    async def _write(self, notes: str, action: Literal["update", "clear"]) -> ToolOutcome:
        if self._fold is not None and self._events is not None:
            return self._hold(notes, action)
        return await self._write_now(notes, action)

    def _hold(self, notes: str, action: Literal["update", "clear"]) -> ToolOutcome:
        """Hold the write for the round's commit (no Redis call here): its event goes to
        the outbox with ``updatedAt`` 0, which the commit completes with the write's
        clock, and the commit logs it. A write over the meta budget (as the envelope
        stood at the last commit) is not held: it stays the turn's own."""
        assert self._fold is not None and self._events is not None
        stored = sanitize_working_notes(notes) or ""
        raw = stored.encode("utf-8")
        fits = not raw or self._fold() + len("workingNotes") + len(raw) <= self._store.budget
        self._in_turn = stored or None
        self._in_turn_held = fits
        if fits:
            self._pending = stored
        self._events(
            WorkingNotes(
                action=action,
                bytes=len(raw),
                sha256=hashlib.sha256(raw).hexdigest(),
                persisted=fits,
                updatedAt=0 if fits else now_ms(),
                turnId=self.turn_id,
            )
        )
        if not fits:
            log.warning("working_notes_%s: over the meta budget, kept in-turn", action)
            return ToolOutcome(NOTES_UPDATED_NOT_PERSISTED)
        if action == "clear":
            return ToolOutcome(NOTES_CLEARED, deferred=True)
        return ToolOutcome(NOTES_UPDATED.format(bytes=len(raw)), deferred=True)

    async def _write_now(self, notes: str, action: Literal["update", "clear"]) -> ToolOutcome:
        """Persist and announce as one unit: a cancel (the turn's, or the wall clock's)
        that lands in between would leave a stored note with no ``working_notes`` event,
        so it is honoured only once both are written."""
        return await shield_until_done(self._persist_and_emit(notes, action))

    async def _persist_and_emit(
        self, notes: str, action: Literal["update", "clear"]
    ) -> ToolOutcome:
        # The envelope's sanitizer is the source of truth for what is stored.
        stored = sanitize_working_notes(notes) or ""
        size = len(stored.encode("utf-8"))
        digest = hashlib.sha256(stored.encode("utf-8")).hexdigest()

        def event(persisted: bool, updated_at: int) -> WorkingNotes:
            return WorkingNotes(
                action=action,
                bytes=size,
                sha256=digest,
                persisted=persisted,
                updatedAt=updated_at,
                turnId=self.turn_id,
            )

        # The write appends the event to the session log itself, with its updatedAt in
        # the place of the 0 (no text of the caller's comes before that field).
        head, mark, tail = encode_event(event(True, 0)).partition(b'"updatedAt":0')
        persisted = True
        updated_at: int | None
        try:
            updated_at = await self._store.worker_overlay(
                self.user,
                self.session,
                {"workingNotes": stored},
                lease_token=self.lease_token,
                log_after=(head + mark[:-1], tail) if mark else None,
            )
        except _STORE_ERRORS:
            log.warning("working_notes_%s: persistence unavailable", action, exc_info=True)
            persisted = False
            updated_at = None
        if persisted:
            self._in_turn = _UNSET
        else:
            self._in_turn = stored or None
        await self._emit(
            event(persisted, updated_at if updated_at is not None else now_ms()),
            logged=persisted and bool(mark),
        )
        if not persisted:
            return ToolOutcome(NOTES_UPDATED_NOT_PERSISTED)
        if action == "clear":
            return ToolOutcome(NOTES_CLEARED)
        return ToolOutcome(NOTES_UPDATED.format(bytes=size))

    async def _emit(self, event: WorkingNotes, *, logged: bool = False) -> None:
        """Append the event to the session log (unless ``logged``: the write did) and the
        turn stream: with an ``events`` sink (the engine's outbox) the turn stream gets it
        with the round's next write, else the appends go in one round trip. Either way it
        is handed over before a cancel of the write can land (the write is shielded)."""
        data = encode_event(event)
        k = self._keys
        if self._events is not None:
            self._events(event)
            if logged:
                return
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                if self._events is None:
                    pipe.xadd(
                        k.turn_events(self.user, self.session, self.turn_id),
                        {"data": data},
                        maxlen=self._settings.events_maxlen,
                        approximate=True,
                    )
                if not logged:
                    pipe.xadd(
                        k.log(self.user, self.session),
                        {"data": data},
                        maxlen=self._settings.log_maxlen,
                        approximate=True,
                    )
                await pipe.execute()
        except REDIS_ERRORS:
            log.warning("working_notes event not written", exc_info=True)

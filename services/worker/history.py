"""The model-facing history of a session: a Redis list of JSON rows (``keys.messages``).

Each row is one Anthropic message plus where it came from::

    {"role": "user", "content": [...], "turnId": "t_…", "round": 0, "kind": "prompt"}
    {"role": "assistant", "content": [...], "turnId": …, "round": 1, "kind": "assistant",
     "stopReason": "tool_use"}
    {"role": "user", "content": [tool_result…], "turnId": …, "round": 1, "kind": "tool_results"}

A turn stores its prompt row with its first commit and then one round at a time: the
assistant row and its tool results in the same call, so a ``tool_use`` is never stored
without its ``tool_result``. The commits are the turn's scripts
(:mod:`turnbus.worker.commit`), fenced by the session lease (a worker that lost its
lease cannot write); :meth:`SessionHistory.commit_plan` keeps the list within
``MODEL_MSG_MAX_ROWS`` and ``MODEL_MSG_MAX_BYTES`` by dropping the oldest whole
exchanges (a prompt and every round after it); when one exchange alone is over the caps,
its oldest rounds go, the prompt stays. Tool results over ``TOOL_RESULT_MAX_BYTES`` are cut with a marker the model can
read (:func:`truncate_tool_result`).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import msgspec
import redis.asyncio as aioredis

from turnbus.shared import caps
from turnbus.shared.contracts import THINKING_BLOCK_TYPES
from turnbus.shared.keys import Keys
from turnbus.shared.tool_specs import truncate_tool_result
from turnbus.worker.tools import redact_notes, redact_tool_input

__all__ = [
    "CommitPlan",
    "HistoryCache",
    "HistoryFenced",
    "SessionHistory",
    "TurnProgress",
    "assistant_row",
    "stored_row",
    "truncate_tool_result",
]


_encoder = msgspec.json.Encoder()
_row_decoder = msgspec.json.Decoder(dict[str, Any])


def _decode_row(data: bytes) -> dict[str, Any]:
    try:
        return _row_decoder.decode(data)
    except msgspec.DecodeError:
        return {"role": "user", "content": [], "kind": "invalid"}


class HistoryFenced(Exception):
    """The commit was refused: this attempt no longer holds the session lease."""


@dataclasses.dataclass(frozen=True, slots=True)
class CommitPlan:
    """How a commit stores new rows within the caps: ``mode`` "append" (after dropping
    ``drop`` rows from the head) or "replace" (the whole list), the encoded ``rows`` to
    push; and the rows and their sizes the history holds once it is stored."""

    mode: str
    drop: int
    rows: list[bytes]
    kept_rows: list[dict[str, Any]]
    kept_sizes: list[int]


def assistant_row(
    turn_id: str, rnd: int, content: list[dict[str, Any]], stop_reason: str
) -> dict[str, Any]:
    """A round's assistant message as a history row."""
    return {
        "role": "assistant",
        "content": content,
        "turnId": turn_id,
        "round": rnd,
        "kind": "assistant",
        "stopReason": stop_reason,
    }


def _has_thinking(row: dict[str, Any]) -> bool:
    content = row.get("content")
    return isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") in THINKING_BLOCK_TYPES for b in content
    )


def _thinking_turns(rows: list[dict[str, Any]]) -> set[Any]:
    return {row.get("turnId") for row in rows if _has_thinking(row)}


def stored_row(row: dict[str, Any], *, keep_thinking: bool = True) -> dict[str, Any]:
    """A row as Redis keeps it: the notes' text replaced by its digest (the notes of a
    ``working_notes_update`` call, the results listed in ``notesResults``), so the
    envelope holds the only copy; without ``keep_thinking``, no thinking blocks. The
    turn that wrote the row keeps the original in memory for its own later rounds."""
    content = row.get("content")
    if not isinstance(content, list):
        return row
    held = set(row.get("notesResults") or ())
    out: list[Any] = []
    changed = False
    for block in content:
        if isinstance(block, dict):
            kind = block.get("type")
            if kind in THINKING_BLOCK_TYPES and not keep_thinking:
                changed = True
                continue
            if kind == "tool_use" and isinstance(block.get("input"), dict):
                redacted = redact_tool_input(str(block.get("name")), block["input"])
                if redacted is not block["input"]:
                    block = {**block, "input": redacted}
                    changed = True
            elif (
                kind == "tool_result"
                and block.get("tool_use_id") in held
                and isinstance(block.get("content"), str)
            ):
                block = {**block, "content": redact_notes(block["content"])}
                changed = True
        out.append(block)
    return {**row, "content": out} if changed else row


@dataclasses.dataclass(frozen=True, slots=True)
class TurnProgress:
    """What a turn already committed: resume from ``last_round + 1``."""

    has_prompt: bool
    last_round: int
    last_stop: str | None  # the stop reason of the last committed assistant row


class SessionHistory:
    """The session's history as loaded by one turn attempt, and its commits."""

    def __init__(
        self,
        rows: list[dict[str, Any]],
        sizes: list[int],
        *,
        max_rows: int = caps.MODEL_MSG_MAX_ROWS,
        max_bytes: int = caps.MODEL_MSG_MAX_BYTES,
        thinking: set[Any] | None = None,
        stored: list[bytes] | None = None,
        stored_rows: list[dict[str, Any] | None] | None = None,
    ) -> None:
        self.rows = rows
        self.sizes = sizes
        # Each row as Redis holds it: its bytes, and its decoded dict when that is the
        # row in ``rows`` (a row this attempt wrote is held as written: None here).
        self.stored = stored
        self.stored_rows = stored_rows
        # What ``stored``/``stored_rows`` become once the commit last planned is stored.
        self._plan: tuple[list[bytes], list[dict[str, Any] | None]] | None = None
        # The turns whose rows (as this attempt holds them) have thinking blocks.
        self._thinking = _thinking_turns(rows) if thinking is None else thinking
        self.max_rows = max_rows
        self.max_bytes = max_bytes

    @classmethod
    async def load(
        cls,
        redis: aioredis.Redis,
        keys: Keys,
        user: str,
        session: str,
        *,
        max_rows: int = caps.MODEL_MSG_MAX_ROWS,
        max_bytes: int = caps.MODEL_MSG_MAX_BYTES,
    ) -> SessionHistory:
        raw = await redis.lrange(keys.messages(user, session), 0, -1)
        return cls.from_raw(raw, max_rows=max_rows, max_bytes=max_bytes)

    @classmethod
    def from_raw(
        cls,
        raw: list[Any],
        *,
        max_rows: int = caps.MODEL_MSG_MAX_ROWS,
        max_bytes: int = caps.MODEL_MSG_MAX_BYTES,
        held: _CacheEntry | None = None,
    ) -> SessionHistory:
        """The history from its stored rows as read elsewhere (the turn's start script):
        ``raw``, after the rows ``held`` from the session's last turn here, if any."""
        rows: list[dict[str, Any]] = list(held.rows) if held else []
        sizes: list[int] = [len(data) for data in held.stored] if held else []
        stored: list[bytes] = list(held.stored) if held else []
        thinking: set[Any] = set(held.thinking) if held else set()
        for item in raw:
            data = item.encode("utf-8", "surrogateescape") if isinstance(item, str) else item
            stored.append(data)
            row = _decode_row(data)
            # Only a row whose bytes name a thinking block can hold one: the others
            # are not looked into.
            if b"thinking" in data and _has_thinking(row):
                thinking.add(row.get("turnId"))
            rows.append(row)
            sizes.append(len(data))
        return cls(
            rows,
            sizes,
            max_rows=max_rows,
            max_bytes=max_bytes,
            thinking=thinking,
            stored=stored,
            stored_rows=list(rows),
        )

    def snapshot(self) -> tuple[list[bytes], list[dict[str, Any]]] | None:
        """The rows as Redis holds them now (bytes, decoded), to be cached for the
        session's next turn; ``None`` when this history does not track them."""
        if self.stored is None or self.stored_rows is None:
            return None
        rows = [
            row if row is not None else _decode_row(data)
            for data, row in zip(self.stored, self.stored_rows, strict=True)
        ]
        self.stored_rows = list(rows)
        return list(self.stored), rows

    def model_messages(self, pending: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The rows as Anthropic messages, starting with a user message and alternating
        roles: rows with no content are left out, and consecutive rows of one role are
        merged into one message (a cancelled or failed turn leaves its prompt or its tool
        results with no assistant reply after them; a ``pause_turn`` round is continued
        by another assistant row)."""
        messages: list[dict[str, Any]] = []
        for row in [*self.rows, *(pending or ())]:
            role, content = row.get("role"), row.get("content")
            if role not in ("user", "assistant") or not content:
                continue
            if not messages and role != "user":
                continue
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            if messages and messages[-1]["role"] == role:
                messages[-1]["content"] = [*messages[-1]["content"], *blocks]
            else:
                messages.append({"role": role, "content": list(blocks)})
        return messages

    def progress(self, turn_id: str) -> TurnProgress:
        has_prompt = False
        last_round = 0
        last_stop: str | None = None
        for row in self.rows:
            if row.get("turnId") != turn_id:
                continue
            if row.get("kind") == "prompt":
                has_prompt = True
            rnd = row.get("round")
            if isinstance(rnd, int) and rnd >= last_round:
                last_round = rnd
                if row.get("kind") == "assistant":
                    stop = row.get("stopReason")
                    last_stop = stop if isinstance(stop, str) else None
        return TurnProgress(has_prompt=has_prompt, last_round=last_round, last_stop=last_stop)

    def holds_thinking(self) -> bool:
        """Whether a row as loaded or committed by this attempt has thinking blocks."""
        return bool(self._thinking)

    def commit_plan(
        self, new_rows: list[dict[str, Any]], *, live_turn: str | None = None
    ) -> CommitPlan:
        """How to store ``new_rows`` within the caps (for a round's commit or the
        finish, :mod:`turnbus.worker.commit`), and the rows and sizes kept once stored.

        Thinking blocks are stored only in the rows of ``live_turn`` (the running turn:
        a resumed attempt must send them back to continue its tool loop); stored rows of
        any other turn that still hold some are rewritten without them, so thinking
        never outlives its turn (the finish passes no ``live_turn``)."""

        def stored(row: dict[str, Any]) -> bytes:
            keep = live_turn is not None and row.get("turnId") == live_turn
            return _encoder.encode(stored_row(row, keep_thinking=keep))

        encoded = [stored(row) for row in new_rows]
        rows = self.rows + new_rows
        sizes = self.sizes + [len(e) for e in encoded]
        drop, rewrite = _trim_plan(rows, sizes, self.max_rows, self.max_bytes)
        stale = any(live_turn is None or turn != live_turn for turn in self._thinking)
        if rewrite is None and stale:
            rewrite = list(range(drop, len(rows)))
        if rewrite is None:
            kept_rows, kept_sizes = rows[drop:], sizes[drop:]
            stored_drop = min(drop, len(self.rows))
            pushed = encoded[max(drop - len(self.rows), 0) :]
            plan = CommitPlan("append", stored_drop, pushed, kept_rows, kept_sizes)
            if self.stored is not None and self.stored_rows is not None:
                self._plan = (
                    [*self.stored[stored_drop:], *pushed],
                    [*self.stored_rows[stored_drop:], *([None] * len(pushed))],
                )
        else:
            kept_rows = [rows[i] for i in rewrite]
            rewritten = [stored(row) for row in kept_rows]
            kept_sizes = [len(e) for e in rewritten]
            plan = CommitPlan("replace", 0, rewritten, kept_rows, kept_sizes)
            self._plan = (rewritten, [None] * len(rewritten))
        return plan

    def committed(self, plan: CommitPlan) -> None:
        """Record that a commit built by :meth:`commit_plan` was stored."""
        rows, sizes = plan.kept_rows, plan.kept_sizes
        old = self.rows
        if old and len(rows) >= len(old) and rows[0] is old[0] and rows[len(old) - 1] is old[-1]:
            self._thinking |= _thinking_turns(rows[len(old) :])  # appended, nothing dropped
        else:
            self._thinking = _thinking_turns(rows)
        stored, self._plan = self._plan, None
        if stored is not None:
            self.stored, self.stored_rows = stored
        self.rows, self.sizes = rows, sizes


@dataclasses.dataclass(frozen=True, slots=True)
class _CacheEntry:
    stored: list[bytes]
    rows: list[dict[str, Any]]
    thinking: frozenset[Any]
    size: int


class HistoryCache:
    """The histories of the sessions whose turns this worker ran last, as Redis holds
    them, so that a session's next turn here neither reads nor decodes its whole history
    again: the start script checks that the list still has the same length and the same
    last row (every row names its turn and round, so another writer's rows differ) and
    then answers ``cached`` instead of the rows. Least recently used first out, within
    ``max_bytes`` of stored rows."""

    def __init__(self, max_bytes: int = 32 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _CacheEntry] = OrderedDict()
        self._bytes = 0

    def check_args(self, key: str) -> tuple[str, bytes]:
        """The start script's ``(known length, known last row)`` for the list ``key``."""
        entry = self._entries.get(key)
        if entry is None or not entry.stored:
            return "0", b""
        return str(len(entry.stored)), entry.stored[-1]

    def get(self, key: str) -> _CacheEntry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, history: SessionHistory) -> None:
        self.drop(key)
        snapshot = history.snapshot()
        if snapshot is None:
            return
        stored, rows = snapshot
        size = sum(len(data) for data in stored)
        if not stored or size > self.max_bytes:
            return
        thinking = frozenset(
            row.get("turnId")
            for data, row in zip(stored, rows, strict=True)
            if b"thinking" in data and _has_thinking(row)
        )
        self._entries[key] = _CacheEntry(stored, rows, thinking, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.size

    def drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.size

    def __len__(self) -> int:
        return len(self._entries)


def _is_prompt(row: dict[str, Any]) -> bool:
    return row.get("kind") == "prompt"


def _trim_plan(
    rows: list[dict[str, Any]], sizes: list[int], max_rows: int, max_bytes: int
) -> tuple[int, list[int] | None]:
    """How to fit the caps: ``(n, None)`` drops the first ``n`` rows (whole exchanges);
    ``(0, kept indexes)`` rewrites the list when one exchange alone is over the caps."""
    total_rows = len(rows)
    total_bytes = sum(sizes)
    start = 0

    def over() -> bool:
        return total_rows - start > max_rows or total_bytes > max_bytes

    while over():
        # The next exchange starts at the next prompt row after ``start``.
        nxt = next((i for i in range(start + 1, len(rows)) if _is_prompt(rows[i])), None)
        if nxt is None:
            break
        total_bytes -= sum(sizes[start:nxt])
        start = nxt
    if not over():
        return start, None
    # One exchange left and still over: drop its oldest rounds, keep its prompt row.
    kept = list(range(start, len(rows)))
    head = [kept[0]] if _is_prompt(rows[kept[0]]) else []
    body = kept[len(head) :]
    count = len(kept)
    while (count > max_rows or total_bytes > max_bytes) and len(body) > 1:
        # A round is an assistant row plus the tool-results row that answers it.
        unit = 2 if len(body) > 1 and rows[body[1]].get("kind") == "tool_results" else 1
        if len(body) <= unit:
            break
        for i in body[:unit]:
            total_bytes -= sizes[i]
        count -= unit
        body = body[unit:]
    return 0, head + body

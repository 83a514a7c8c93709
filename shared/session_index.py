"""The per-user index of sessions behind ``GET /v1/sessions``: newest first, cursor paged.

One sorted set per user (``Keys.user_sessions``). Every member has score 0 and reads
``<createdAt as 16 digits>:<sessionId>``, so the set's lexical order is creation order
(ties broken by id) and a cursor, the last member a page looked at, resumes exactly even
when that session has been deleted since.

The index is not in any session's slot (a Redis Cluster keeps it apart), so it is written
by a command of its own after the session's script, never inside one. Such a write can be
missed (a crash between the two): a page drops and removes entries whose session is gone,
and :meth:`SessionIndex.backfill` adds sessions the index lacks (sessions created before
the index existed, or a missed add).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import re
from collections.abc import Sequence

import redis.asyncio as aioredis

from turnbus.shared import caps
from turnbus.shared.contracts import ACTIVE_STATUSES, ActiveStatus
from turnbus.shared.keys import InvalidId, Keys, validate_id
from turnbus.shared.meta import sanitize_meta
from turnbus.shared.records import ActiveTurn, SessionPage, SessionSummary
from turnbus.shared.scripts import text

__all__ = [
    "LIST_LIMIT_DEFAULT",
    "LIST_LIMIT_MAX",
    "BadCursor",
    "SessionIndex",
]

LIST_LIMIT_DEFAULT = 20
LIST_LIMIT_MAX = 100

_CLOCK_DIGITS = 16  # 2^53 - 1 has 16 digits: every createdAt fits, zero-padded
_ACTIVE: dict[str, ActiveStatus] = {status: status for status in ACTIVE_STATUSES}
_MEMBER_RE = re.compile(rf"^([0-9]{{{_CLOCK_DIGITS}}}):(.+)$")
_BACKFILL_BATCH = 500


class BadCursor(ValueError):
    """A cursor this server did not hand out (HTTP 400)."""


def _member(created_at: int, session: str) -> str:
    return f"{created_at:0{_CLOCK_DIGITS}d}:{session}"


def _parse_member(member: str) -> tuple[int, str] | None:
    match = _MEMBER_RE.match(member)
    if match is None:
        return None
    try:
        return int(match.group(1)), validate_id(match.group(2), "session")
    except InvalidId:
        return None


def encode_cursor(member: str) -> str:
    return base64.urlsafe_b64encode(member.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> str:
    """The index member a cursor names; :class:`BadCursor` if it is not one of ours."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        member = raw.decode("ascii")
    except (binascii.Error, ValueError):
        raise BadCursor("cursor is not one this server handed out") from None
    if not cursor or _parse_member(member) is None or encode_cursor(member) != cursor:
        raise BadCursor("cursor is not one this server handed out")
    return member


def _int(value: object) -> int:
    try:
        return int(text(value))
    except ValueError:
        return 0


def _summary(session: str, fields: Sequence[object], notes_bytes: object) -> SessionSummary | None:
    """A row from the envelope's fields; ``None`` when there is no envelope."""
    created, updated, title = fields
    if updated is None:
        return None  # every envelope has updatedAt: no hash, no session
    size = _int(notes_bytes)
    return SessionSummary(
        sessionId=session,
        title=sanitize_meta({"title": text(title)} if title is not None else {}).title,
        createdAt=_int(created),
        updatedAt=_int(updated),
        activeTurn=None,
        # Notes over their cap are poison, read as unset everywhere.
        notesBytes=size if size <= caps.WORKING_NOTES_MAX_BYTES else 0,
    )


class SessionIndex:
    """Reads and writes the per-user sessions index; each method says its round trips."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def add(self, user: str, session: str, created_at: int) -> None:
        """Index a session (one ZADD; idempotent)."""
        await self.redis.zadd(self.keys.user_sessions(user), {_member(created_at, session): 0})

    async def remove(self, user: str, session: str, created_at: int) -> None:
        """Drop a session from the index (one ZREM)."""
        await self.redis.zrem(self.keys.user_sessions(user), _member(created_at, session))

    async def page(self, user: str, *, cursor: str | None, limit: int) -> SessionPage:
        """A page of ``user``'s sessions, newest first. Round trips: the index; one
        pipeline reading each session; one reading the status of their unfinished turns
        (when there are some); a ZREM when the index named sessions that are gone.

        Raises :class:`BadCursor`. A page may hold fewer than ``limit`` sessions when the
        index held entries of deleted sessions; only ``nextCursor is None`` means the end.
        """
        if not 1 <= limit <= LIST_LIMIT_MAX:
            raise ValueError(f"limit must be from 1 to {LIST_LIMIT_MAX}")
        key = self.keys.user_sessions(user)
        upper = "(" + decode_cursor(cursor) if cursor is not None else "+"
        found = [text(m) for m in await self.redis.zrevrangebylex(key, upper, "-", 0, limit + 1)]
        members = found[:limit]
        next_cursor = encode_cursor(members[-1]) if len(found) > limit else None
        rows = [(m, _parse_member(m)) for m in members]
        readable = [(m, parsed[1]) for m, parsed in rows if parsed is not None]
        stale = [m for m, parsed in rows if parsed is None]
        replies: list[object] = []
        if readable:
            async with self.redis.pipeline(transaction=False) as pipe:
                for _, session in readable:
                    env = self.keys.env(user, session)
                    pipe.hmget(env, "createdAt", "updatedAt", "title")
                    pipe.hstrlen(env, "workingNotes")
                    pipe.lindex(self.keys.active(user, session), 0)
                replies = await pipe.execute()
        sessions: list[SessionSummary] = []
        for i, (member, session) in enumerate(readable):
            fields, notes_bytes, active = replies[3 * i : 3 * i + 3]
            summary = _summary(session, fields, notes_bytes)  # type: ignore[arg-type]
            if summary is None:
                stale.append(member)
                continue
            if active is not None:
                with contextlib.suppress(InvalidId):
                    turn_id = validate_id(text(active), "turn")
                    summary.activeTurn = ActiveTurn(turnId=turn_id, status="queued")
            sessions.append(summary)
        await self._turn_statuses(user, sessions)
        if stale:
            # The session is gone (a delete whose ZREM was missed): forget it.
            await self.redis.zrem(key, *stale)
        return SessionPage(sessions=sessions, nextCursor=next_cursor)

    async def _turn_statuses(self, user: str, sessions: list[SessionSummary]) -> None:
        """Each active turn's status from its record (one pipeline, when there are some)."""
        active = [s for s in sessions if s.activeTurn is not None]
        if not active:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for row in active:
                assert row.activeTurn is not None
                pipe.hget(self.keys.turn(user, row.sessionId, row.activeTurn.turnId), "status")
            statuses = await pipe.execute()
        for row, status in zip(active, statuses, strict=True):
            assert row.activeTurn is not None
            now = _ACTIVE.get(text(status))
            if now is None:
                row.activeTurn = None  # it ended (or expired) since the list was read
            else:
                row.activeTurn.status = now

    async def backfill(self) -> int:
        """Index every session the index lacks; returns how many were added.

        SCANs the whole keyspace for envelopes (``<prefix>:{<user>:<session>}:env``), so it
        is a one-off for an operator (``turnbus reindex-sessions``), never a request's work.
        """
        added = 0
        batch: list[tuple[str, str]] = []

        async def flush() -> int:
            async with self.redis.pipeline(transaction=False) as pipe:
                for user, session in batch:
                    pipe.hget(self.keys.env(user, session), "createdAt")
                created = await pipe.execute()
            async with self.redis.pipeline(transaction=False) as pipe:
                for (user, session), at in zip(batch, created, strict=True):
                    if at is not None:
                        member = _member(_int(at), session)
                        pipe.zadd(self.keys.user_sessions(user), {member: 0})
                counts = await pipe.execute()
            batch.clear()
            return sum(int(c) for c in counts)

        async for raw in self.redis.scan_iter(match=self.keys.env_pattern(), count=1000):
            ids = self.keys.env_ids(text(raw))
            if ids is None:
                continue
            try:
                batch.append((validate_id(ids[0], "user"), validate_id(ids[1])))
            except InvalidId:
                continue
            if len(batch) >= _BACKFILL_BATCH:
                added += await flush()
        if batch:
            added += await flush()
        return added

"""The envelope store: a session's meta in a Redis hash, written only by one Lua script.

Every write (create, host replace, worker overlay) is one ``EVALSHA`` of
``lua/envelope_write.lua``, which validates the clock and the byte budget, applies
the change, bumps ``updatedAt`` and appends one ``envelope.patched`` entry to the
session log — so the log and the envelope can never disagree.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from turnbus.shared import caps
from turnbus.shared.events import notes_digest
from turnbus.shared.keys import Keys
from turnbus.shared.meta import (
    HOST_META_KEYS,
    Meta,
    MetaTooLarge,
    check_updated_at,
    sanitize_meta,
    validate_host_meta,
    validate_worker_patch,
)
from turnbus.shared.records import now_ms
from turnbus.shared.redispy import UNDECODED
from turnbus.shared.replicas import ReplicaWait
from turnbus.shared.scripts import LuaScript, pairs
from turnbus.shared.scripts import text as _s
from turnbus.shared.session_index import SessionIndex

__all__ = [
    "ClockAhead",
    "Envelope",
    "EnvelopeConflict",
    "EnvelopeStore",
    "LeaseNotHeld",
    "SessionExists",
    "SessionNotFound",
]

log = logging.getLogger(__name__)


class Envelope(msgspec.Struct, kw_only=True):
    """What ``GET /v1/sessions/{id}`` answers; poison already dropped."""

    sessionId: str
    updatedAt: int
    createdAt: int
    meta: Meta


class EnvelopeConflict(Exception):
    """The write's ``updatedAt`` is not strictly newer than the stored one (HTTP 409)."""

    def __init__(self, current: Envelope) -> None:
        super().__init__(
            f"stale write: the envelope is at updatedAt={current.updatedAt}; "
            "send a strictly newer updatedAt"
        )
        self.current = current


class ClockAhead(Exception):
    """A host ``updatedAt`` further ahead of the server's clock than the window (HTTP 422)."""

    def __init__(self, updated_at: int, server_ms: int) -> None:
        hours = caps.UPDATED_AT_MAX_AHEAD_MS // 3_600_000
        super().__init__(
            f"updatedAt {updated_at} is more than {hours} h ahead of the server's clock "
            f"({server_ms}): check the host's clock"
        )
        self.updated_at = updated_at
        self.server_ms = server_ms


class SessionNotFound(LookupError):
    """No envelope for that user and session (HTTP 404)."""


class SessionExists(Exception):
    """``create`` found an envelope already there."""


class LeaseNotHeld(Exception):
    """A fenced worker overlay was refused: the session lease is not held by its token."""


def envelope_from_hash(session: str, flat: Mapping[str, str]) -> Envelope:
    """Build an :class:`Envelope` from a stored hash, dropping poison to unset."""
    return Envelope(
        sessionId=session,
        updatedAt=_int_or_zero(flat.get("updatedAt")),
        createdAt=_int_or_zero(flat.get("createdAt")),
        meta=sanitize_meta(flat),
    )


def _int_or_zero(value: str | None) -> int:
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0


class EnvelopeStore:
    """Async access to session envelopes. Every write is one Lua script on the session's
    slot; create and delete also keep the user's sessions index (its own command after)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        log_maxlen: int = 10_000,
        budget: int = caps.HARNESS_SESSION_MAX_META_BYTES,
        replicas: ReplicaWait | None = None,
        session_ttl_ms: int = 0,
    ) -> None:
        self.redis = redis
        # Create and host replace start the session's lifetime again (0: no lifetime).
        self.session_ttl_ms = session_ttl_ms
        # Every write is acknowledged only once these replicas have it.
        self.replicas = replicas or ReplicaWait()
        self.keys = keys
        self.log_maxlen = log_maxlen
        self.budget = budget
        self._write = LuaScript(redis, "envelope_write.lua")
        self._delete = LuaScript(redis, "session_delete.lua")
        self.index = SessionIndex(redis, keys)

    async def _call(
        self,
        user: str,
        session: str,
        mode: str,
        updated_at: int,
        payload: dict[str, Any],
        lease_token: str | None = None,
        log_after: tuple[bytes, bytes] | None = None,
    ) -> tuple[int, Envelope | None]:
        keys = [self.keys.env(user, session), self.keys.log(user, session)]
        notes = payload.get("set", {}).get("workingNotes")
        if notes is not None:
            # The log records the notes' size and digest, never their text.
            payload = {**payload, "notes": notes_digest(notes)}
        args: list[str | bytes] = [
            mode,
            str(updated_at),
            str(self.budget),
            str(self.log_maxlen),
            msgspec.json.encode(payload),
            session,
        ]
        if lease_token is not None:
            keys.append(self.keys.lease(user, session))
            args.append(lease_token)
        if log_after is not None:
            if lease_token is None:
                args.append("")
            args.extend(log_after)
        if self.session_ttl_ms and mode != "worker":
            args.extend(["", "", "", str(self.session_ttl_ms)])
        reply = await self.replicas.write(
            self.redis, lambda link: self._write(keys=keys, args=args, on=link)
        )
        status = _s(reply[0])
        if status == "ok":
            after = envelope_from_hash(session, pairs(reply[3])) if len(reply) > 3 else None
            return int(reply[1]), after
        if status == "conflict":
            raise EnvelopeConflict(envelope_from_hash(session, pairs(reply[1])))
        if status == "not_found":
            raise SessionNotFound(session)
        if status == "exists":
            raise SessionExists(session)
        if status == "too_large":
            raise MetaTooLarge(int(reply[1]), self.budget)
        if status == "fenced":
            raise LeaseNotHeld(session)
        if status == "clock_ahead":
            raise ClockAhead(updated_at, int(reply[1]))
        raise RuntimeError(f"unexpected envelope script reply {status!r}")

    async def create(self, user: str, session: str, meta: Meta | None = None) -> Envelope:
        """Create the envelope with optional initial host meta; :class:`SessionExists` if taken."""
        host, worker = validate_host_meta(meta or Meta())
        values = {**host, **{k: v for k, v in worker.items() if v}}
        _, envelope = await self._call(user, session, "create", 0, {"set": values})
        assert envelope is not None
        try:
            await self.index.add(user, session, envelope.createdAt)
        except RedisError:
            # The session stands; only the list misses it until a reindex.
            log.warning(
                "session %s is not in its user's list: run `turnbus reindex-sessions`", session
            )
        return envelope

    async def read(self, user: str, session: str) -> Envelope | None:
        """The envelope, poison dropped to unset (never an error); ``None`` if absent."""
        flat = await self.redis.execute_command(  # type: ignore[no-untyped-call]
            "HGETALL", self.keys.env(user, session), **UNDECODED
        )
        if not flat:
            return None
        return envelope_from_hash(session, {_s(k): _s(v) for k, v in flat.items()})

    async def host_replace(self, user: str, session: str, updated_at: int, meta: Meta) -> Envelope:
        """Full-set replace of host keys; worker keys copy forward unless present.

        Raises :class:`EnvelopeConflict` (stale ``updated_at``), :class:`ClockAhead` (more
        than ``caps.UPDATED_AT_MAX_AHEAD_MS`` ahead of Redis's clock), :class:`MetaTooLarge`,
        :class:`SessionNotFound`, or :class:`turnbus.shared.meta.MetaInvalid` (before any I/O).
        A stored clock beyond that window (left by a host before the window existed) is
        replaced by any write within it.
        """
        check_updated_at(updated_at)
        host, worker = validate_host_meta(meta)
        payload = {
            "set": {**host, **{k: v for k, v in worker.items() if v}},
            "clear": [k for k, v in worker.items() if not v],
            "replace": list(HOST_META_KEYS),
            "maxAheadMs": caps.UPDATED_AT_MAX_AHEAD_MS,
        }
        _, envelope = await self._call(user, session, "host", updated_at, payload)
        assert envelope is not None
        return envelope

    async def worker_overlay(
        self,
        user: str,
        session: str,
        patch: Mapping[str, str],
        *,
        lease_token: str | None = None,
        log_after: tuple[bytes, bytes] | None = None,
    ) -> int:
        """Patch worker-owned keys only ("" clears); returns the new ``updatedAt``.

        The clock is ``max(stored updatedAt, wall ms) + 1``, taken inside the script, and
        never past ``caps.UPDATED_AT_MAX`` (at the cap it stays there).
        With ``lease_token`` the write applies only while the session lease holds that
        token, else :class:`LeaseNotHeld` (a worker that lost its turn writes nothing).
        ``log_after`` ``(head, tail)``: an entry the write appends to the session log after
        its own, ``head + updatedAt + tail`` (the notes tools' ``working_notes`` event).
        """
        clean = validate_worker_patch(patch)
        payload = {
            "set": {k: v for k, v in clean.items() if v},
            "clear": [k for k, v in clean.items() if not v],
        }
        now = now_ms()
        clock, _ = await self._call(user, session, "worker", now, payload, lease_token, log_after)
        return clock

    async def delete(self, user: str, session: str) -> bool:
        """Delete every key of the session, then its index entry; ``True`` if it existed."""
        created = await self.redis.hget(self.keys.env(user, session), "createdAt")
        keys = [*self.keys.session_keys(user, session), self.keys.outbox(user, session)]
        args = [self.keys.session_tag(user, session), self.keys.outbox_member(user, session, "")]
        existed = await self.replicas.write(
            self.redis, lambda link: self._delete(keys=keys, args=args, on=link)
        )
        if existed and created is not None:
            try:
                await self.index.remove(user, session, _int_or_zero(_s(created)))
            except RedisError:
                # The session is gone; the list drops its entry when it meets it.
                log.warning("session %s deleted but still indexed", session)
        return bool(existed)

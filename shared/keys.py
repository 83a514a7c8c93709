"""Every Redis key turnbus uses, built in one place.

All keys of one session share the hash tag ``{<user>:<session>}`` so that a Redis
Cluster keeps a session on one slot and every Lua script touches a single slot.

Two kinds of key are placed on a chosen slot by a short hash tag picked for that slot
(:func:`slot_tag`): the work streams, spread over the slot range so that shards land
on different masters, and the submit and webhook outboxes, one of each per slot, so that a session's script
can mark a turn in its session's own slot and a sweeper can still find every mark.
"""

from __future__ import annotations

import binascii
import itertools
import re
import unicodedata
import zlib
from functools import cache

__all__ = [
    "GROUP",
    "ID_MAX_CHARS",
    "SLOTS",
    "InvalidId",
    "Keys",
    "key_slot",
    "slot_tag",
    "validate_id",
    "work_slot",
]

ID_MAX_CHARS = 128
# The consumer group every worker reads the work streams in.
GROUP = "workers"
SLOTS = 16384
# Tags made of these never contain ":" (every session tag does), "{" or "}".
_TAG_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKL"
# Where work stream n sits: in the n % 3 part of a standard 3-master split of the slot
# range, and spread within that part by the golden ratio (so 3 shards land on 3 masters,
# 6 on 3 masters twice, and any count spreads over any even split).
_THIRD = SLOTS // 3
_WORK_STEP = 3375  # ~0.618 of a third
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._-]{1,32}$")
_FORBIDDEN = frozenset("{}:")
# Ids made only of these are safe without a look at each character (the common case:
# every key of a turn is built from its ids, many times per turn).
_TAG_CACHE_SIZE = 10_000
_PLAIN_ID_RE = re.compile(rf"[A-Za-z0-9_.\-]{{1,{ID_MAX_CHARS}}}")


def key_slot(key: str | bytes) -> int:
    """The Redis Cluster slot of a key (or of a bare hash tag): the CRC16 of its hash
    tag, the text between its first ``{`` and the next ``}`` when that is not empty,
    else of the whole key. The one slot function: every module that needs a slot
    calls it."""
    raw = key.encode("utf-8", "surrogateescape") if isinstance(key, str) else bytes(key)
    start = raw.find(b"{")
    if start >= 0:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1 : end]
    return binascii.crc_hqx(raw, 0) % SLOTS


@cache
def _slot_tags() -> tuple[str, ...]:
    # Every slot is reached by some 3-character tag of the alphabet (about 60 ms, once).
    found: dict[int, str] = {}
    for chars in itertools.product(_TAG_ALPHABET, repeat=3):
        tag = "".join(chars)
        found.setdefault(key_slot(tag), tag)
        if len(found) == SLOTS:
            break
    return tuple(found[slot] for slot in range(SLOTS))


def slot_tag(slot: int) -> str:
    """A short hash tag whose slot is ``slot`` (the same tag every time)."""
    return _slot_tags()[slot]


def work_slot(shard: int) -> int:
    """The slot of work stream ``shard`` (see docs/operations.md, "What lives where")."""
    part, turn = shard % 3, shard // 3
    return part * _THIRD + (_THIRD // 2 + turn * _WORK_STEP) % _THIRD


class InvalidId(ValueError):
    """An id that cannot be used inside a key (it could break out of its hash tag)."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"invalid {kind} id: {reason}")
        self.kind = kind
        self.reason = reason


def validate_id(value: object, kind: str = "session") -> str:
    """Return ``value`` if it is safe inside a key, else raise :class:`InvalidId`."""
    if isinstance(value, str) and _PLAIN_ID_RE.fullmatch(value):
        return value
    if not isinstance(value, str):
        raise InvalidId(kind, "must be a string")
    if not value:
        raise InvalidId(kind, "must not be empty")
    if len(value) > ID_MAX_CHARS:
        raise InvalidId(kind, f"longer than {ID_MAX_CHARS} characters")
    for ch in value:
        if ch in _FORBIDDEN:
            raise InvalidId(kind, f"must not contain {ch!r}")
        if ch.isspace():
            raise InvalidId(kind, "must not contain whitespace")
        if unicodedata.category(ch)[0] == "C":
            raise InvalidId(kind, "must not contain control or unassigned characters")
    return value


class Keys:
    """Key builders under one prefix (``TURNBUS_PREFIX``, default ``tb``)."""

    __slots__ = ("_env_re", "_tags", "prefix")

    def __init__(self, prefix: str = "tb") -> None:
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"key prefix must match {_PREFIX_RE.pattern}: {prefix!r}")
        self.prefix = prefix
        # Tags of ids already checked: a turn builds a dozen keys of its session.
        self._tags: dict[tuple[str, str], str] = {}
        self._env_re = re.compile(rf"^{re.escape(prefix)}:\{{([^{{}}:]+):([^{{}}:]+)\}}:env$")

    def session_tag(self, user: str, session: str) -> str:
        """``<prefix>:{<user>:<session>}``: the base of every key of one session."""
        tag = self._tags.get((user, session))
        if tag is not None:
            return tag
        validate_id(user, "user")
        validate_id(session, "session")
        tag = f"{self.prefix}:{{{user}:{session}}}"
        if len(self._tags) >= _TAG_CACHE_SIZE:
            self._tags.clear()
        self._tags[(user, session)] = tag
        return tag

    def session_keys_prefix(self) -> str:
        """``<prefix>:{``: what every key of every session starts with (the prefix the
        SSE hub's key tracking follows)."""
        return f"{self.prefix}:{{"

    def env_pattern(self) -> str:
        """A SCAN ``MATCH`` pattern of every session's envelope."""
        return f"{self.prefix}:{{*}}:env"

    def env_ids(self, key: str) -> tuple[str, str] | None:
        """``(user, session)`` of an envelope key, ``None`` for any other key."""
        match = self._env_re.match(key)
        return None if match is None else (match.group(1), match.group(2))

    def env(self, user: str, session: str) -> str:
        return self.session_tag(user, session) + ":env"

    def log(self, user: str, session: str) -> str:
        return self.session_tag(user, session) + ":log"

    def messages(self, user: str, session: str) -> str:
        return self.session_tag(user, session) + ":messages"

    def lease(self, user: str, session: str) -> str:
        return self.session_tag(user, session) + ":lease"

    def turns(self, user: str, session: str) -> str:
        """Sorted set of every turn id of the session, scored by creation ms."""
        return self.session_tag(user, session) + ":turns"

    def active(self, user: str, session: str) -> str:
        """List of the session's turns not yet terminal, oldest first."""
        return self.session_tag(user, session) + ":active"

    def turn(self, user: str, session: str, turn_id: str) -> str:
        validate_id(turn_id, "turn")
        return f"{self.session_tag(user, session)}:turn:{turn_id}"

    def turn_events(self, user: str, session: str, turn_id: str) -> str:
        return self.turn(user, session, turn_id) + ":events"

    def turn_calls(self, user: str, session: str, turn_id: str) -> str:
        """Hash of the round whose tools are running: its assistant message, the intent
        of each side-effecting call and the results stored so far (a resumed attempt
        carries on from it)."""
        return self.turn(user, session, turn_id) + ":calls"

    def idempotency(self, user: str, session: str, key_digest: str) -> str:
        """Where an ``Idempotency-Key`` (by its digest) remembers its turn."""
        validate_id(key_digest, "idempotency")
        return f"{self.session_tag(user, session)}:idem:{key_digest}"

    def idempotency_index(self, user: str, session: str) -> str:
        """Sorted set of the session's idempotency digests (so delete can find them)."""
        return self.session_tag(user, session) + ":idem"

    def session_keys(self, user: str, session: str) -> list[str]:
        """The fixed keys of a session (turn and idempotency keys hang off indexes)."""
        return [
            self.env(user, session),
            self.log(user, session),
            self.messages(user, session),
            self.lease(user, session),
            self.turns(user, session),
            self.active(user, session),
            self.idempotency_index(user, session),
        ]

    def user_sessions(self, user: str) -> str:
        """Sorted set indexing one user's sessions (``GET /v1/sessions``).

        Not in any session's slot: written by its own command after a session's script
        (create) or delete, never inside one.
        """
        validate_id(user, "user")
        return f"{self.prefix}:user:{user}:sessions"

    def user_quota(self, user: str) -> str:
        """Hash of one user's quota counters (``lua/quota.lua``): turns this minute,
        tokens today, unfinished turns per session.

        Not in any session's slot: run as a call of its own before a submit's script and
        after a turn's end, never inside a session's script.
        """
        validate_id(user, "user")
        return f"{self.prefix}:user:{user}:quota"

    def work(self, shard: int) -> str:
        """A work-queue stream, read by consumer group ``workers``, on the slot
        :func:`work_slot` picks for its shard."""
        if shard < 0:
            raise ValueError("shard must be >= 0")
        return f"{self.prefix}:{{{slot_tag(work_slot(shard))}}}:turns:{shard}"

    def legacy_work(self, shard: int) -> str:
        """The name work streams had before they were spread over slots (drained on upgrade)."""
        if shard < 0:
            raise ValueError("shard must be >= 0")
        return f"{self.prefix}:turns:{shard}"

    def outbox(self, user: str, session: str) -> str:
        """The submit outbox of the session's slot: a sorted set of the turns accepted
        there (``user:session:turn``, scored by acceptance ms) whose work entry no worker
        has seen yet. Shared by every session of that slot."""
        return self.slot_outbox(key_slot(self.session_tag(user, session)))

    def slot_outbox(self, slot: int) -> str:
        return f"{self.prefix}:{{{slot_tag(slot)}}}:outbox"

    def webhook_outbox(self, user: str, session: str) -> str:
        """The webhook outbox of the session's slot: a sorted set of the finished turns
        whose webhook is not delivered yet (``user:session:turn``, scored by the ms of
        its next attempt), written by the script that writes the terminal event."""
        return self.slot_webhook_outbox(key_slot(self.session_tag(user, session)))

    def slot_webhook_outbox(self, slot: int) -> str:
        return f"{self.prefix}:{{{slot_tag(slot)}}}:webhooks"

    @staticmethod
    def outbox_member(user: str, session: str, turn_id: str) -> str:
        return f"{user}:{session}:{turn_id}"

    def work_streams(self, shards: int) -> list[str]:
        return [self.work(i) for i in range(shards)]

    def cancel_channel(self) -> str:
        """Pub/sub channel on which cancel requests are announced to workers."""
        return f"{self.prefix}:cancel"

    def sweeper_lock(self) -> str:
        """Held by the one worker sweeping the outboxes in a sweep period."""
        return f"{self.prefix}:sweeper"

    def webhook_sender_lock(self) -> str:
        """Held by the one worker looking for due webhooks in every slot in a poll period."""
        return f"{self.prefix}:webhook-sender"

    def workers(self) -> str:
        """Hash of live worker names to their last heartbeat (ms)."""
        return f"{self.prefix}:workers"

    def tool_sources(self) -> str:
        """Hash of live worker names to their tool sources' states (JSON: an MCP
        server's connection, tools, reconnects), renewed with each heartbeat and read by
        ``turnbus status``."""
        return f"{self.prefix}:tool-sources"

    def metrics_ports(self) -> str:
        """Hash of live worker names to the port of their health and metrics server
        (``TURNBUS_METRICS_PORT``), renewed with each heartbeat and read by ``turnbus
        status``."""
        return f"{self.prefix}:metrics-ports"

    def tools(self) -> str:
        """Hash of live worker names to the specs of the tools each registered (JSON),
        read by the gateway for ``GET /v1/tools`` and the ``allowedTools`` check."""
        return f"{self.prefix}:tools"

    def gateway_wake(self, instance: str, tag: str | None = None) -> str:
        """A gateway process's own stream, written to wake its SSE hub's blocking read.

        ``tag``: the hash tag of the streams read with it (on a Redis Cluster one XREAD
        reads one slot, so the wake-up stream must sit in that slot)."""
        validate_id(instance, "instance")
        if tag is None:
            return f"{self.prefix}:gateway:wake:{instance}"
        return f"{self.prefix}:gateway:wake:{{{tag}}}:{instance}"

    @staticmethod
    def shard_for(user: str, session: str, shards: int) -> int:
        """Stable shard of a session: CRC32 of ``user:session`` modulo the shard count."""
        if shards <= 1:
            return 0
        return zlib.crc32(f"{user}:{session}".encode()) % shards

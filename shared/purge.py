"""Erasing one user: every session's keys, its turns' outbox marks and the user's own
keys, in batches, so a user with 100,000 sessions costs bounded time per step and
bounded memory (one batch) whatever their number.

Two walks, each holding at most ``batch`` names at a time:

- :meth:`UserPurge.index_batch` takes the oldest ``batch`` sessions of the user's
  sessions index, deletes each with the script ``DELETE /v1/sessions/{id}`` runs (one
  pipeline), announces a cancel for each of their unfinished turns, and drops them from
  the index. Its cost is the user's own sessions, never the keyspace: the API runs it.
- :meth:`UserPurge.sweep` SCANs every master (MATCH on the user's key patterns) for what
  the index does not name (a session whose index entry was missed, a stray key), and
  deletes it the same way. It walks the whole keyspace: the operator's
  ``turnbus purge`` runs it after the index walk.

Running turns of the user are cancelled: their session's keys go, lease included, and
the cancel announced on the cancel channel stops the worker running one at once (it
finds the record gone and writes nothing more).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from turnbus.shared.keys import InvalidId, Keys, validate_id
from turnbus.shared.scripts import LuaScript, text

__all__ = ["PURGE_BATCH_DEFAULT", "PurgeCounts", "UserPurge"]

PURGE_BATCH_DEFAULT = 500
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


def _glob_escape(value: str) -> str:
    """``value`` matched literally by SCAN's MATCH (user ids may hold ``*?[]\\``)."""
    return _GLOB_SPECIAL.sub(r"\\\1", value)


@dataclasses.dataclass
class PurgeCounts:
    """What a purge has done so far."""

    sessions: int = 0  # sessions that existed and were deleted
    turns_cancelled: int = 0  # unfinished turns announced cancelled
    stray_keys: int = 0  # keys the sweep found outside any indexed session
    batches: int = 0  # batches run (each held at most ``batch`` names)
    largest_batch: int = 0  # the most names one batch held


class UserPurge:
    """Deletes everything of one user, a batch at a time; each method says its round trips."""

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, user: str, *, batch: int = PURGE_BATCH_DEFAULT
    ) -> None:
        if batch < 1:
            raise ValueError("batch must be >= 1")
        self.redis = redis
        self.keys = keys
        self.user = validate_id(user, "user")
        self.batch = batch
        self.counts = PurgeCounts()
        self._delete = LuaScript(redis, "session_delete.lua")
        self._session_re = re.compile(
            rf"^{re.escape(keys.prefix)}:\{{{re.escape(self.user)}:([^{{}}:]+)\}}"
        )

    async def index_batch(self) -> bool:
        """Delete the next ``batch`` sessions of the user's index; ``False`` when the index
        is empty (then the index key is gone too). Round trips: the index page; the
        sessions' unfinished turns; the deletes; the cancels (when there are some); the
        index update."""
        index = self.keys.user_sessions(self.user)
        members = [text(m) for m in await self.redis.zrangebylex(index, "-", "+", 0, self.batch)]
        if not members:
            # Last, with the index: the user's quota counters (they name sessions).
            await self.redis.delete(index, self.keys.user_quota(self.user))
            return False
        sessions: list[str] = []
        for member in members:
            _, _, session = member.partition(":")
            try:
                sessions.append(validate_id(session))
            except InvalidId:
                continue  # not a member this code writes: dropped with the rest
        await self._delete_sessions(sessions)
        await self.redis.zrem(index, *members)
        self._count_batch(len(members))
        return True

    async def sweep(self) -> None:
        """SCAN every master for the user's keys the index walk left, and delete them a
        batch at a time: a session's keys with the session's script (so its turns' outbox
        marks go too), any other key of the user with UNLINK."""
        user = _glob_escape(self.user)
        for pattern in (
            f"{self.keys.prefix}:{{{user}:*",
            f"{self.keys.prefix}:user:{user}:*",
        ):
            found: list[str] = []
            async for raw in self.redis.scan_iter(match=pattern, count=self.batch):
                found.append(text(raw))
                if len(found) >= self.batch:
                    await self._sweep_batch(found)
                    found = []
            if found:
                await self._sweep_batch(found)

    async def _sweep_batch(self, found: list[str]) -> None:
        sessions: dict[str, None] = {}
        for key in found:
            match = self._session_re.match(key)
            if match is not None:
                with contextlib.suppress(InvalidId):
                    sessions[validate_id(match.group(1))] = None
        await self._delete_sessions(list(sessions))
        # Whatever the scripts did not name (e.g. a turn record its index no longer lists).
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in found:
                pipe.unlink(key)
            unlinked = await pipe.execute()
        self.counts.stray_keys += sum(int(n) for n in unlinked)
        self._count_batch(len(found))

    async def _delete_sessions(self, sessions: Sequence[str]) -> None:
        """Delete ``sessions`` of the user (one pipeline of the delete script, after one
        reading their unfinished turns) and announce a cancel of those turns."""
        if not sessions:
            return
        k, user = self.keys, self.user
        async with self.redis.pipeline(transaction=False) as pipe:
            for session in sessions:
                pipe.lrange(k.active(user, session), 0, -1)
            active = await pipe.execute()
        existed = await self._run_deletes(sessions)
        self.counts.sessions += sum(1 for e in existed if e == 1)
        cancels = [
            (session, text(turn))
            for session, turns in zip(sessions, active, strict=True)
            for turn in turns
        ]
        if cancels:
            async with self.redis.pipeline(transaction=False) as pipe:
                for session, turn in cancels:
                    message = json.dumps({"user": user, "session": session, "turn": turn})
                    pipe.publish(k.cancel_channel(), message)
                await pipe.execute()
            self.counts.turns_cancelled += len(cancels)

    async def _run_deletes(self, sessions: Sequence[str]) -> list[object]:
        for attempt in (1, 2):
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for session in sessions:
                        keys, args = self._delete_call(session)
                        pipe.execute_command("EVALSHA", self._delete.sha, len(keys), *keys, *args)
                    return list(await pipe.execute())
            except NoScriptError:
                if attempt == 2:
                    raise
                # The server does not hold the script yet: load it wherever it may run
                # (a delete is idempotent: the pipeline runs again whole).
                await self._delete.load()
        raise AssertionError("unreachable")

    def _delete_call(self, session: str) -> tuple[list[str], list[str]]:
        """The session delete script's KEYS and ARGV (as ``EnvelopeStore.delete`` builds
        them)."""
        k, user = self.keys, self.user
        keys = [*k.session_keys(user, session), k.outbox(user, session)]
        args = [k.session_tag(user, session), k.outbox_member(user, session, "")]
        return keys, args

    def _count_batch(self, size: int) -> None:
        self.counts.batches += 1
        self.counts.largest_batch = max(self.counts.largest_batch, size)

"""Per-user quotas: running and queued turns, turns per minute, model tokens per day.

The counters are one hash per user (``Keys.user_quota``), written by ``lua/quota.lua``
with Redis's clock, so every gateway and worker counts against the same numbers. That
hash is not in a session's slot (a Redis Cluster keeps it apart), so a submit is two
steps: :meth:`QuotaStore.admit` (check and count, one call; a refusal writes nothing),
then the session's submit script; a submit that script refuses (or replays) gives its
count back with :meth:`QuotaStore.release`. A turn's end gives its count back too (the
worker, after its finish script; the gateway, after cancelling a queued turn).

Running and queued turns are counted per session (``s:<session>``): a session with an
unfinished turn has one running (or about to run: a session runs one turn at a time)
and the rest queued. A count can only drift upwards (a turn whose release was lost with
its process, a deleted or expired session): a refusal for running or queued turns
first recounts from the sessions' own active lists (:meth:`QuotaStore.recount`, at most
once per :data:`RECOUNT_INTERVAL_MS` per user) and answers from the counts it leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis

from turnbus.shared.keys import Keys, validate_id
from turnbus.shared.scripts import LuaScript
from turnbus.shared.scripts import text as _s
from turnbus.shared.settings import Settings

__all__ = [
    "ACTIVE",
    "CLAIM_NAMES",
    "RECOUNT_INTERVAL_MS",
    "TOKENS",
    "Admission",
    "QuotaExceeded",
    "QuotaLimits",
    "QuotaStore",
    "counted_tokens",
]

# The counters outlive a user's last write by this much (a day's tokens need a day).
_KEY_TTL_MS = 2 * 86_400_000
# A user refused for running or queued turns has their counts recounted at most this often.
RECOUNT_INTERVAL_MS = 10_000
# The JWT claim's names (``quotas: {"runningTurns": 2, ...}``), the 429's ``field``.
CLAIM_NAMES = ("runningTurns", "queuedTurns", "turnsPerMinute", "tokensPerDay")
# What a turn record's ``quotas`` names: the counters its end and its rounds feed.
ACTIVE = "active"
TOKENS = "tokens"


class QuotaExceeded(Exception):
    """A submit over one of the user's limits (HTTP 429 ``quota_exceeded``)."""

    def __init__(self, field: str, limit: int, retry_after_s: int) -> None:
        super().__init__(f"over the {field} quota ({limit})")
        self.field = field
        self.limit = limit
        self.retry_after_s = retry_after_s


@dataclasses.dataclass(frozen=True, slots=True)
class QuotaLimits:
    """One user's limits (``0``: none)."""

    running_turns: int = 0
    queued_turns: int = 0
    turns_per_minute: int = 0
    tokens_per_day: int = 0

    @classmethod
    def of(cls, settings: Settings, claim: Mapping[str, int] | None = None) -> QuotaLimits:
        """The deployment's caps, each lowered by the token's ``quotas`` claim (never raised;
        a claim also sets a limit the deployment leaves off)."""
        caps = cls(
            settings.quota_running_turns,
            settings.quota_queued_turns,
            settings.quota_turns_per_minute,
            settings.quota_tokens_per_day,
        )
        if not claim:
            return caps
        values = [
            min(cap, claim[name]) if cap and name in claim else claim.get(name, cap)
            for cap, name in zip(dataclasses.astuple(caps), CLAIM_NAMES, strict=True)
        ]
        return cls(*values)

    @property
    def any(self) -> bool:
        return bool(
            self.running_turns or self.queued_turns or self.turns_per_minute or self.tokens_per_day
        )

    @property
    def counts_active(self) -> bool:
        return bool(self.running_turns or self.queued_turns)

    def by_name(self, name: str) -> int:
        return int(dataclasses.astuple(self)[CLAIM_NAMES.index(name)])

    def record_value(self) -> str | None:
        """What the turn record's ``quotas`` keeps: the counters the worker feeds."""
        fed = [ACTIVE] * self.counts_active + [TOKENS] * bool(self.tokens_per_day)
        return " ".join(fed) or None


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """What :meth:`QuotaStore.admit` counted, so a submit refused later gives it back."""

    user: str
    session: str
    minute: str
    counted: str

    @property
    def counted_anything(self) -> bool:
        return bool(self.minute or self.counted)


def counted_tokens(input_tokens: int, output_tokens: int, cache_read: int, cache_write: int) -> int:
    """A round's tokens as the daily quota counts them: every token the model read or
    wrote, cached reads and cache writes included."""
    return input_tokens + output_tokens + cache_read + cache_write


def _arg(limit: int) -> str:
    return str(limit) if limit else ""


class QuotaStore:
    """The per-user counters; each method is one call of ``lua/quota.lua`` unless it says."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._script = LuaScript(redis, "quota.lua")

    async def admit(
        self, user: str, session: str, multitask: str, limits: QuotaLimits
    ) -> Admission:
        """Check ``limits`` and count the turn; :class:`QuotaExceeded` (nothing written)
        over one. A refusal for running or queued turns recounts first when it is due
        (:meth:`recount`: a read of the user's counters, one pipeline over their sessions'
        active lists, one call) and asks once more."""
        for attempt in (1, 2):
            reply = await self._admit(user, session, multitask, limits)
            if _s(reply[0]) == "ok":
                return Admission(user, session, _s(reply[1]), _s(reply[2]))
            field, retry_after, due = _s(reply[1]), int(reply[2]), _s(reply[3]) == "1"
            if attempt == 1 and due and await self.recount(user):
                continue
            raise QuotaExceeded(field, limits.by_name(field), max(retry_after, 1))
        raise AssertionError("unreachable")

    async def _admit(self, user: str, session: str, multitask: str, limits: QuotaLimits) -> Any:
        args: list[str | bytes | int] = [
            "admit",
            session,
            multitask,
            _arg(limits.running_turns),
            _arg(limits.queued_turns),
            _arg(limits.turns_per_minute),
            _arg(limits.tokens_per_day),
            str(_KEY_TTL_MS),
            str(RECOUNT_INTERVAL_MS),
        ]
        return await self._script(keys=[self.keys.user_quota(user)], args=args)

    async def release(self, admission: Admission) -> None:
        """Give back what :meth:`admit` counted for a turn that was not written."""
        if admission.counted_anything:
            await self._release(admission.user, admission.session, admission.minute)

    async def turn_ended(self, user: str, session: str) -> None:
        """A counted turn is over: its session's count drops by one."""
        await self._release(user, session, "")

    async def _release(self, user: str, session: str, minute: str) -> None:
        args: list[str | bytes | int] = ["release", session, minute, str(_KEY_TTL_MS)]
        await self._script(keys=[self.keys.user_quota(user)], args=args)

    async def add_tokens(self, user: str, tokens: int) -> int:
        """Add a round's tokens to the user's count of the day (UTC); returns the total."""
        args: list[str | bytes | int] = ["tokens", str(tokens), str(_KEY_TTL_MS)]
        return int(await self._script(keys=[self.keys.user_quota(user)], args=args))

    async def recount(self, user: str) -> bool:
        """Lower each session's count to its unfinished turns (its active list's length);
        returns whether any count was above. Round trips: the counters, one pipeline of
        ``LLEN`` over the sessions counted, one call."""
        key = self.keys.user_quota(user)
        counts: list[tuple[str, int]] = []
        for name, value in (await self.redis.hgetall(key)).items():
            field = _s(name)
            if field.startswith("s:"):
                counts.append((field[2:], int(_s(value) or 0)))
        if not counts:
            return False
        async with self.redis.pipeline(transaction=False) as pipe:
            for session, _ in counts:
                pipe.llen(self.keys.active(user, validate_id(session)))
            found = await pipe.execute()
        args: list[str | bytes | int] = ["recount", str(_KEY_TTL_MS)]
        over = False
        for (session, seen), length in zip(counts, found, strict=True):
            if seen > int(length):
                over = True
                args += [session, str(seen), str(int(length))]
        if over:
            await self._script(keys=[key], args=args)
        return over

"""The session lease: at most one running turn per session, across every worker.

``keys.lease(user, session)`` holds a token unique to one attempt of one turn. It is
taken with ``SET NX PX`` — and only by the turn at the head of the session's active
list, so queued turns run oldest first — renewed by compare-and-set and released by
compare-and-delete, so a worker never extends or frees a lease it no longer holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import redis.asyncio as aioredis
import redis.exceptions

from shared.keys import Keys
from shared.scripts import text as _s

__all__ = ["AcquireResult", "SessionLease", "new_lease_token"]

log = logging.getLogger(__name__)

# KEYS: 1 lease, 2 active list. ARGV: 1 turn id, 2 token, 3 PX ms.
# Replies: {"ok"} | {"not_head", head or ""} | {"busy", holder}
_ACQUIRE = """
local head = redis.call('LINDEX', KEYS[2], 0)
if head ~= ARGV[1] then
  return {'not_head', head or ''}
end
if redis.call('SET', KEYS[1], ARGV[2], 'NX', 'PX', ARGV[3]) then
  return {'ok'}
end
return {'busy', redis.call('GET', KEYS[1]) or ''}
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

AcquireResult = tuple[str, str]  # ("ok" | "not_head" | "busy", detail)


def new_lease_token(worker: str, turn_id: str) -> str:
    return f"{worker}/{turn_id}/{os.urandom(6).hex()}"


class SessionLease:
    """One attempt's hold on a session. :meth:`heartbeat` keeps it alive until released;
    :attr:`lost` is set when a renewal finds the token gone (another holder, or expired)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        user: str,
        session: str,
        turn_id: str,
        token: str,
        lease_ms: int,
        heartbeat_ms: int,
    ) -> None:
        self._redis = redis
        self.key = keys.lease(user, session)
        self.active_key = keys.active(user, session)
        self.turn_id = turn_id
        self.token = token
        self.lease_ms = lease_ms
        self.heartbeat_ms = heartbeat_ms
        self.held = False
        self.lost = asyncio.Event()
        self._stopping = asyncio.Event()
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self._beat: asyncio.Task[None] | None = None

    async def try_acquire(self) -> AcquireResult:
        """One attempt: ``("ok", "")``, ``("not_head", head)`` or ``("busy", holder)``."""
        reply = await self._acquire(
            keys=[self.key, self.active_key],
            args=[self.turn_id, self.token, str(self.lease_ms)],
        )
        status = _s(reply[0])
        if status == "ok":
            self.held = True
            self._beat = asyncio.create_task(self._heartbeat(), name=f"lease:{self.turn_id}")
            return status, ""
        return status, _s(reply[1]) if len(reply) > 1 else ""

    async def renew(self) -> bool:
        return bool(await self._renew(keys=[self.key], args=[self.token, str(self.lease_ms)]))

    async def _heartbeat(self) -> None:
        # Stopped through an event, never by cancelling a Redis call mid-flight: redis-py
        # can swallow a cancellation that lands inside a command.
        interval = self.heartbeat_ms / 1000
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), interval)
            if self._stopping.is_set():
                return
            try:
                renewed = await self.renew()
            except (redis.exceptions.RedisError, OSError):
                # Redis unreachable: keep trying until the lease would have expired.
                log.warning("lease renewal failed for %s", self.turn_id, exc_info=True)
                continue
            if not renewed and not self._stopping.is_set():
                log.warning("lease of turn %s lost", self.turn_id)
                self.held = False
                self.lost.set()
                return

    async def release(self) -> None:
        """Stop the heartbeat and delete the lease if this attempt still holds it."""
        self._stopping.set()
        if self._beat is not None:
            beat, self._beat = self._beat, None
            await asyncio.wait({beat}, timeout=self.heartbeat_ms / 1000 + 5)
        if self.held:
            self.held = False
            await self._release(keys=[self.key], args=[self.token])

"""The session lease: at most one running turn per session, across every worker.

``keys.lease(user, session)`` holds a token unique to one attempt of one turn. It is
taken with ``SET NX PX`` by the turn's start script (``lua/turn_start.lua``) — and only
for the turn at the head of the session's active list, so queued turns run oldest
first — renewed by compare-and-set and released by compare-and-delete (or by the turn's
finish script), so a worker never extends or frees a lease it no longer holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import redis.asyncio as aioredis
import redis.exceptions

from shared.keys import Keys

__all__ = ["SessionLease", "new_lease_token"]

log = logging.getLogger(__name__)

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
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self._beat: asyncio.Task[None] | None = None

    def adopt(self) -> None:
        """The start script took the lease with this token: keep it alive from now on."""
        if self.held:
            return
        self.held = True
        self._beat = asyncio.create_task(self._heartbeat(), name=f"lease:{self.turn_id}")

    def released(self) -> None:
        """The finish script released the lease (if still held): stop renewing it."""
        self.held = False
        self._stopping.set()

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

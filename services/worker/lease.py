"""The session lease: at most one running turn per session, across every worker.

``keys.lease(user, session)`` holds a token unique to one attempt of one turn. It is
taken with ``SET NX PX`` by the turn's start script (``lua/turn_start.lua``) — and only
for the turn at the head of the session's active list, so queued turns run oldest
first — renewed by compare-and-set and released by compare-and-delete (or by the turn's
finish script), so a worker never extends or frees a lease it no longer holds
(``lua/lease_renew.lua``, ``lua/lease_release.lua``).
"""

from __future__ import annotations

import asyncio
import logging
import os

import redis.asyncio as aioredis

from turnbus.shared.keys import Keys
from turnbus.shared.scripts import LuaScript
from turnbus.worker.interrupts import Signal

__all__ = ["SessionLease", "new_lease_token"]

log = logging.getLogger(__name__)


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
        self.lost = Signal()
        self._stopping = asyncio.Event()
        # The heartbeat: a timer between renewals (most turns end before the first one
        # is due, and a timer costs far less than a task), a task while one runs.
        self._timer: asyncio.TimerHandle | None = None
        self._beat: asyncio.Task[None] | None = None

    def adopt(self) -> None:
        """The start script took the lease with this token: keep it alive from now on."""
        if self.held:
            return
        self.held = True
        self._schedule()

    def released(self) -> None:
        """The finish script released the lease (if still held): stop renewing it."""
        self.held = False
        self._stopping.set()
        self._cancel_timer()

    async def renew(self) -> bool:
        # Scripts are made when first needed: most turns end before a renewal is due.
        renew = LuaScript(self._redis, "lease_renew.lua")
        return bool(await renew([self.key], [self.token, str(self.lease_ms)]))

    def _schedule(self) -> None:
        if not self._stopping.is_set():
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.heartbeat_ms / 1000, self._due)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> None:
        self._timer = None
        if not self._stopping.is_set():
            self._beat = asyncio.get_running_loop().create_task(
                self._heartbeat(), name=f"lease:{self.turn_id}"
            )

    async def _heartbeat(self) -> None:
        """One renewal; the next is scheduled unless the lease was lost or let go. A
        release waits for it: a renewal is never cancelled mid-flight."""
        try:
            renewed = await self.renew()
        except Exception:  # Redis unreachable (or any failure): keep trying until the
            # lease would have expired.
            log.warning("lease renewal failed for %s", self.turn_id, exc_info=True)
            renewed = True
        finally:
            self._beat = None
        if self._stopping.is_set():
            return
        if not renewed:
            log.warning("lease of turn %s lost", self.turn_id)
            self.held = False
            self.lost.set()
            return
        self._schedule()

    async def release(self) -> None:
        """Stop the heartbeat and delete the lease if this attempt still holds it."""
        self._stopping.set()
        self._cancel_timer()
        beat = self._beat
        if beat is not None:
            await asyncio.wait({beat}, timeout=self.heartbeat_ms / 1000 + 5)
        if self.held:
            self.held = False
            await LuaScript(self._redis, "lease_release.lua")([self.key], [self.token])

"""The SSE hub's dedicated links to Redis (see services/gateway/hub.py).

A blocking reader's XREAD holds a link of its own. On a cluster readers come and go
with the slots followed (about one per turn), so a finished reader's link is kept idle
for the next reader on its node, a few per node, each for a while. Wake-ups go on one
link per node. What is closed or stopped in the background is awaited by the hub's
close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from redis.exceptions import RedisError

from turnbus.shared.cluster import Address
from turnbus.shared.connect import dedicated_link
from turnbus.shared.mux import MuxRedis
from turnbus.shared.settings import Settings

__all__ = ["LinkPool"]

# Idle reader links kept per node for the next reader there, and how long one may stay idle.
_IDLE_LINKS_PER_NODE = 4
_IDLE_LINK_S = 30.0


class LinkPool:
    """The hub's dedicated links: reader links per node (taken, released, kept idle,
    pruned), one wake-up link per node, the trackers' links; and the background closes and stops that :meth:`settle` waits for."""

    def __init__(self, settings: Settings, *, block_ms: int) -> None:
        self._settings = settings
        self._block_ms = block_ms
        self._wake_links: dict[Address | None, MuxRedis] = {}
        # Reader links with nothing in flight, per node, newest last, with when they
        # became idle.
        self._idle: dict[Address | None, list[tuple[MuxRedis, float]]] = {}
        self._prune_handle: asyncio.TimerHandle | None = None
        self.links_opened = 0  # reader links made (the others were reused)
        self._stopping: set[asyncio.Task[None]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def drain(self) -> None:
        """Links released from now on are closed, not kept."""
        self._closed = True

    def take(self, address: Address | None) -> MuxRedis:
        """An idle link to ``address`` with nothing in flight, else a new one."""
        idle = self._idle.get(address)
        while idle:
            link, _ = idle.pop()
            if not link.in_flight:
                return link
            self.close_soon(link)
        self.links_opened += 1
        return dedicated_link(self._settings, address, reply_timeout_s=self._block_ms / 1000 + 5)

    def dedicated(self, address: Address | None) -> MuxRedis:
        """A new link of its own to ``address`` (a tracker's)."""
        return dedicated_link(self._settings, address)

    def waker(self, address: Address | None) -> MuxRedis:
        """The link that sends wake-ups to ``address`` (made on first use)."""
        waker = self._wake_links.get(address)
        if waker is None:
            waker = self._wake_links[address] = self.dedicated(address)
        return waker

    async def release(self, link: MuxRedis, address: Address | None) -> None:
        """Keep a reader's link for the next reader on its node. A cancelled read may
        still have its reply on the way: then a PING behind it answers once the link
        has nothing else in flight (replies come in order); a link that does not, or
        that fails, is closed."""
        try:
            if self._closed:
                raise RedisError("the hub is closed")
            if link.in_flight:
                async with asyncio.timeout(self._block_ms / 1000 + 2):
                    await link.call("PING")
            if link.in_flight or self._closed:
                raise RedisError("the link is busy")
        except (RedisError, OSError, TimeoutError):
            await link.aclose()
            return
        idle = self._idle.setdefault(address, [])
        idle.append((link, asyncio.get_running_loop().time()))
        if len(idle) > _IDLE_LINKS_PER_NODE:
            oldest, _ = idle.pop(0)
            await oldest.aclose()
        if self._prune_handle is None:
            self._prune_handle = asyncio.get_running_loop().call_later(_IDLE_LINK_S, self._prune)

    def _prune(self) -> None:
        """Close the links idle for longer than ``_IDLE_LINK_S``."""
        self._prune_handle = None
        if self.loop is None:
            return
        expired = self.loop.time() - _IDLE_LINK_S
        for address, idle in list(self._idle.items()):
            for link, _ in [x for x in idle if x[1] <= expired]:
                self.close_soon(link)
            idle[:] = [x for x in idle if x[1] > expired]
            if not idle:
                del self._idle[address]
        if self._idle:
            self._prune_handle = self.loop.call_later(_IDLE_LINK_S / 2, self._prune)

    def forget_idle(self, masters: set[Address | None]) -> None:
        """Close the idle links to nodes that no longer serve slots (after a failover,
        a reader must not be given a link to a master that became a replica)."""
        for address in [a for a in self._idle if a not in masters]:
            for link, _ in self._idle.pop(address):
                self.close_soon(link)

    def close_soon(self, link: MuxRedis) -> None:
        self.finish_soon(link.aclose())

    def finish_soon(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` (a close, a stop) in the background; :meth:`settle` awaits it."""
        if self.loop is None:
            work.close()
            return
        task = self.loop.create_task(work)
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def settle(self) -> None:
        """Wait for the work run in the background (a task cancelled before it starts
        would never close its links)."""
        await asyncio.gather(*self._stopping, return_exceptions=True)

    async def close(self) -> None:
        """Close the idle links and the wake-up links."""
        if self._prune_handle is not None:
            self._prune_handle.cancel()
            self._prune_handle = None
        links = [link for idle in self._idle.values() for link, _ in idle]
        self._idle.clear()
        links += self._wake_links.values()
        self._wake_links = {}
        for link in links:
            await link.aclose()

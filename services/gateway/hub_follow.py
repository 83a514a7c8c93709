"""The SSE hub's followers and the streams they follow (see services/gateway/hub.py).

:class:`Follower` is one SSE client's bounded queue; :class:`Followed` is the hub's
state of one followed stream (its cursor, its followers); :class:`StreamReader` is what
reads the followed streams, by client tracking (:mod:`turnbus.gateway.hub_tracking`) or
by blocking reads (:mod:`turnbus.gateway.hub_readers`), chosen once when the hub is
made; :class:`FollowedStreams` keeps the streams, has its reader read each, and hands
what is read to the followers.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from turnbus.gateway.hub_entries import StreamEntry
from turnbus.gateway.metrics import GatewayMetrics
from turnbus.shared.keys import key_slot
from turnbus.shared.muxclient import mux_client

__all__ = [
    "Deliver",
    "Followed",
    "FollowedStreams",
    "Follower",
    "FollowerDropped",
    "StreamReader",
]

log = logging.getLogger(__name__)


class FollowerDropped(Exception):
    """The follower was removed from the hub (``reason``: ``slow_consumer`` or ``shutdown``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Follower:
    """One follower's queue of live entries, at most ``limit`` long."""

    __slots__ = ("_items", "_limit", "_ready", "dropped", "key")

    def __init__(self, key: str, limit: int) -> None:
        self.key = key
        self._items: deque[StreamEntry] = deque()
        self._limit = limit
        self._ready = asyncio.Event()
        self.dropped: str | None = None

    def offer(self, entry: StreamEntry) -> bool:
        if len(self._items) >= self._limit:
            return False
        self._items.append(entry)
        self._ready.set()
        return True

    def drop(self, reason: str) -> None:
        self.dropped = reason
        self._ready.set()

    async def next_batch(self) -> list[StreamEntry]:
        while not self._items and self.dropped is None:
            self._ready.clear()
            await self._ready.wait()
        if self.dropped is not None:
            raise FollowerDropped(self.dropped)
        items = list(self._items)
        self._items.clear()
        return items


class Followed:
    """The hub's state of one followed stream: read on from ``cursor``."""

    __slots__ = ("cursor", "followers", "slot")

    def __init__(self, cursor: str, slot: int | None) -> None:
        self.cursor = cursor
        self.followers: set[Follower] = set()
        self.slot = slot  # on a cluster; None on one Redis


# Hands what a reader read from a stream to the stream's followers.
Deliver = Callable[[Followed, list[StreamEntry]], None]


class StreamReader(Protocol):
    """What reads the followed streams for the hub: each from its :class:`Followed`
    cursor, what is read handed to ``deliver``. The hub holds one, chosen when it is
    made, and never asks which it is."""

    @property
    def tracking(self) -> bool:
        """Whether new entries are learnt of by client tracking (else blocking reads)."""

    @property
    def tracked_reads(self) -> int:
        """XREADs sent by client tracking so far."""

    @property
    def blocking_readers(self) -> int:
        """Blocking readers running."""

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop the reads run on (before the first ``follow``)."""

    def follow(self, key: str, state: Followed) -> None:
        """Read a newly followed stream from its cursor, and on as it grows."""

    def unfollow(self, key: str, state: Followed) -> None:
        """Read the stream no more (its last follower left)."""

    async def wake(self, key: str) -> None:
        """Have a newly followed stream read at once (a read in progress may not name it)."""

    def wake_soon(self, key: str) -> None:
        """:meth:`wake` without waiting for it."""

    def clear(self) -> None:
        """Read nothing from now on (the hub is draining)."""

    async def close(self) -> None:
        """End every read and close what they hold."""


class FollowedStreams:
    """The followed streams, each with its followers: registers and unregisters
    followers, has each stream read by ``reader`` (made with :meth:`deliver`), and
    delivers what is read to the followers, dropping one whose queue is full."""

    def __init__(
        self,
        client: Any,
        reader: Callable[[Deliver], StreamReader],
        *,
        metrics: GatewayMetrics | None,
    ) -> None:
        self.streams: dict[str, Followed] = {}
        mux = mux_client(client)
        self._cluster = mux if mux.sharded else None
        self._metrics = metrics
        self._closed = False
        self.reader = reader(self.deliver)

    @property
    def followers(self) -> int:
        return sum(len(s.followers) for s in self.streams.values())

    def drain(self) -> None:
        """Drop every follower (``shutdown``), forget every stream; refuse new ones."""
        self._closed = True
        for state in self.streams.values():
            for follower in state.followers:
                follower.drop("shutdown")
        self.streams.clear()
        self.reader.clear()
        if self._metrics is not None:
            self._metrics.followed_streams.set(0)

    def register(self, follower: Follower, cursor: str) -> str | None:
        """Add a follower; returns the hub's cursor for an already-followed stream."""
        if self._closed:
            follower.drop("shutdown")
            return cursor
        state = self.streams.get(follower.key)
        if state is not None:
            state.followers.add(follower)
            return state.cursor
        key = follower.key
        state = Followed(cursor, None if self._cluster is None else key_slot(key))
        state.followers.add(follower)
        self.streams[key] = state
        self.reader.follow(key, state)
        if self._metrics is not None:
            self._metrics.followed_streams.set(len(self.streams))
        return None

    def unregister(self, follower: Follower) -> None:
        state = self.streams.get(follower.key)
        if state is None:
            return
        state.followers.discard(follower)
        if not state.followers:
            self._forget(follower.key, state)

    def _forget(self, key: str, state: Followed) -> None:
        del self.streams[key]
        self.reader.unfollow(key, state)
        if self._metrics is not None:
            self._metrics.followed_streams.set(len(self.streams))

    def deliver(self, state: Followed, entries: list[StreamEntry]) -> None:
        """Hand entries read from a stream to each of its followers."""
        for entry in entries:
            state.cursor = entry.id
            for follower in list(state.followers):
                if not follower.offer(entry):
                    self._drop(state, follower)

    def _drop(self, state: Followed, follower: Follower) -> None:
        follower.drop("slow_consumer")
        state.followers.discard(follower)
        if not state.followers and self.streams.get(follower.key) is state:
            self._forget(follower.key, state)
        if self._metrics is not None:
            self._metrics.sse_dropped.inc()
        log.info("SSE follower of %s dropped: its queue is full", follower.key)

"""The SSE hub's followers and the streams they follow (see services/gateway/hub.py).

:class:`Follower` is one SSE client's bounded queue; :class:`Followed` is the hub's
state of one followed stream (its cursor, its followers, who reads it);
:class:`FollowedStreams` keeps them, has each stream read by client tracking
(:mod:`turnbus.gateway.hub_tracking`) or a blocking reader
(:mod:`turnbus.gateway.hub_readers`), and hands what is read to the followers.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from turnbus.gateway.hub_entries import StreamEntry
from turnbus.gateway.hub_readers import BlockingReaders
from turnbus.gateway.hub_tracking import TrackedReads
from turnbus.gateway.metrics import GatewayMetrics
from turnbus.shared.cluster import ClusterMux
from turnbus.shared.keys import key_slot

if TYPE_CHECKING:
    from turnbus.gateway.hub_links import LinkPool
    from turnbus.gateway.hub_readers import Reader
    from turnbus.gateway.hub_tracking import Tracker
    from turnbus.shared.keys import Keys

__all__ = [
    "Followed",
    "FollowedStreams",
    "Follower",
    "FollowerDropped",
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
    """The hub's state of one followed stream."""

    __slots__ = ("cursor", "followers", "reader", "slot", "tracker")

    def __init__(self, cursor: str, slot: int | None) -> None:
        self.cursor = cursor
        self.followers: set[Follower] = set()
        self.slot = slot  # on a cluster; None on one Redis
        # Who reads the stream: a tracker (client tracking), else a blocking reader.
        self.reader: Reader | None = None
        self.tracker: Tracker | None = None


class FollowedStreams:
    """The followed streams, each with its followers: registers and unregisters
    followers, has each stream read (by client tracking, else by blocking readers;
    every stream goes to blocking readers when Redis refuses tracking), and delivers
    what is read to the followers, dropping one whose queue is full."""

    def __init__(
        self,
        client: Any,
        keys: Keys,
        links: LinkPool,
        *,
        page: int,
        block_ms: int,
        metrics: GatewayMetrics | None,
        tracking: bool,
        broadcast: bool,
    ) -> None:
        self.streams: dict[str, Followed] = {}
        self.tracking = tracking
        self._cluster = client if isinstance(client, ClusterMux) else None
        self._metrics = metrics
        self._closed = False
        self.blocking = BlockingReaders(
            client, keys, links, self.streams, self.deliver, page=page, block_ms=block_ms
        )
        self.tracked = TrackedReads(
            keys,
            links,
            self.streams,
            self.deliver,
            self.fall_back,
            cluster=self._cluster,
            page=page,
            broadcast=broadcast,
        )

    @property
    def followers(self) -> int:
        return sum(len(s.followers) for s in self.streams.values())

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.blocking.loop = self.tracked.loop = loop
        if self._cluster is None and not self.tracking:
            self.blocking.reader_of(None)

    def drain(self) -> None:
        """Drop every follower (``shutdown``), forget every stream; refuse new ones."""
        self._closed = True
        for state in self.streams.values():
            for follower in state.followers:
                follower.drop("shutdown")
        self.streams.clear()
        self.blocking.clear()
        self.tracked.clear()
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
        if self.tracking:
            self.tracked.follow(key, state)
        else:
            self.blocking.follow(key, state)
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
        if state.tracker is not None:
            state.tracker.untrack(key)
        if state.reader is not None:
            self.blocking.unfollow(key, state.reader)
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

    def fall_back(self, exc: Exception) -> None:
        """Redis refused client tracking: every stream goes to blocking readers."""
        if self.tracking:
            log.warning(
                "SSE hub: Redis refused client tracking (%s); following streams with "
                "blocking XREADs instead (TURNBUS_SSE_TRACKING=0 says so at start)",
                exc,
            )
        self.tracking = False
        self.tracked.stop()
        for key, state in self.streams.items():
            state.tracker = None
            self.blocking.follow(key, state)

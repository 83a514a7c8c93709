"""The SSE hub's reads by client tracking (see services/gateway/hub.py).

Per Redis node a :class:`Tracker` keeps two links: one subscribed to
``__redis__:invalidate``, one with ``CLIENT TRACKING on REDIRECT <the first's id>``
that sends the hub's reads. Each non-blocking ``XREAD`` of a stream asks Redis to push
the stream's name, once, at its next write; the hub then reads the streams named (and
followed) from its cursors, one ``XREAD`` for all of them (one per slot on a Redis
Cluster, sent together). A newly followed stream is read at once, which also starts its
tracking, so no entry falls between. A lost link closes both and reads every followed
stream of the node once; on a cluster the streams go to the tracker of their slot's
master now (the slot map read again after ``MOVED`` or a lost master). Broadcast mode
(``BCAST PREFIX <prefix>:{`` on the subscribed link) is kept for measuring.

:class:`TrackingFirst` is the hub's reader when tracking is on: :class:`TrackedReads`
until Redis refuses client tracking, then the blocking readers for every stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

from redis.exceptions import BusyLoadingError, ConnectionError, RedisError, ResponseError

from turnbus.gateway.hub_entries import entries_of
from turnbus.gateway.hub_follow import Deliver, Followed, StreamReader
from turnbus.gateway.hub_links import LinkPool
from turnbus.shared.backoff import Backoff
from turnbus.shared.cluster import Address
from turnbus.shared.keys import Keys
from turnbus.shared.mux import MuxRedis
from turnbus.shared.muxclient import MuxClient
from turnbus.shared.scripts import text

__all__ = ["TrackedReads", "Tracker", "TrackingFirst", "TrackingRefused"]

log = logging.getLogger(__name__)

# Client tracking's invalidation channel (RESP2: pushed to the subscribed link), and how
# often an idle tracker checks that its links still answer.
_INVALIDATE = "__redis__:invalidate"
_TRACK_PING_S = 5.0


class TrackingRefused(RedisError):
    """Redis refused what client tracking needs (``CLIENT``, ``SUBSCRIBE``)."""


class Tracker:
    """The hub's reads on one Redis node with client tracking (see the module docs).

    Two links: ``sub`` is subscribed to ``__redis__:invalidate`` (and, in broadcast
    mode, has the tracking itself); ``link`` sends the (non-blocking) XREADs. Either
    link lost: both are closed, opened again, and every stream read once."""

    __slots__ = ("address", "broken", "dirty", "keys", "link", "reads", "sub", "task", "wake")

    def __init__(self, address: Address | None) -> None:
        self.address = address
        self.keys: dict[str, Followed] = {}  # the followed streams on this node
        self.dirty: set[str] = set()  # of those, the ones to read (changed, or new)
        self.link: MuxRedis | None = None
        self.sub: MuxRedis | None = None
        self.broken = False
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.reads = 0  # XREADs sent

    def mark(self, key: str) -> None:
        self.dirty.add(key)
        self.wake.set()

    def untrack(self, key: str) -> None:
        self.keys.pop(key, None)
        self.dirty.discard(key)

    async def close_links(self) -> None:
        links = [x for x in (self.link, self.sub) if x is not None]
        self.link = self.sub = None
        for link in links:
            # Shielded: a tracker cancelled mid-close must not leave its links open.
            await asyncio.shield(link.aclose())


class TrackedReads:
    """The trackers, one per Redis node (made with the node's first followed stream),
    each a task that reads what Redis said changed. ``refused`` is called, and the
    task ends, when Redis refuses tracking."""

    # As a StreamReader: no blocking readers.
    tracking = True
    blocking_readers = 0

    def __init__(
        self,
        keys: Keys,
        links: LinkPool,
        deliver: Deliver,
        refused: Callable[[Exception], None],
        *,
        cluster: MuxClient | None,
        page: int,
        broadcast: bool,
    ) -> None:
        self._keys = keys
        self._links = links
        self._deliver = deliver
        self._refused = refused
        self._cluster = cluster
        self._page = page
        # Tracking in its default mode (each key the hub read is told once, at its next
        # write), else in broadcast mode (BCAST PREFIX: every key written under the
        # prefix, each pass of Redis's event loop); see the module docs.
        self._broadcast = broadcast
        self._trackers: dict[Address | None, Tracker] = {}
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def tracked_reads(self) -> int:
        """XREADs sent by the trackers so far."""
        return sum(t.reads for t in self._trackers.values())

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def follow(self, key: str, state: Followed) -> None:
        """Read the stream at once from its cursor: the read also asks Redis to tell of
        the stream's next change, so no entry falls between the two."""
        address = None if self._cluster is None else self._cluster.address_for_key(key)
        self._track(key, state, self._tracker_of(address))

    def unfollow(self, key: str, state: Followed) -> None:
        for tracker in self._trackers.values():
            tracker.untrack(key)

    async def wake(self, key: str) -> None:
        """Nothing to do: a stream's first read was asked for when it was followed."""

    def wake_soon(self, key: str) -> None:
        """Nothing to do, as for :meth:`wake`."""

    def clear(self) -> None:
        """Every tracker reads nothing (the hub is draining)."""
        for tracker in self._trackers.values():
            tracker.keys.clear()
            tracker.dirty.clear()

    def stop(self) -> dict[str, Followed]:
        """End every tracker (Redis refused tracking); their links close in the
        background. Returns the streams they read."""
        trackers, self._trackers = list(self._trackers.values()), {}
        streams: dict[str, Followed] = {}
        for tracker in trackers:
            streams.update(tracker.keys)
            tracker.keys.clear()
            tracker.dirty.clear()
            if tracker.task is not None and tracker.task is not asyncio.current_task():
                tracker.task.cancel()
            self._links.finish_soon(tracker.close_links())
        return streams

    async def close(self) -> None:
        trackers, self._trackers = list(self._trackers.values()), {}
        for tracker in trackers:
            if tracker.task is not None:
                tracker.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await tracker.task
            await tracker.close_links()

    def _track(self, key: str, state: Followed, tracker: Tracker) -> None:
        tracker.keys[key] = state
        tracker.mark(key)

    def _tracker_of(self, address: Address | None) -> Tracker:
        tracker = self._trackers.get(address)
        if tracker is None:
            tracker = self._trackers[address] = Tracker(address)
            assert self.loop is not None
            name = "one" if address is None else f"{address[0]}:{address[1]}"
            tracker.task = self.loop.create_task(
                self._run(tracker), name=f"turnbus-sse-hub:tracker:{name}"
            )
        return tracker

    async def _run(self, tracker: Tracker) -> None:
        backoff = Backoff(0.05, 2.0)  # from 50 ms again after a pass that worked
        while True:
            try:
                if not tracker.keys:
                    tracker.wake.clear()
                    await tracker.wake.wait()
                elif tracker.link is None or tracker.broken:
                    await tracker.close_links()
                    if await self._home(tracker):
                        await self._open(tracker)
                elif tracker.dirty:
                    await self._read(tracker)
                else:
                    tracker.wake.clear()
                    try:
                        async with asyncio.timeout(_TRACK_PING_S):
                            await tracker.wake.wait()
                    except TimeoutError:
                        await self._ping(tracker)
                    continue
                backoff.reset()
            except TrackingRefused as exc:
                self._refused(exc)
                return
            except (RedisError, OSError) as exc:
                address = tracker.address
                where = "" if address is None else f" on {address[0]}:{address[1]}"
                delay = next(backoff)
                log.warning(
                    "SSE hub: tracked reads%s failed, reading every stream again in %.2fs: %s",
                    where,
                    delay,
                    exc,
                )
                tracker.broken = True
                await asyncio.sleep(delay)
                if self._cluster is not None:
                    with contextlib.suppress(RedisError, OSError):
                        await self._cluster.refresh()
            except Exception:
                # Nothing in a reply may end the task every follower on the node waits on.
                log.exception("SSE hub: tracked reads failed unexpectedly")
                tracker.broken = True
                await asyncio.sleep(next(backoff))

    async def _home(self, tracker: Tracker) -> bool:
        """On a cluster, move the tracker's streams whose slot another master serves now
        to that master's tracker; whether any are left to read here."""
        cluster = self._cluster
        if cluster is None:
            return True
        if tracker.address is None or any(cluster.address_for_key(k) is None for k in tracker.keys):
            await cluster.refresh()
        for key, state in list(tracker.keys.items()):
            address = cluster.address_for_key(key)
            if address is None:
                raise RedisError(f"no master serves the slot of {key}")
            if address != tracker.address:
                tracker.untrack(key)
                self._track(key, state, self._tracker_of(address))
        return bool(tracker.keys)

    async def _open(self, tracker: Tracker) -> None:
        """Open the tracker's two links; every followed stream on the node is then read
        once from its cursor (what was written while the links were down)."""
        sub = self._links.dedicated(tracker.address)
        link = self._links.dedicated(tracker.address)
        tracker.sub, tracker.link, tracker.broken = sub, link, False

        def lost() -> None:
            if tracker.link is link:  # not a link already replaced
                tracker.broken = True
                tracker.wake.set()

        try:
            # Each link is watched before its first command: one lost later (and made
            # again by the next command, without tracking) is never taken for it.
            await sub.listen(lost, lambda message: self._on_invalidate(tracker, message))
            sub_id = await sub.call("CLIENT", "ID")
            if self._broadcast:
                # Every key written under the prefix, told to the subscribed link itself.
                prefix = self._keys.session_keys_prefix()
                await sub.call(
                    "CLIENT", "TRACKING", "on", "REDIRECT", sub_id, "BCAST", "PREFIX", prefix
                )
            await sub.call("SUBSCRIBE", _INVALIDATE)
            await link.listen(lost)
            if tracker.broken:
                raise ConnectionError("a tracking link was lost while it was set up")
            if not self._broadcast:
                await link.call("CLIENT", "TRACKING", "on", "REDIRECT", sub_id)
        except ResponseError as exc:
            if isinstance(exc, BusyLoadingError):
                raise
            await tracker.close_links()
            raise TrackingRefused(str(exc)) from exc
        tracker.dirty.update(tracker.keys)

    async def _ping(self, tracker: Tracker) -> None:
        """An idle tracker's check that both its links still answer (a link lost without
        a word, or a stalled Redis, shows as a failed or late reply)."""
        sub, link = tracker.sub, tracker.link
        if sub is not None and link is not None and not tracker.broken:
            await asyncio.gather(sub.call("PING"), link.call("PING"))

    def _on_invalidate(self, tracker: Tracker, message: list[Any]) -> None:
        """``[b"message", b"__redis__:invalidate", keys]``: read the followed ones."""
        keys = message[2]
        if keys is None:  # the whole dataset was flushed
            tracker.dirty.update(tracker.keys)
        else:
            followed = tracker.keys
            for raw in keys:
                key = text(raw)
                if key in followed:
                    tracker.dirty.add(key)
        if tracker.dirty:
            tracker.wake.set()

    async def _read(self, tracker: Tracker) -> None:
        """One non-blocking XREAD of the streams marked since the last (one per slot on
        a cluster, sent together). A stream marked while it is read is read again."""
        link = tracker.link
        assert link is not None
        keys, tracker.dirty = tracker.dirty, set()
        streams = tracker.keys
        on_reply = functools.partial(self._on_reply, tracker)
        if self._cluster is None:
            groups = [list(keys)]
        else:
            by_slot: dict[int | None, list[str]] = {}
            for key in keys:
                by_slot.setdefault(streams[key].slot, []).append(key)
            groups = list(by_slot.values())
        reads = [
            link.call_into(
                on_reply,
                "XREAD",
                "COUNT",
                self._page,
                "STREAMS",
                *group,
                *[streams[k].cursor for k in group],
            )
            for group in groups
        ]
        tracker.reads += len(reads)
        try:
            if len(reads) == 1:
                await reads[0]
            else:
                for outcome in await asyncio.gather(*reads, return_exceptions=True):
                    if isinstance(outcome, BaseException):
                        raise outcome
        except BaseException:
            tracker.dirty |= keys & tracker.keys.keys()
            raise

    def _on_reply(self, tracker: Tracker, reply: Any) -> None:
        for raw_key, raw in reply or ():
            key = text(raw_key)
            state = tracker.keys.get(key)
            if state is None:
                continue
            entries = entries_of(raw)
            if len(entries) >= self._page:
                tracker.dirty.add(key)  # more may be there: read on without a wake-up
            self._deliver(state, entries)


class TrackingFirst:
    """The hub's reader with client tracking on: :class:`TrackedReads` until Redis
    refuses client tracking, then ``blocking`` for every followed stream (each from its
    cursor) and every stream followed later."""

    def __init__(
        self,
        blocking: StreamReader,
        keys: Keys,
        links: LinkPool,
        deliver: Deliver,
        *,
        cluster: MuxClient | None,
        page: int,
        broadcast: bool,
    ) -> None:
        self._tracked = TrackedReads(
            keys, links, deliver, self._fall_back, cluster=cluster, page=page, broadcast=broadcast
        )
        self._blocking = blocking
        self._reader: StreamReader = self._tracked

    @property
    def tracking(self) -> bool:
        return self._reader.tracking

    @property
    def tracked_reads(self) -> int:
        return self._tracked.tracked_reads

    @property
    def blocking_readers(self) -> int:
        return self._blocking.blocking_readers

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._tracked.start(loop)
        self._blocking.start(loop)

    def follow(self, key: str, state: Followed) -> None:
        self._reader.follow(key, state)

    def unfollow(self, key: str, state: Followed) -> None:
        self._reader.unfollow(key, state)

    async def wake(self, key: str) -> None:
        await self._reader.wake(key)

    def wake_soon(self, key: str) -> None:
        self._reader.wake_soon(key)

    def clear(self) -> None:
        self._tracked.clear()
        self._blocking.clear()

    async def close(self) -> None:
        await self._tracked.close()
        await self._blocking.close()

    def _fall_back(self, exc: Exception) -> None:
        """Redis refused client tracking: every stream goes to the blocking readers."""
        if self._reader is self._blocking:
            return
        log.warning(
            "SSE hub: Redis refused client tracking (%s); following streams with "
            "blocking XREADs instead (TURNBUS_SSE_TRACKING=0 says so at start)",
            exc,
        )
        self._reader = self._blocking
        for key, state in self._tracked.stop().items():
            self._blocking.follow(key, state)

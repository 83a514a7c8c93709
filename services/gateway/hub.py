"""The SSE hub: one per gateway process, shared by every follower.

A follower costs no Redis connection of its own. It catches up with XRANGE pages from
its cursor, then registers with the hub, which hands it new entries through a bounded
queue. A follower whose queue is full is dropped; its stream ends with a
``stream.dropped`` event and the client resumes with ``Last-Event-ID``.

How the hub learns of new entries: Redis's client tracking. Per Redis node it keeps
two links (a :class:`_Tracker`): one subscribed to ``__redis__:invalidate``, one with
``CLIENT TRACKING on REDIRECT <the first's id>`` that sends the hub's reads. Each
non-blocking ``XREAD`` of a stream asks Redis to push the stream's name, once, at its
next write; the hub then reads the streams named (and followed) from its cursors, one
``XREAD`` for all of them (one per slot on a Redis Cluster, sent together). A newly
followed stream is read at once, which also starts its tracking, so no entry falls
between. A lost link closes both and reads every followed stream of the node once; on
a cluster the streams go to the tracker of their slot's master now (the slot map read
again after ``MOVED`` or a lost master). ``broadcast=True`` uses tracking's broadcast
mode instead (``BCAST PREFIX <prefix>:{`` on the subscribed link: every key written
under the prefix is pushed, each pass of Redis's event loop), which costs Redis more
under load (docs/architecture.md).

When Redis refuses client tracking (``CLIENT`` disabled or denied by an ACL), or
``TURNBUS_SSE_TRACKING=0``, the hub runs blocking readers instead (a :class:`_Reader`):
``XREAD BLOCK`` over every followed stream (plus this process's wake-up stream, so a
newly followed stream joins the read at once). On a Redis Cluster one XREAD may only
name streams of one slot (``CROSSSLOT`` even on one node), so there is one such reader
per followed slot, each on a link to the master serving that slot, with a wake-up
stream in that slot; a read that meets ``MOVED`` or a lost master re-reads the slot map
and reads on from the hub's cursor of each stream.

The hub's read position in a stream is never a follower's cursor: it starts at
the stream's own last entry (or earlier), so a cursor ahead of the stream affects
only the follower that sent it. Replies are read undecoded and entry data decoded
leniently, so bytes that are not UTF-8 in an entry cannot stop the hub.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any, NamedTuple

import redis.asyncio as aioredis
from redis.client import NEVER_DECODE
from redis.crc import key_slot
from redis.exceptions import BusyLoadingError, ConnectionError, RedisError, ResponseError

from turnbus.gateway.metrics import GatewayMetrics
from turnbus.shared.cluster import Address, ClusterMux
from turnbus.shared.connect import dedicated_link
from turnbus.shared.events import Resync, peek_type
from turnbus.shared.keys import Keys
from turnbus.shared.mux import MuxRedis
from turnbus.shared.scripts import LuaScript, text
from turnbus.shared.settings import Settings

__all__ = [
    "CAUGHT_UP",
    "MAX_ID",
    "FollowerDropped",
    "HubItem",
    "SseHub",
    "StreamEntry",
    "id_order",
    "normalize_cursor",
]

log = logging.getLogger(__name__)

_CURSOR_RE = re.compile(r"^([0-9]{1,20})(?:-([0-9]{1,20}))?$")
_WAKE_TTL_MS = 60_000
# Client tracking's invalidation channel (RESP2: pushed to the subscribed link), and how
# often an idle tracker checks that its links still answer.
_INVALIDATE = "__redis__:invalidate"
_TRACK_PING_S = 5.0
# Idle reader links kept per node for the next reader there (a cluster's readers come and
# go with the slots followed, about one per turn), and how long one may stay idle.
_IDLE_LINKS_PER_NODE = 4
_IDLE_LINK_S = 30.0
# The largest stream entry id: nothing can ever follow it.
MAX_ID = f"{2**64 - 1}-{2**64 - 1}"


class StreamEntry(NamedTuple):
    id: str
    type: str
    data: str


class _CaughtUp:
    """Marker: the follower has everything the stream held when it connected."""

    def __repr__(self) -> str:
        return "CAUGHT_UP"


CAUGHT_UP = _CaughtUp()
HubItem = StreamEntry | Resync | _CaughtUp


class FollowerDropped(Exception):
    """The follower was removed from the hub (``reason``: ``slow_consumer`` or ``shutdown``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _to_entry(entry_id: Any, fields: Any) -> StreamEntry:
    # The "data" field: first, as every writer stores it (the worker's own writes add
    # their write number after it), else looked for in the flat [field, value, ...] list.
    flat: Any = fields or ()
    if len(flat) >= 2 and flat[0] == b"data":
        raw = flat[1]
    else:
        raw = next(
            (flat[i + 1] for i in range(0, len(flat) - 1, 2) if text(flat[i]) == "data"), None
        )
    # The data goes on to clients as UTF-8: bytes that are not UTF-8 become U+FFFD.
    data = text(raw, "replace")
    return StreamEntry(text(entry_id), peek_type(data, "unknown"), data)


def _entries(raw: Any) -> list[StreamEntry]:
    """Entries of an XRANGE/XREVRANGE reply (or one stream of an XREAD reply)."""
    return [_to_entry(entry_id, fields) for entry_id, fields in raw or ()]


def _min_id(a: str, b: str) -> str:
    return a if id_order(a) <= id_order(b) else b


def id_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a sortable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def normalize_cursor(raw: str) -> str:
    """A stream entry id as ``ms-seq``; ``ValueError`` when ``raw`` is not one."""
    match = _CURSOR_RE.match(raw.strip())
    if match is None:
        raise ValueError(f"not a stream entry id: {raw!r}")
    ms, seq = int(match.group(1)), int(match.group(2) or 0)
    if ms >= 2**64 or seq >= 2**64:
        raise ValueError(f"stream entry id out of range: {raw!r}")
    return f"{ms}-{seq}"


class _Follower:
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


class _Followed:
    __slots__ = ("cursor", "followers", "reader", "slot", "tracker")

    def __init__(self, cursor: str, slot: int | None) -> None:
        self.cursor = cursor
        self.followers: set[_Follower] = set()
        self.slot = slot  # on a cluster; None on one Redis
        # Who reads the stream: a tracker (client tracking), else a blocking reader.
        self.reader: _Reader | None = None
        self.tracker: _Tracker | None = None


def _hash_tag(key: str) -> str | None:
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1 : end] if end > start + 1 else None


class _Reader:
    """One blocking XREAD loop over a group of followed streams: all of them on one
    Redis, one slot's on a Redis Cluster. Its read has a link of its own (a blocking
    XREAD must not hold the shared one), sent raw. Its wake-up goes on the hub's wake
    link to the same node (one per node), which on the shared link would wait behind
    every command queued before it."""

    __slots__ = (
        "address",
        "changed",
        "group",
        "link",
        "reading",
        "streams",
        "task",
        "wake_cursor",
        "wake_key",
        "wake_sent",
        "waker",
    )

    def __init__(self, group: int | None, wake_key: str) -> None:
        self.group = group
        self.wake_key = wake_key
        self.wake_cursor = "0-0"
        self.streams: dict[str, _Followed] = {}
        self.changed = asyncio.Event()
        self.reading = False
        self.wake_sent = False
        self.address: Address | None = None
        self.link: MuxRedis | None = None
        self.waker: MuxRedis | None = None
        self.task: asyncio.Task[None] | None = None

    async def close_links(self) -> None:
        link, self.link, self.waker = self.link, None, None
        if link is not None:
            # Shielded: a reader cancelled mid-close must not leave its link open.
            await asyncio.shield(link.aclose())


class _Tracking(RedisError):
    """Redis refused what client tracking needs (``CLIENT``, ``SUBSCRIBE``)."""


class _Tracker:
    """The hub's reads on one Redis node with client tracking (see the module docs).

    Two links: ``sub`` is subscribed to ``__redis__:invalidate`` (and, in broadcast
    mode, has the tracking itself); ``link`` sends the (non-blocking) XREADs. Either
    link lost: both are closed, opened again, and every stream read once."""

    __slots__ = ("address", "broken", "dirty", "keys", "link", "reads", "sub", "task", "wake")

    def __init__(self, address: Address | None) -> None:
        self.address = address
        self.keys: set[str] = set()  # the followed streams on this node
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

    async def close_links(self) -> None:
        links = [x for x in (self.link, self.sub) if x is not None]
        self.link = self.sub = None
        for link in links:
            # Shielded: a tracker cancelled mid-close must not leave its links open.
            await asyncio.shield(link.aclose())


class SseHub:
    """Fans stream entries out to in-process followers (see the module docs).

    ``tracking``: learn of new entries by client tracking (the default, from
    ``settings.sse_tracking``), else blocking reads from the start; ``broadcast``:
    tracking's broadcast mode, for measuring (it hears only of keys under the
    ``keys`` prefix)."""

    def __init__(
        self,
        settings: Settings,
        client: aioredis.Redis,
        keys: Keys,
        *,
        queue_size: int = 1000,
        block_ms: int = 1000,
        page: int = 500,
        metrics: GatewayMetrics | None = None,
        tracking: bool | None = None,
        broadcast: bool = False,
    ) -> None:
        self._settings = settings
        # Client tracking, unless the settings or ``tracking`` say no, or Redis refuses it.
        self._tracking = settings.sse_tracking if tracking is None else tracking
        self._trackers: dict[Address | None, _Tracker] = {}
        # Tracking in its default mode (each key the hub read is told once, at its next
        # write), else in broadcast mode (BCAST PREFIX: every key written under the
        # prefix, each pass of Redis's event loop); see the module docs.
        self._broadcast = broadcast
        self._client = client
        self._cluster = client if isinstance(client, ClusterMux) else None
        self._keys = keys
        self._instance = uuid.uuid4().hex
        self._page_script = LuaScript(client, "sse_page.lua", read_only=True)
        self._queue_size = queue_size
        self._block_ms = block_ms
        self._page = page
        self._metrics = metrics
        self._streams: dict[str, _Followed] = {}
        self._readers: dict[int | None, _Reader] = {}
        self._wakers: set[asyncio.Task[None]] = set()
        self._wake_links: dict[Address | None, MuxRedis] = {}
        # Reader links with nothing in flight, per node, newest last, with when they
        # became idle.
        self._idle: dict[Address | None, list[tuple[MuxRedis, float]]] = {}
        self._prune_handle: asyncio.TimerHandle | None = None
        self.links_opened = 0  # reader links made (the others were reused)
        self._stopping: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def followed_streams(self) -> int:
        return len(self._streams)

    @property
    def followers(self) -> int:
        return sum(len(s.followers) for s in self._streams.values())

    @property
    def readers(self) -> int:
        """Blocking readers running (one on one Redis; one per followed slot on a cluster)."""
        return len(self._readers)

    @property
    def tracking(self) -> bool:
        """Whether new entries are learnt of by client tracking (else blocking reads)."""
        return self._tracking

    @property
    def tracked_reads(self) -> int:
        """XREADs sent by the trackers so far."""
        return sum(t.reads for t in self._trackers.values())

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._cluster is None and not self._tracking:
            self._reader_of(None)

    def drain(self) -> None:
        """End every follower's stream with ``stream.dropped`` (``shutdown``); refuse new ones.

        Called when the process is asked to stop, so SSE responses end cleanly (and
        clients reconnect elsewhere with ``Last-Event-ID``) instead of being cut.
        """
        self._closed = True
        for state in self._streams.values():
            for follower in state.followers:
                follower.drop("shutdown")
        self._streams.clear()
        for reader in self._readers.values():
            reader.streams.clear()
        for tracker in self._trackers.values():
            tracker.keys.clear()
            tracker.dirty.clear()
        if self._metrics is not None:
            self._metrics.followed_streams.set(0)

    def drain_threadsafe(self) -> None:
        """:meth:`drain` from a signal handler or another thread."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.drain)

    async def close(self) -> None:
        self.drain()
        readers, self._readers = list(self._readers.values()), {}
        for task in list(self._wakers):
            task.cancel()
        trackers, self._trackers = list(self._trackers.values()), {}
        for tracker in trackers:
            if tracker.task is not None:
                tracker.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await tracker.task
            await tracker.close_links()
        # Readers being stopped finish stopping (a task cancelled before it starts
        # would never close their links).
        await asyncio.gather(*self._stopping, return_exceptions=True)
        for reader in readers:
            await self._stop_reader(reader, reuse=False)
        if self._prune_handle is not None:
            self._prune_handle.cancel()
            self._prune_handle = None
        links = [link for idle in self._idle.values() for link, _ in idle]
        self._idle.clear()
        links += self._wake_links.values()
        self._wake_links = {}
        for link in links:
            await link.aclose()

    async def _stop_reader(self, reader: _Reader, *, reuse: bool = True) -> None:
        """End a reader; its link goes to its node's idle links (``reuse``) once nothing
        is in flight on it, else it is closed."""
        try:
            if reader.task is not None:
                reader.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader.task
                reader.task = None
            if reader.wake_key:
                with contextlib.suppress(RedisError, OSError):
                    await self._end_wake(reader)
        finally:
            link, address = reader.link, reader.address
            reader.link = reader.waker = None
            if link is not None:
                # Shielded: a stop cancelled midway must not leave its link open.
                await asyncio.shield(self._release(link, address) if reuse else link.aclose())

    async def _end_wake(self, reader: _Reader) -> None:
        """Delete the reader's wake-up stream; a read of the cancelled reader still
        blocked on it is woken first, so its link is soon free for another reader."""
        if reader.waker is None or reader.link is None or not reader.link.in_flight:
            await self._client.delete(reader.wake_key)
            return
        try:
            async with reader.waker.pipeline(transaction=False) as pipe:
                pipe.xadd(reader.wake_key, {"w": "1"}, maxlen=1, approximate=False)
                pipe.delete(reader.wake_key)
                await pipe.execute()
        except (RedisError, OSError):  # the slot moved: delete it where it is now
            await self._client.delete(reader.wake_key)

    async def _release(self, link: MuxRedis, address: Address | None) -> None:
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

    def _take_link(self, address: Address | None) -> MuxRedis:
        """An idle link to ``address`` with nothing in flight, else a new one."""
        idle = self._idle.get(address)
        while idle:
            link, _ = idle.pop()
            if not link.in_flight:
                return link
            self._close_soon(link)
        self.links_opened += 1
        return dedicated_link(self._settings, address, reply_timeout_s=self._block_ms / 1000 + 5)

    def _prune(self) -> None:
        """Close the links idle for longer than ``_IDLE_LINK_S``."""
        self._prune_handle = None
        if self._loop is None:
            return
        expired = self._loop.time() - _IDLE_LINK_S
        for address, idle in list(self._idle.items()):
            for link, _ in [x for x in idle if x[1] <= expired]:
                self._close_soon(link)
            idle[:] = [x for x in idle if x[1] > expired]
            if not idle:
                del self._idle[address]
        if self._idle:
            self._prune_handle = self._loop.call_later(_IDLE_LINK_S / 2, self._prune)

    def _forget_idle(self, masters: set[Address | None]) -> None:
        """Close the idle links to nodes that no longer serve slots (after a failover,
        a reader must not be given a link to a master that became a replica)."""
        for address in [a for a in self._idle if a not in masters]:
            for link, _ in self._idle.pop(address):
                self._close_soon(link)

    def _close_soon(self, link: MuxRedis) -> None:
        self._finish_soon(link.aclose())

    def _finish_soon(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` (a close, a stop) in the background; :meth:`close` awaits it."""
        if self._loop is None:
            work.close()
            return
        task = self._loop.create_task(work)
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def last_id(self, key: str) -> str | None:
        """The id of the stream's last entry (``None``: the stream is empty or gone)."""
        raw = await self._client.execute_command(  # type: ignore[no-untyped-call]
            "XREVRANGE", key, "+", "-", "COUNT", 1, **{NEVER_DECODE: True}
        )
        return text(raw[0][0]) if raw else None

    async def stream(
        self, key: str, after: str | None, is_genesis: Callable[[StreamEntry], bool]
    ) -> AsyncIterator[HubItem]:
        """Every entry of ``key`` after ``after``, in order, with no gap and no duplicate.

        Yields :class:`Resync` wherever entries after the cursor are gone (the
        stream was trimmed past it, or no longer exists), then continues from the
        earliest entry still held; yields :data:`CAUGHT_UP` once the entries present
        at connect time are out; then live entries until the caller stops.
        Raises :class:`FollowerDropped` when the hub drops this follower.
        """
        batches = self.batches(key, after, is_genesis)
        try:
            async for batch in batches:
                for item in batch:
                    yield item
        finally:
            await batches.aclose()

    async def batches(
        self,
        key: str,
        after: str | None,
        is_genesis: Callable[[StreamEntry], bool],
        *,
        first: StreamEntry | None = None,
    ) -> AsyncGenerator[list[HubItem], None]:
        """:meth:`stream`, a list at a time: each list holds every item ready at once
        (a catch-up page, or what the hub read for this follower since it last asked).

        ``first``: the stream's first entry, just written by the caller (a new turn's
        ``turn.queued``): it is the whole catch-up, so none is read."""
        cursor = after or "0-0"
        # Where the hub may start reading this stream if it is not followed yet: its
        # last entry at catch-up, or the follower's cursor if that is earlier. Never
        # a cursor ahead of the stream, which would hide new entries from everyone.
        start = "0-0"
        follower = _Follower(key, self._queue_size)
        hub_cursor: str | None = None
        registered = False
        if self._cluster is not None and self._cluster.address_for_key(key) is None:
            await self._cluster.masters()  # the slot map, read once
        try:
            if first is not None:
                # A stream nobody else can know yet: follow it at once (the hub reads
                # on from its first entry), then send that entry.
                cursor = start = first.id
                hub_cursor = self._register(follower, cursor)
                registered = True
                if hub_cursor is None:
                    self._wake_soon(key)
                yield [first]
            else:
                pages = self._range(key, cursor, "+", is_genesis)
                async for batch, last in pages:
                    start = last
                    for item in batch:
                        if isinstance(item, StreamEntry):
                            cursor = item.id
                    if batch:
                        yield [*batch]
            yield [CAUGHT_UP]

            if not registered:
                hub_cursor = self._register(follower, _min_id(cursor, start))
                registered = True
                if hub_cursor is None:
                    await self._wake(key)
            if hub_cursor is not None and id_order(hub_cursor) > id_order(cursor):
                # The hub already read past our catch-up: fill the gap from Redis.
                async for batch, _ in self._range(key, cursor, hub_cursor, is_genesis):
                    for item in batch:
                        if isinstance(item, StreamEntry):
                            cursor = item.id
                    if batch:
                        yield [*batch]
            while True:
                fresh: list[HubItem] = []
                for entry in await follower.next_batch():
                    if id_order(entry.id) <= id_order(cursor):
                        continue
                    cursor = entry.id
                    fresh.append(entry)
                if fresh:
                    yield fresh
        finally:
            if registered:
                self._unregister(follower)

    async def _range(
        self, key: str, after: str, until: str, is_genesis: Callable[[StreamEntry], bool]
    ) -> AsyncIterator[tuple[list[StreamEntry | Resync], str]]:
        """Pages of ``(after, until]``, each with the id of the stream's last entry.

        Each page is read in one script call with the stream's first entry, which
        tells whether entries after ``after`` were trimmed away (even between two
        pages): then :class:`Resync` comes first in the page, never a silent skip.
        """
        while True:
            start = "" if after == MAX_ID else f"({after}"
            reply = await self._page_script(keys=[key], args=[start, until, self._page])
            head_raw, page_raw, last_raw = reply
            head = _entries(head_raw)
            if not head:
                yield [Resync(requested=after, earliest=None)], "0-0"
                return
            last = _entries(last_raw)[0].id
            batch: list[StreamEntry | Resync] = []
            if id_order(after) < id_order(head[0].id) and not is_genesis(head[0]):
                batch.append(Resync(requested=after, earliest=head[0].id))
            page = _entries(page_raw)
            for entry in page:
                after = entry.id
                batch.append(entry)
            yield batch, last
            if len(page) < self._page:
                return

    def _register(self, follower: _Follower, cursor: str) -> str | None:
        """Add a follower; returns the hub's cursor for an already-followed stream."""
        if self._closed:
            follower.drop("shutdown")
            return cursor
        state = self._streams.get(follower.key)
        if state is not None:
            state.followers.add(follower)
            return state.cursor
        key = follower.key
        state = _Followed(cursor, None if self._cluster is None else key_slot(key.encode()))
        state.followers.add(follower)
        self._streams[key] = state
        if self._tracking:
            # Read at once from the cursor: the read also asks Redis to tell of the
            # stream's next change, so no entry falls between the two.
            address = None if self._cluster is None else self._cluster.address_for_key(key)
            self._track(key, state, self._tracker_of(address))
        else:
            self._read_with(key, state, self._reader_of(state.slot, key))
        if self._metrics is not None:
            self._metrics.followed_streams.set(len(self._streams))
        return None

    def _read_with(self, key: str, state: _Followed, reader: _Reader) -> None:
        state.reader = reader
        reader.streams[key] = state
        reader.changed.set()

    def _track(self, key: str, state: _Followed, tracker: _Tracker) -> None:
        if state.tracker is not None:
            state.tracker.keys.discard(key)
            state.tracker.dirty.discard(key)
        state.tracker = tracker
        tracker.keys.add(key)
        tracker.mark(key)

    def _tracker_of(self, address: Address | None) -> _Tracker:
        tracker = self._trackers.get(address)
        if tracker is None:
            tracker = self._trackers[address] = _Tracker(address)
            assert self._loop is not None
            name = "one" if address is None else f"{address[0]}:{address[1]}"
            tracker.task = self._loop.create_task(
                self._run_tracker(tracker), name=f"turnbus-sse-hub:tracker:{name}"
            )
        return tracker

    def _reader_of(self, group: int | None, key: str = "") -> _Reader:
        reader = self._readers.get(group)
        if reader is None:
            tag = None if group is None else _hash_tag(key)
            wake_key = self._keys.gateway_wake(self._instance, tag)
            if group is not None and key_slot(wake_key.encode()) != group:
                # A key without a hash tag: no other key name is sure to share its
                # slot, so its reader goes without a wake-up (a new stream joins the
                # read when it re-issues, within block_ms).
                wake_key = ""
            reader = self._readers[group] = _Reader(group, wake_key)
            assert self._loop is not None
            reader.task = self._loop.create_task(
                self._run(reader), name=f"turnbus-sse-hub:{'all' if group is None else group}"
            )
        return reader

    def _unregister(self, follower: _Follower) -> None:
        state = self._streams.get(follower.key)
        if state is None:
            return
        state.followers.discard(follower)
        if not state.followers:
            self._forget(follower.key, state)

    def _forget(self, key: str, state: _Followed) -> None:
        del self._streams[key]
        if state.tracker is not None:
            state.tracker.keys.discard(key)
            state.tracker.dirty.discard(key)
        reader = state.reader
        if reader is not None:
            reader.streams.pop(key, None)
            if not reader.streams and reader.group is not None:
                self._end_reader(reader)
        if self._metrics is not None:
            self._metrics.followed_streams.set(len(self._streams))

    def _end_reader(self, reader: _Reader) -> None:
        """A cluster's readers are one per followed slot: one that reads nothing ends."""
        if self._readers.get(reader.group) is reader:
            del self._readers[reader.group]
        self._finish_soon(self._stop_reader(reader))

    def _in_background(self, work: Any) -> None:
        if self._loop is None:
            return
        task = self._loop.create_task(work)
        self._wakers.add(task)
        task.add_done_callback(self._wakers.discard)

    def _wake_soon(self, key: str) -> None:
        """:meth:`_wake` without waiting for it (a follower that must not wait)."""
        state = self._streams.get(key)
        reader = None if state is None else state.reader
        if reader is not None and reader.reading and not reader.wake_sent:
            self._in_background(self._wake(key))

    async def _wake(self, key: str) -> None:
        """Make a blocked XREAD return so it is re-issued with the new stream in it."""
        state = self._streams.get(key)
        reader = None if state is None else state.reader
        if reader is None:
            return  # a tracked stream: its first read was asked for when it was followed
        if not reader.reading or reader.wake_sent or reader.waker is None or not reader.wake_key:
            return
        reader.wake_sent = True
        try:
            async with reader.waker.pipeline(transaction=False) as pipe:
                pipe.xadd(reader.wake_key, {"w": "1"}, maxlen=1, approximate=False)
                pipe.pexpire(reader.wake_key, _WAKE_TTL_MS)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            # The read re-issues within block_ms anyway; the wake only saves latency.
            log.warning("SSE hub wake-up failed: %s", exc)

    def _read_gap(self, reader: _Reader) -> float:
        """Seconds between the starts of two reads: each read costs Redis and this
        process time for every followed stream, so with many streams the hub reads
        less often and gets more entries per read (at most 10 ms later)."""
        return min(0.01, max(0.001, len(reader.streams) * 0.00001))

    async def _route(self, reader: _Reader) -> None:
        """Give the reader links to the node that serves its streams now."""
        address: Address | None = None
        if self._cluster is not None:
            key = reader.wake_key or next(iter(reader.streams), "")
            address = self._cluster.address_for_key(key)
            if address is None:
                await self._cluster.refresh()
                address = self._cluster.address_for_key(key)
                if address is None:
                    raise RedisError(f"no master serves the slot of {key}")
        reader.address = address
        reader.link = self._take_link(address)
        waker = self._wake_links.get(address)
        if waker is None:
            waker = self._wake_links[address] = dedicated_link(self._settings, address)
        reader.waker = waker

    async def _reroute(self, reader: _Reader, exc: Exception) -> None:
        """After a failed read on a cluster: read the slot map again; the next read goes
        to the slot's master now, from the hub's cursors."""
        assert self._cluster is not None
        with contextlib.suppress(RedisError, OSError):
            await self._cluster.refresh()
            masters = await self._cluster.masters()
            self._forget_idle({self._cluster.address_of(node) for node in masters})
        if self._cluster.address_for_key(reader.wake_key or next(iter(reader.streams), "")) != (
            reader.address
        ):
            log.info(
                "SSE hub: slot %s moved (%s); reading on from its new master", reader.group, exc
            )
            await reader.close_links()

    async def _run(self, reader: _Reader) -> None:
        backoff = 0.05
        loop = asyncio.get_running_loop()
        last_read = 0.0
        while True:
            if not reader.streams:
                reader.changed.clear()
                await reader.changed.wait()
                continue
            wait = last_read + self._read_gap(reader) - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue  # streams may have come and gone meanwhile
            last_read = loop.time()
            keys = list(reader.streams)
            cursors = [s.cursor for s in reader.streams.values()]
            if reader.wake_key:
                keys.append(reader.wake_key)
                cursors.append(reader.wake_cursor)
            try:
                if reader.link is None:
                    await self._route(reader)
                assert reader.link is not None
                reader.reading = True
                reader.wake_sent = False
                # The reply is dispatched as soon as it is read off the socket: the
                # followers' tasks are woken in this pass of the loop, not the next.
                await reader.link.call_into(
                    lambda reply: self._on_read(reader, reply),
                    "XREAD",
                    "COUNT",
                    self._page,
                    "BLOCK",
                    self._block_ms,
                    "STREAMS",
                    *keys,
                    *cursors,
                )
            except (RedisError, OSError) as exc:
                log.warning("SSE hub read failed, retrying in %.2fs: %s", backoff, exc)
                reader.reading = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                if self._cluster is not None:
                    await self._reroute(reader, exc)
                continue
            except Exception:
                # Nothing in a reply may end the one reader every follower depends on.
                log.exception("SSE hub read failed unexpectedly, retrying in %.2fs", backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            finally:
                reader.reading = False
            backoff = 0.05

    def _on_read(self, reader: _Reader, reply: Any) -> None:
        reader.reading = False
        self._dispatch(reader, reply or [])

    def _dispatch(self, reader: _Reader, reply: Any) -> None:
        for raw_key, raw in reply:
            key = text(raw_key)
            entries = _entries(raw)
            if not entries:
                continue
            if key == reader.wake_key:
                reader.wake_cursor = entries[-1].id
                continue
            state = reader.streams.get(key)
            if state is not None:
                self._deliver(state, entries)

    def _deliver(self, state: _Followed, entries: list[StreamEntry]) -> None:
        for entry in entries:
            state.cursor = entry.id
            for follower in list(state.followers):
                if not follower.offer(entry):
                    self._drop(state, follower)

    def _drop(self, state: _Followed, follower: _Follower) -> None:
        follower.drop("slow_consumer")
        state.followers.discard(follower)
        if not state.followers and self._streams.get(follower.key) is state:
            self._forget(follower.key, state)
        if self._metrics is not None:
            self._metrics.sse_dropped.inc()
        log.info("SSE follower of %s dropped: its queue is full", follower.key)

    # -- client tracking ----------------------------------------------------------------

    async def _run_tracker(self, tracker: _Tracker) -> None:
        backoff = 0.05
        while True:
            try:
                if not tracker.keys:
                    tracker.wake.clear()
                    await tracker.wake.wait()
                elif tracker.link is None or tracker.broken:
                    await tracker.close_links()
                    if await self._home(tracker):
                        await self._open_tracker(tracker)
                elif tracker.dirty:
                    await self._read_tracked(tracker)
                else:
                    tracker.wake.clear()
                    try:
                        async with asyncio.timeout(_TRACK_PING_S):
                            await tracker.wake.wait()
                    except TimeoutError:
                        await self._ping(tracker)
                    continue
                backoff = 0.05
            except _Tracking as exc:
                self._fall_back(exc)
                return
            except (RedisError, OSError) as exc:
                address = tracker.address
                where = "" if address is None else f" on {address[0]}:{address[1]}"
                log.warning(
                    "SSE hub: tracked reads%s failed, reading every stream again in %.2fs: %s",
                    where,
                    backoff,
                    exc,
                )
                tracker.broken = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                if self._cluster is not None:
                    with contextlib.suppress(RedisError, OSError):
                        await self._cluster.refresh()
            except Exception:
                # Nothing in a reply may end the task every follower on the node waits on.
                log.exception("SSE hub: tracked reads failed unexpectedly")
                tracker.broken = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _home(self, tracker: _Tracker) -> bool:
        """On a cluster, move the tracker's streams whose slot another master serves now
        to that master's tracker; whether any are left to read here."""
        cluster = self._cluster
        if cluster is None:
            return True
        if tracker.address is None or any(cluster.address_for_key(k) is None for k in tracker.keys):
            await cluster.refresh()
        for key in list(tracker.keys):
            address = cluster.address_for_key(key)
            if address is None:
                raise RedisError(f"no master serves the slot of {key}")
            if address != tracker.address:
                self._track(key, self._streams[key], self._tracker_of(address))
        return bool(tracker.keys)

    async def _open_tracker(self, tracker: _Tracker) -> None:
        """Open the tracker's two links; every followed stream on the node is then read
        once from its cursor (what was written while the links were down)."""
        sub = dedicated_link(self._settings, tracker.address)
        link = dedicated_link(self._settings, tracker.address)
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
                prefix = f"{self._keys.prefix}:{{"
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
            raise _Tracking(str(exc)) from exc
        tracker.dirty |= tracker.keys

    async def _ping(self, tracker: _Tracker) -> None:
        """An idle tracker's check that both its links still answer (a link lost without
        a word, or a stalled Redis, shows as a failed or late reply)."""
        sub, link = tracker.sub, tracker.link
        if sub is not None and link is not None and not tracker.broken:
            await asyncio.gather(sub.call("PING"), link.call("PING"))

    def _on_invalidate(self, tracker: _Tracker, message: list[Any]) -> None:
        """``[b"message", b"__redis__:invalidate", keys]``: read the followed ones."""
        keys = message[2]
        if keys is None:  # the whole dataset was flushed
            tracker.dirty |= tracker.keys
        else:
            followed = tracker.keys
            for raw in keys:
                key = text(raw)
                if key in followed:
                    tracker.dirty.add(key)
        if tracker.dirty:
            tracker.wake.set()

    async def _read_tracked(self, tracker: _Tracker) -> None:
        """One non-blocking XREAD of the streams marked since the last (one per slot on
        a cluster, sent together). A stream marked while it is read is read again."""
        link = tracker.link
        assert link is not None
        keys, tracker.dirty = tracker.dirty, set()
        streams = self._streams
        on_reply = functools.partial(self._on_tracked, tracker)
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
            tracker.dirty |= keys & tracker.keys
            raise

    def _on_tracked(self, tracker: _Tracker, reply: Any) -> None:
        for raw_key, raw in reply or ():
            key = text(raw_key)
            state = self._streams.get(key)
            if state is None or state.tracker is not tracker:
                continue
            entries = _entries(raw)
            if len(entries) >= self._page:
                tracker.dirty.add(key)  # more may be there: read on without a wake-up
            self._deliver(state, entries)

    def _fall_back(self, exc: Exception) -> None:
        """Redis refused client tracking: every stream goes to blocking readers."""
        if self._tracking:
            log.warning(
                "SSE hub: Redis refused client tracking (%s); following streams with "
                "blocking XREADs instead (TURNBUS_SSE_TRACKING=0 says so at start)",
                exc,
            )
        self._tracking = False
        trackers, self._trackers = list(self._trackers.values()), {}
        for tracker in trackers:
            tracker.keys.clear()
            tracker.dirty.clear()
            if tracker.task is not None and tracker.task is not asyncio.current_task():
                tracker.task.cancel()
            self._finish_soon(tracker.close_links())
        for key, state in self._streams.items():
            state.tracker = None
            self._read_with(key, state, self._reader_of(state.slot, key))

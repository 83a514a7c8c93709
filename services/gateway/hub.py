"""The SSE hub: one per gateway process, shared by every follower.

A follower costs no Redis connection of its own. It catches up with XRANGE pages from
its cursor, then registers with the hub, which hands it new entries through a bounded
queue. A follower whose queue is full is dropped; its stream ends with a
``stream.dropped`` event and the client resumes with ``Last-Event-ID``.

How the hub learns of new entries: Redis's client tracking. Per Redis node it keeps
two links: one subscribed to ``__redis__:invalidate``, one with ``CLIENT TRACKING on
REDIRECT <the first's id>`` that sends the hub's reads. Each non-blocking ``XREAD`` of
a stream asks Redis to push the stream's name, once, at its next write; the hub then
reads the streams named (and followed) from their cursors. ``broadcast=True`` uses
tracking's broadcast mode instead, which costs Redis more under load
(docs/architecture.md). When Redis refuses client tracking (``CLIENT`` disabled or
denied by an ACL), or ``TURNBUS_SSE_TRACKING=0``, the hub runs blocking readers
instead: ``XREAD BLOCK`` over the followed streams (one reader per followed slot on a
Redis Cluster), woken through a wake-up stream when a stream is newly followed.

The hub's read position in a stream is never a follower's cursor: it starts at
the stream's own last entry (or earlier), so a cursor ahead of the stream affects
only the follower that sent it.

The hub's rooms: this module has the public surface (:class:`SseHub`: catch-up, the
follow loop, start and close) and picks the hub's reader; ``hub_follow`` the followers,
the followed streams (registry, delivery, drops) and the reader interface
(:class:`~turnbus.gateway.hub_follow.StreamReader`); ``hub_tracking`` the reads by
client tracking, and the fall back to blocking reads; ``hub_readers`` the blocking
readers; ``hub_links`` their dedicated links; ``hub_entries`` the decoding of stream
entries.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import redis.asyncio as aioredis

from turnbus.gateway.hub_entries import StreamEntry, entries_of
from turnbus.gateway.hub_follow import (
    Deliver,
    FollowedStreams,
    Follower,
    FollowerDropped,
    StreamReader,
)
from turnbus.gateway.hub_links import LinkPool
from turnbus.gateway.hub_readers import BlockingReaders
from turnbus.gateway.hub_tracking import TrackingFirst
from turnbus.gateway.metrics import GatewayMetrics
from turnbus.shared.events import Resync
from turnbus.shared.keys import Keys
from turnbus.shared.muxclient import mux_client
from turnbus.shared.redispy import UNDECODED
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

_CURSOR_RE = re.compile(r"^([0-9]{1,20})(?:-([0-9]{1,20}))?$")
# The largest stream entry id: nothing can ever follow it.
MAX_ID = f"{2**64 - 1}-{2**64 - 1}"


class _CaughtUp:
    """Marker: the follower has everything the stream held when it connected."""

    def __repr__(self) -> str:
        return "CAUGHT_UP"


CAUGHT_UP = _CaughtUp()
HubItem = StreamEntry | Resync | _CaughtUp


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
        self._client = client
        mux = mux_client(client)
        self._cluster = mux if mux.sharded else None
        self._page_script = LuaScript(client, "sse_page.lua", read_only=True)
        self._queue_size = queue_size
        self._page = page
        self._links = links = LinkPool(settings, block_ms=block_ms)
        # Client tracking, unless the settings or ``tracking`` say no, or Redis refuses it.
        tracked = settings.sse_tracking if tracking is None else tracking

        def reader(deliver: Deliver) -> StreamReader:
            # Picked once: the hub never asks which it holds.
            blocking = BlockingReaders(client, keys, links, deliver, page=page, block_ms=block_ms)
            if not tracked:
                return blocking
            return TrackingFirst(
                blocking,
                keys,
                links,
                deliver,
                cluster=self._cluster,
                page=page,
                broadcast=broadcast,
            )

        self._followed = FollowedStreams(client, reader, metrics=metrics)
        self._reader = self._followed.reader
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def followed_streams(self) -> int:
        return len(self._followed.streams)

    @property
    def followers(self) -> int:
        return self._followed.followers

    @property
    def readers(self) -> int:
        """Blocking readers running (one on one Redis; one per followed slot on a cluster)."""
        return self._reader.blocking_readers

    @property
    def tracking(self) -> bool:
        """Whether new entries are learnt of by client tracking (else blocking reads)."""
        return self._reader.tracking

    @property
    def tracked_reads(self) -> int:
        """XREADs sent by the trackers so far."""
        return self._reader.tracked_reads

    @property
    def links_opened(self) -> int:
        """Blocking readers' links made (the others were reused)."""
        return self._links.links_opened

    async def start(self) -> None:
        self._loop = self._links.loop = asyncio.get_running_loop()
        self._reader.start(self._loop)

    def drain(self) -> None:
        """End every follower's stream with ``stream.dropped`` (``shutdown``); refuse new ones.

        Called when the process is asked to stop, so SSE responses end cleanly (and
        clients reconnect elsewhere with ``Last-Event-ID``) instead of being cut.
        """
        self._links.drain()
        self._followed.drain()

    def drain_threadsafe(self) -> None:
        """:meth:`drain` from a signal handler or another thread."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.drain)

    async def close(self) -> None:
        self.drain()
        await self._reader.close()
        await self._links.close()

    async def last_id(self, key: str) -> str | None:
        """The id of the stream's last entry (``None``: the stream is empty or gone)."""
        raw = await self._client.execute_command(  # type: ignore[no-untyped-call]
            "XREVRANGE", key, "+", "-", "COUNT", 1, **UNDECODED
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
        follower = Follower(key, self._queue_size)
        hub_cursor: str | None = None
        registered = False
        if self._cluster is not None and self._cluster.address_for_key(key) is None:
            await self._cluster.masters()  # the slot map, read once
        try:
            if first is not None:
                # A stream nobody else can know yet: follow it at once (the hub reads
                # on from its first entry), then send that entry.
                cursor = start = first.id
                hub_cursor = self._followed.register(follower, cursor)
                registered = True
                if hub_cursor is None:
                    self._reader.wake_soon(key)
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
                hub_cursor = self._followed.register(follower, _min_id(cursor, start))
                registered = True
                if hub_cursor is None:
                    await self._reader.wake(key)
            if hub_cursor is not None and id_order(hub_cursor) > id_order(cursor):
                # The hub already read past our catch-up: fill the gap from Redis.
                async for batch, _ in self._range(key, cursor, hub_cursor, is_genesis):
                    for item in batch:
                        if isinstance(item, StreamEntry):
                            cursor = item.id
                    if batch:
                        yield [*batch]
            sent = id_order(cursor)
            while True:
                fresh: list[HubItem] = []
                for entry in await follower.next_batch():
                    order = id_order(entry.id)
                    if order <= sent:
                        continue
                    sent = order
                    fresh.append(entry)
                if fresh:
                    yield fresh
        finally:
            if registered:
                self._followed.unregister(follower)

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
            head = entries_of(head_raw)
            if not head:
                yield [Resync(requested=after, earliest=None)], "0-0"
                return
            last = entries_of(last_raw)[0].id
            batch: list[StreamEntry | Resync] = []
            if id_order(after) < id_order(head[0].id) and not is_genesis(head[0]):
                batch.append(Resync(requested=after, earliest=head[0].id))
            page = entries_of(page_raw)
            for entry in page:
                after = entry.id
                batch.append(entry)
            yield batch, last
            if len(page) < self._page:
                return

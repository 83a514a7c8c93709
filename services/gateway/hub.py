"""The SSE hub: one blocking reader per gateway process, shared by every follower.

A follower costs no Redis connection of its own. It catches up with XRANGE
pages from its cursor, then registers with the hub, whose single task runs
``XREAD BLOCK`` over every followed stream (plus this process's wake-up stream, so
a newly followed stream joins the read at once) and hands entries to bounded
per-follower queues. A follower whose queue is full is dropped; its stream ends
with a ``stream.dropped`` event and the client resumes with ``Last-Event-ID``.

The hub's read position in a stream is never a follower's cursor: it starts at
the stream's own last entry (or earlier), so a cursor ahead of the stream affects
only the follower that sent it. Replies are read undecoded and entry data decoded
leniently, so bytes that are not UTF-8 in an entry cannot stop the hub.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, NamedTuple

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool
from redis.client import NEVER_DECODE
from redis.exceptions import RedisError

from gateway.metrics import GatewayMetrics
from shared.events import Resync
from shared.keys import Keys
from shared.mux import MuxRedis
from shared.scripts import LuaScript

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


class _TypeOnly(msgspec.Struct):
    type: str = "unknown"


_type_decoder = msgspec.json.Decoder(_TypeOnly)


_TYPE_FIRST = '{"type":"'


def _entry_type(data: str) -> str:
    # Every writer puts the type first ({"type":"text.delta",...}): read it off without
    # decoding the event; anything else is decoded.
    if data.startswith(_TYPE_FIRST):
        end = data.find('"', 9)
        if end > 9 and "\\" not in data[9:end]:
            return data[9:end]
    try:
        return _type_decoder.decode(data).type
    except msgspec.DecodeError:
        return "unknown"


def _text(value: Any) -> str:
    """A reply value as text; bytes that are not UTF-8 become U+FFFD, never an error."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)


def _to_entry(entry_id: Any, fields: Any) -> StreamEntry:
    if isinstance(fields, list) and len(fields) >= 2 and fields[0] == b"data":
        # What every writer stores, as a raw reply gives it: the "data" field first (the
        # worker's own writes add their write number after it).
        raw = fields[1]
        try:
            data = raw.decode() if isinstance(raw, bytes) else _text(raw)
        except UnicodeDecodeError:
            data = raw.decode("utf-8", "replace")
        ident = entry_id.decode() if isinstance(entry_id, bytes) else _text(entry_id)
        return StreamEntry(ident, _entry_type(data), data)
    if isinstance(fields, dict):
        raw = fields.get(b"data", fields.get("data"))
    else:  # a flat [field, value, ...] list, as a script returns it
        flat = list(fields or ())
        raw = next(
            (flat[i + 1] for i in range(0, len(flat) - 1, 2) if _text(flat[i]) == "data"), None
        )
    data = _text(raw)
    return StreamEntry(_text(entry_id), _entry_type(data), data)


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
    __slots__ = ("cursor", "followers")

    def __init__(self, cursor: str) -> None:
        self.cursor = cursor
        self.followers: set[_Follower] = set()


class SseHub:
    """Fans stream entries out to in-process followers from one reader task."""

    def __init__(
        self,
        redis_url: str,
        client: aioredis.Redis,
        keys: Keys,
        *,
        queue_size: int = 1000,
        block_ms: int = 1000,
        page: int = 500,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self._client = client
        self._page_script = LuaScript(client, "sse_page.lua", read_only=True)
        # The reader's own connection (a blocking XREAD must not hold the shared one),
        # sent raw: the command is packed and the reply parsed in C, whatever the
        # number of streams followed.
        self._reader = MuxRedis(
            BlockingConnectionPool.from_url(redis_url, max_connections=1, socket_connect_timeout=2),
            reply_timeout_s=block_ms / 1000 + 5,
            dedicated=True,
        )
        # The wake-up's own connection: on the shared one it would wait behind every
        # command queued before it (a burst of submits), and new streams with it.
        self._waker = MuxRedis(
            BlockingConnectionPool.from_url(redis_url, max_connections=1, socket_connect_timeout=2),
            dedicated=True,
        )
        self._wake_key = keys.gateway_wake(uuid.uuid4().hex)
        self._wake_cursor = "0-0"
        self._queue_size = queue_size
        self._block_ms = block_ms
        self._page = page
        self._metrics = metrics
        self._streams: dict[str, _Followed] = {}
        self._changed = asyncio.Event()
        self._wakers: set[asyncio.Task[None]] = set()
        self._reading = False
        self._wake_sent = False
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def followed_streams(self) -> int:
        return len(self._streams)

    @property
    def followers(self) -> int:
        return sum(len(s.followers) for s in self._streams.values())

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="turnbus-sse-hub")

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
        if self._metrics is not None:
            self._metrics.followed_streams.set(0)

    def drain_threadsafe(self) -> None:
        """:meth:`drain` from a signal handler or another thread."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.drain)

    async def close(self) -> None:
        self.drain()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(RedisError, OSError):
            await self._client.delete(self._wake_key)
        for task in list(self._wakers):
            task.cancel()
        await self._reader.aclose()
        await self._waker.aclose()

    async def last_id(self, key: str) -> str | None:
        """The id of the stream's last entry (``None``: the stream is empty or gone)."""
        raw = await self._client.execute_command(  # type: ignore[no-untyped-call]
            "XREVRANGE", key, "+", "-", "COUNT", 1, **{NEVER_DECODE: True}
        )
        return _text(raw[0][0]) if raw else None

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
        try:
            if first is not None:
                # A stream nobody else can know yet: follow it at once (the hub reads
                # on from its first entry), then send that entry.
                cursor = start = first.id
                hub_cursor = self._register(follower, cursor)
                registered = True
                if hub_cursor is None:
                    self._wake_soon()
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
                    await self._wake()
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
        state = _Followed(cursor)
        state.followers.add(follower)
        self._streams[follower.key] = state
        self._changed.set()
        if self._metrics is not None:
            self._metrics.followed_streams.set(len(self._streams))
        return None

    def _unregister(self, follower: _Follower) -> None:
        state = self._streams.get(follower.key)
        if state is None:
            return
        state.followers.discard(follower)
        if not state.followers:
            del self._streams[follower.key]
            if self._metrics is not None:
                self._metrics.followed_streams.set(len(self._streams))

    def _wake_soon(self) -> None:
        """:meth:`_wake` without waiting for it (a follower that must not wait)."""
        if self._reading and not self._wake_sent and self._loop is not None:
            task = self._loop.create_task(self._wake())
            self._wakers.add(task)
            task.add_done_callback(self._wakers.discard)

    async def _wake(self) -> None:
        """Make a blocked XREAD return so it is re-issued with the new stream in it."""
        if not self._reading or self._wake_sent:
            return
        self._wake_sent = True
        try:
            async with self._waker.pipeline(transaction=False) as pipe:
                pipe.xadd(self._wake_key, {"w": "1"}, maxlen=1, approximate=False)
                pipe.pexpire(self._wake_key, _WAKE_TTL_MS)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            # The read re-issues within block_ms anyway; the wake only saves latency.
            log.warning("SSE hub wake-up failed: %s", exc)

    def _read_gap(self) -> float:
        """Seconds between the starts of two reads: each read costs Redis and this
        process time for every followed stream, so with many streams the hub reads
        less often and gets more entries per read (at most 10 ms later)."""
        return min(0.01, max(0.001, len(self._streams) * 0.00001))

    async def _run(self) -> None:
        backoff = 0.05
        loop = asyncio.get_running_loop()
        last_read = 0.0
        while True:
            if not self._streams:
                self._changed.clear()
                await self._changed.wait()
                continue
            wait = last_read + self._read_gap() - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue  # streams may have come and gone meanwhile
            last_read = loop.time()
            keys = [*self._streams, self._wake_key]
            cursors = [s.cursor for s in self._streams.values()]
            cursors.append(self._wake_cursor)
            self._reading = True
            self._wake_sent = False
            try:
                # The reply is dispatched as soon as it is read off the socket: the
                # followers' tasks are woken in this pass of the loop, not the next.
                await self._reader.call_into(
                    self._on_read,
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
                self._reading = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            except Exception:
                # Nothing in a reply may end the one reader every follower depends on.
                log.exception("SSE hub read failed unexpectedly, retrying in %.2fs", backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            finally:
                self._reading = False
            backoff = 0.05

    def _on_read(self, reply: Any) -> None:
        self._reading = False
        self._dispatch(reply or [])

    def _dispatch(self, reply: Any) -> None:
        if isinstance(reply, dict):  # RESP3 answers XREAD with a map
            reply = reply.items()
        for raw_key, raw in reply:
            key = _text(raw_key)
            entries = _entries(raw)
            if not entries:
                continue
            if key == self._wake_key:
                self._wake_cursor = entries[-1].id
                continue
            state = self._streams.get(key)
            if state is None:
                continue
            for entry in entries:
                state.cursor = entry.id
                for follower in list(state.followers):
                    if not follower.offer(entry):
                        self._drop(state, follower)

    def _drop(self, state: _Followed, follower: _Follower) -> None:
        follower.drop("slow_consumer")
        state.followers.discard(follower)
        if not state.followers:
            self._streams.pop(follower.key, None)
            if self._metrics is not None:
                self._metrics.followed_streams.set(len(self._streams))
        if self._metrics is not None:
            self._metrics.sse_dropped.inc()
        log.info("SSE follower of %s dropped: its queue is full", follower.key)

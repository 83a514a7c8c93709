"""The SSE hub's blocking readers, when client tracking is off or refused (see
services/gateway/hub.py): a :class:`~turnbus.gateway.hub_follow.StreamReader`.

``XREAD BLOCK`` over every followed stream (plus this process's wake-up stream, so a
newly followed stream joins the read at once). On a Redis Cluster one XREAD may only
name streams of one slot (``CROSSSLOT`` even on one node), so there is one reader per
followed slot, each on a link to the master serving that slot, with a wake-up stream
in that slot; a read that meets ``MOVED`` or a lost master re-reads the slot map and
reads on from the hub's cursor of each stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

from redis.exceptions import RedisError

from turnbus.gateway.hub_entries import entries_of
from turnbus.gateway.hub_follow import Deliver, Followed
from turnbus.gateway.hub_links import LinkPool
from turnbus.shared.backoff import Backoff
from turnbus.shared.cluster import Address
from turnbus.shared.keys import Keys, key_slot
from turnbus.shared.mux import MuxRedis
from turnbus.shared.muxclient import mux_client
from turnbus.shared.scripts import text

__all__ = ["BlockingReaders", "Reader"]

log = logging.getLogger(__name__)

_WAKE_TTL_MS = 60_000


def _hash_tag(key: str) -> str | None:
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1 : end] if end > start + 1 else None


class Reader:
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
        self.streams: dict[str, Followed] = {}
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


class BlockingReaders:
    """The readers, one per group (``None`` on one Redis, a slot on a cluster): each
    started with its group's first stream and, on a cluster, ended with its last."""

    # As a StreamReader: no client tracking.
    tracking = False
    tracked_reads = 0

    def __init__(
        self,
        client: Any,
        keys: Keys,
        links: LinkPool,
        deliver: Deliver,
        *,
        page: int,
        block_ms: int,
    ) -> None:
        self._client = client
        mux = mux_client(client)
        self._cluster = mux if mux.sharded else None
        self._keys = keys
        self._instance = uuid.uuid4().hex
        self._links = links
        self._deliver = deliver
        self._page = page
        self._block_ms = block_ms
        self.readers: dict[int | None, Reader] = {}
        self._wakers: set[asyncio.Task[None]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def blocking_readers(self) -> int:
        return len(self.readers)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def follow(self, key: str, state: Followed) -> None:
        """Have the reader of the stream's group read it (started if need be)."""
        reader = self.reader_of(state.slot, key)
        reader.streams[key] = state
        reader.changed.set()

    def unfollow(self, key: str, state: Followed) -> None:
        reader = self.readers.get(state.slot)
        if reader is None:
            return
        reader.streams.pop(key, None)
        if not reader.streams and reader.group is not None:
            # A cluster's readers are one per followed slot: one that reads nothing ends.
            if self.readers.get(reader.group) is reader:
                del self.readers[reader.group]
            self._links.finish_soon(self._stop(reader))

    def reader_of(self, group: int | None, key: str = "") -> Reader:
        reader = self.readers.get(group)
        if reader is None:
            tag = None if group is None else _hash_tag(key)
            wake_key = self._keys.gateway_wake(self._instance, tag)
            if group is not None and key_slot(wake_key) != group:
                # A key without a hash tag: no other key name is sure to share its
                # slot, so its reader goes without a wake-up (a new stream joins the
                # read when it re-issues, within block_ms).
                wake_key = ""
            reader = self.readers[group] = Reader(group, wake_key)
            assert self.loop is not None
            reader.task = self.loop.create_task(
                self._run(reader), name=f"turnbus-sse-hub:{'all' if group is None else group}"
            )
        return reader

    def clear(self) -> None:
        """Every reader reads nothing (the hub is draining)."""
        for reader in self.readers.values():
            reader.streams.clear()

    def wake_keys(self) -> list[str]:
        """The readers' wake-up streams."""
        return [reader.wake_key for reader in self.readers.values() if reader.wake_key]

    async def close(self) -> None:
        """Take every reader out of use, cancel the wake-ups in flight, let the stops
        already under way finish (a task cancelled before it starts would never close
        its links), then stop the readers and close their links."""
        readers = list(self.readers.values())
        self.readers.clear()
        for task in list(self._wakers):
            task.cancel()
        await self._links.settle()
        for reader in readers:
            await self._stop(reader, reuse=False)

    async def _stop(self, reader: Reader, *, reuse: bool = True) -> None:
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
                await asyncio.shield(self._links.release(link, address) if reuse else link.aclose())

    async def _end_wake(self, reader: Reader) -> None:
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

    def _reader_of_key(self, key: str) -> Reader | None:
        """The reader that reads ``key`` (``None``: no reader does)."""
        reader = self.readers.get(None if self._cluster is None else key_slot(key))
        return reader if reader is not None and key in reader.streams else None

    def wake_soon(self, key: str) -> None:
        """:meth:`wake` without waiting for it (a follower that must not wait)."""
        reader = self._reader_of_key(key)
        if reader is None or not reader.reading or reader.wake_sent or self.loop is None:
            return
        task = self.loop.create_task(self.wake(key))
        self._wakers.add(task)
        task.add_done_callback(self._wakers.discard)

    async def wake(self, key: str) -> None:
        """Make a blocked XREAD return so it is re-issued with the new stream in it."""
        reader = self._reader_of_key(key)
        if reader is None:
            return
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

    def _read_gap(self, reader: Reader) -> float:
        """Seconds between the starts of two reads: each read costs Redis and this
        process time for every followed stream, so with many streams the hub reads
        less often and gets more entries per read (at most 10 ms later)."""
        return min(0.01, max(0.001, len(reader.streams) * 0.00001))

    async def _route(self, reader: Reader) -> None:
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
        reader.link = self._links.take(address)
        reader.waker = self._links.waker(address)

    async def _reroute(self, reader: Reader, exc: Exception) -> None:
        """After a failed read on a cluster: read the slot map again; the next read goes
        to the slot's master now, from the hub's cursors."""
        assert self._cluster is not None
        with contextlib.suppress(RedisError, OSError):
            await self._cluster.refresh()
            masters = await self._cluster.masters()
            self._links.forget_idle({self._cluster.address_of(node) for node in masters})
        if self._cluster.address_for_key(reader.wake_key or next(iter(reader.streams), "")) != (
            reader.address
        ):
            log.info(
                "SSE hub: slot %s moved (%s); reading on from its new master", reader.group, exc
            )
            await reader.close_links()

    async def _run(self, reader: Reader) -> None:
        backoff = Backoff(0.05, 2.0)  # from 50 ms again after a read that worked
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
                delay = next(backoff)
                log.warning("SSE hub read failed, retrying in %.2fs: %s", delay, exc)
                reader.reading = False
                await asyncio.sleep(delay)
                if self._cluster is not None:
                    await self._reroute(reader, exc)
                continue
            except Exception:
                # Nothing in a reply may end the one reader every follower depends on.
                delay = next(backoff)
                log.exception("SSE hub read failed unexpectedly, retrying in %.2fs", delay)
                await asyncio.sleep(delay)
                continue
            finally:
                reader.reading = False
            backoff.reset()

    def _on_read(self, reader: Reader, reply: Any) -> None:
        reader.reading = False
        self._dispatch(reader, reply or [])

    def _dispatch(self, reader: Reader, reply: Any) -> None:
        for raw_key, raw in reply:
            key = text(raw_key)
            entries = entries_of(raw)
            if not entries:
                continue
            if key == reader.wake_key:
                reader.wake_cursor = entries[-1].id
                continue
            state = reader.streams.get(key)
            if state is not None:
                self._deliver(state, entries)

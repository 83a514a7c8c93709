"""The work queue: the consumer group ``workers`` on the shard streams ``tb:{<tag>}:turns:<n>``.

Everything a worker does to the queue itself is here — read, ack, take back its own
pending entries, reclaim a dead consumer's, keep its in-flight entries alive, trim
what every consumer is done with, and forget dead workers — so the consumer only
decides what to do with an entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from turnbus.shared.connect import dedicated_link_of
from turnbus.shared.keys import GROUP, Keys
from turnbus.shared.mux import MuxRedis
from turnbus.shared.muxclient import mux_client
from turnbus.shared.records import now_ms
from turnbus.shared.scripts import LuaScript
from turnbus.shared.scripts import text as _s
from turnbus.shared.settings import Settings
from turnbus.worker.retry import REDIS_ERRORS

__all__ = ["GROUP", "Entry", "WorkQueue", "stream_entries"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One work entry: a turn to run (``fields``: ``user``, ``session``, ``turn``)."""

    stream: str
    id: str
    fields: Mapping[str, Any]

    @property
    def key(self) -> tuple[str, str]:
        return (self.stream, self.id)


def stream_entries(reply: Any) -> list[tuple[str, list[tuple[str | None, Any]]]]:
    """XREADGROUP's reply (a RESP2 list: the clients speak no other) as
    ``[(stream, [(id, fields)])]``."""
    return [
        (_s(stream), [(_s(e[0]) if e[0] is not None else None, e[1]) for e in entries or []])
        for stream, entries in reply or ()
    ]


def _fields(raw: Any) -> dict[str, Any]:
    """An entry's fields (a dict, or RESP2's flat list) by their text names."""
    if isinstance(raw, list):
        return {_s(raw[i]): raw[i + 1] for i in range(0, len(raw) - 1, 2)}
    return {_s(k): v for k, v in dict(raw or {}).items()}


class ReadLink:
    """The work streams' blocking read on one Redis, over a link of its own (made at the
    first read): the pooled client's path (a pooled connection, its retry and metrics
    wrappers, its reply parsing) costs the worker nearly three times the CPU of the
    link's, for a read that comes back for every entry or two at a few thousand entries
    a second."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._link: MuxRedis | None = None

    async def read(self, *command: Any, block_ms: int) -> Any:
        link = self._link
        if link is None:
            link = self._link = dedicated_link_of(self._redis, reply_timeout_s=block_ms / 1000 + 5)
        try:
            return await link.call(*command)
        except redis.exceptions.ResponseError:
            raise
        except BaseException:
            # Cut short (the intake's bound) or lost: as a pooled connection would be,
            # the link is closed, so a read Redis still holds delivers nothing unseen on
            # it; the next read opens another.
            self._link = None
            with contextlib.suppress(*REDIS_ERRORS):
                await link.aclose()
            raise

    async def aclose(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                await link.aclose()


class WorkQueue:
    """One consumer (``name``) of the group on every shard stream."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, settings: Settings, name: str) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.name = name
        self.streams = keys.work_streams(settings.shards)
        self._forget_idle = LuaScript(redis, "consumer_forget.lua")
        self._per_stream = False
        # This worker's tools as the gateway reads them (keys.tools()), written with
        # every heartbeat.
        self.published: bytes | None = None
        # Its tool sources' states (JSON, for ``turnbus status``), read at each heartbeat.
        self.tool_states: Callable[[], str] | None = None
        # The port of its health and metrics server (for ``turnbus status``), if any.
        self.metrics_port: int | None = None
        self._reads: dict[str, asyncio.Future[list[Entry]]] = {}
        # On one Redis the blocking read has a link of its own; a cluster's client
        # routes each read to its stream's master.
        self._link = None if mux_client(redis).sharded else ReadLink(redis)

    async def ensure_groups(self) -> None:
        """The group on every shard stream; and the streams of the names used before the
        work streams had hash tags (``tb:turns:<n>``), when they are still there, are
        read as well until an operator deletes them (docs/operations.md, upgrading)."""
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.exceptions.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        for shard in range(self.settings.shards):
            legacy = self.keys.legacy_work(shard)
            if legacy not in self.streams and _s(await self.redis.type(legacy)) == "stream":
                log.warning(
                    "also reading %s, a work stream under its name before hash tags", legacy
                )
                try:
                    await self.redis.xgroup_create(legacy, GROUP, id="0")
                except redis.exceptions.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
                self.streams.append(legacy)

    async def read(self, count: int, block_ms: int) -> list[Entry]:
        """New entries (``>``), at most ``count``, blocking up to ``block_ms``.

        One XREADGROUP over every stream; on a Redis Cluster, where the shard streams sit
        on different slots (CROSSSLOT), one read per stream instead, each kept running
        across calls so that a quiet stream's block never delays a busy one's entries."""
        if not self._per_stream:
            try:
                return await self._read(self.streams, count, block_ms)
            except redis.exceptions.ResponseError as exc:
                if _gone(exc) and await self._forget_deleted_legacy():
                    return []
                if "CROSSSLOT" not in str(exc) and "same slot" not in str(exc):
                    raise
                self._per_stream = True
                log.info("the work streams are on several slots: one read per stream")
        for stream in self.streams:
            if stream not in self._reads:
                share = max(count // len(self.streams), 1)
                self._reads[stream] = asyncio.ensure_future(self._read([stream], share, block_ms))
        done, _ = await asyncio.wait(self._reads.values(), return_when=asyncio.FIRST_COMPLETED)
        out: list[Entry] = []
        for stream, task in list(self._reads.items()):
            if task in done:
                del self._reads[stream]
                try:
                    out.extend(task.result())
                except redis.exceptions.ResponseError as exc:
                    if _gone(exc) and await self._forget_deleted_legacy():
                        continue
                    raise  # as the single read would
        return out

    async def _forget_deleted_legacy(self) -> bool:
        """Stop reading the old-named streams an operator deleted; ``True`` if any."""
        legacy = {self.keys.legacy_work(n) for n in range(self.settings.shards)}
        gone = [s for s in self.streams if s in legacy and not await self.redis.exists(s)]
        for stream in gone:
            log.info("%s was deleted; no longer read", stream)
            self.streams.remove(stream)
        return bool(gone)

    async def _read(self, streams: list[str], count: int, block_ms: int) -> list[Entry]:
        if self._link is not None:
            reply = await self._link.read(
                "XREADGROUP", "GROUP", GROUP, self.name, "COUNT", count, "BLOCK", block_ms,
                "STREAMS", *streams, *(">" for _ in streams), block_ms=block_ms,
            )  # fmt: skip
        else:
            reply = await self.redis.xreadgroup(
                GROUP, self.name, dict.fromkeys(streams, ">"), count=count, block=block_ms
            )
        return [
            Entry(stream, entry_id, _fields(fields))
            for stream, entries in stream_entries(reply)
            for entry_id, fields in entries
            if entry_id is not None
        ]

    async def own_delivered(self, skip: Container[tuple[str, str]], page: int = 100) -> list[Entry]:
        """Entries delivered to this consumer and not acked, but for those in ``skip``
        (in flight here; looked up as each page arrives): ``XREADGROUP … 0``, page by
        page. After a read whose reply was lost, the entries it delivered are only found
        this way (or by a reclaim, once they have been idle ``claim_idle_ms``)."""
        out: list[Entry] = []
        for stream in list(self.streams):
            after = "0"
            while True:
                try:
                    reply = await self.redis.xreadgroup(
                        GROUP, self.name, {stream: after}, count=page
                    )
                except redis.exceptions.ResponseError as exc:
                    if _gone(exc) and await self._forget_deleted_legacy():
                        break
                    raise
                entries = [e for _, items in stream_entries(reply) for e in items]
                for entry_id, fields in entries:
                    if entry_id is None:
                        continue
                    after = entry_id
                    if (stream, entry_id) not in skip:
                        # A deleted entry comes without fields: its handler acks it.
                        out.append(Entry(stream, entry_id, _fields(fields)))
                if len(entries) < page:
                    break
        return out

    async def stop_reading(self) -> None:
        """Stop the per-stream reads still blocked (an entry they were given stays pending
        under this consumer: taken back at its next start, or reclaimed), and close the
        reads' link."""
        reads, self._reads = list(self._reads.values()), {}
        for task in reads:
            task.cancel()
        if reads:
            await asyncio.wait(reads)
        if self._link is not None:
            await self._link.aclose()

    async def ack(self, stream: str, entry_id: str) -> None:
        """The one XACK of the worker: a work entry its runner is done with
        (:class:`~turnbus.worker.entries.EntryRunner`), or one deleted from its stream."""
        await self.redis.xack(stream, GROUP, entry_id)

    async def own_pending(self, limit: int = 10_000) -> list[Entry]:
        """Entries this consumer name was given before a restart (taken back first).
        Entries deleted from the stream meanwhile are acked."""
        out: list[Entry] = []
        for stream in self.streams:
            pending = await self.redis.xpending_range(
                stream, GROUP, min="-", max="+", count=limit, consumername=self.name
            )
            ids: list[Any] = [_s(item["message_id"]) for item in pending]
            if not ids:
                continue
            claimed: Any = await self.redis.xclaim(stream, GROUP, self.name, 0, ids)
            found = set()
            for entry_id, fields in claimed or []:
                if entry_id is None or fields is None:
                    continue
                found.add(_s(entry_id))
                out.append(Entry(stream, _s(entry_id), _fields(fields)))
            for entry_id in ids:
                if entry_id not in found:
                    await self.ack(stream, entry_id)
        return out

    async def reclaim(
        self, stream: str, count: int, skip: Iterable[tuple[str, str]]
    ) -> list[Entry]:
        """Entries idle longer than ``claim_idle_ms`` (a dead consumer's), taken over.

        Redis 7 answers XAUTOCLAIM with ``[cursor, entries, deleted ids]`` and drops
        deleted entries from the pending list itself; 6.2 answers ``[cursor, entries]``
        with a deleted entry as ``(None, None)``, left pending: those are acked here.
        """
        reply = await self.redis.xautoclaim(
            stream, GROUP, self.name, self.settings.claim_idle_ms, "0-0", count=count
        )
        entries = reply[1] if len(reply) > 1 else []
        out: list[Entry] = []
        saw_deleted = False
        for entry_id, fields in entries:
            if entry_id is None or fields is None:
                saw_deleted = True
                continue
            out.append(Entry(stream, _s(entry_id), _fields(fields)))
        if saw_deleted:
            await self._ack_deleted(stream, set(skip))
        return out

    async def _ack_deleted(self, stream: str, skip: set[tuple[str, str]]) -> None:
        pending = await self.redis.xpending_range(
            stream, GROUP, min="-", max="+", count=1000, consumername=self.name
        )
        for item in pending:
            entry_id = _s(item["message_id"])
            if (stream, entry_id) in skip:
                continue
            if not await self.redis.xrange(stream, entry_id, entry_id):
                await self.ack(stream, entry_id)

    async def keepalive(self, in_flight: Iterable[tuple[str, str]]) -> None:
        """Reset the idle time of every in-flight entry (XCLAIM JUSTID, not a delivery)
        and record this worker's heartbeat (and its tools, :attr:`published`, its tool
        sources' states, :attr:`tool_states`, and its :attr:`metrics_port`), in one
        round trip: all come back by themselves if Redis lost them."""
        by_stream: dict[str, list[Any]] = {}
        for stream, entry_id in in_flight:
            by_stream.setdefault(stream, []).append(entry_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream, ids in by_stream.items():
                pipe.xclaim(stream, GROUP, self.name, 0, ids, justid=True)
            pipe.hset(self.keys.workers(), self.name, str(now_ms()))
            if self.published is not None:
                pipe.hset(self.keys.tools(), self.name, self.published)
            if self.tool_states is not None:
                pipe.hset(self.keys.tool_sources(), self.name, self.tool_states())
            if self.metrics_port is not None:
                pipe.hset(self.keys.metrics_ports(), self.name, str(self.metrics_port))
            await pipe.execute()

    async def trim(self, stream: str) -> None:
        """Drop entries every consumer is done with, so the work stream stays small.

        Everything below the oldest pending entry (or, with none pending, below the
        last delivered one) has been acked; newer entries are never touched.
        """
        summary = await self.redis.xpending(stream, GROUP)
        if int(summary["pending"]):
            floor = _s(summary["min"])
        else:
            groups = await self.redis.xinfo_groups(stream)
            group = next((g for g in groups if _s(g.get("name")) == GROUP), None)
            if group is None:
                return
            floor = _s(group.get("last-delivered-id"))
        if floor and floor != "0-0":
            await self.redis.xtrim(stream, minid=floor, approximate=False)

    async def forget_dead(self, dead_after_ms: int) -> list[str]:
        """Forget the workers whose own heartbeat (``tb:workers``) is older than
        ``dead_after_ms``: their record, and their consumer in every group when it owes
        nothing (DELCONSUMER would drop its pending entries; those are reclaimed first).

        Never by XINFO's idle time: on Redis 7.0 it grows while a live consumer is
        blocked in XREADGROUP. A consumer with no heartbeat record at all is forgotten
        only once it owes nothing and has been idle that long (a worker always writes
        its heartbeat before it reads).
        """
        cutoff = now_ms() - dead_after_ms
        seen = {
            _s(name): _int(at)
            for name, at in (await self.redis.hgetall(self.keys.workers())).items()
        }
        stale = [name for name, at in seen.items() if at < cutoff and name != self.name]
        forgotten: list[str] = []
        for stream in self.streams:
            for consumer in await self.redis.xinfo_consumers(stream, GROUP):
                name = _s(consumer.get("name"))
                if name == self.name or _int(consumer.get("pending")):
                    continue
                idle = _int(consumer.get("idle"))
                dead = name in stale if name in seen else idle > dead_after_ms
                # Checked again and deleted in one call: an entry delivered to it after
                # the look above must not be dropped from the pending list.
                if dead and int(await self._forget_idle([stream], [GROUP, name])) >= 0:
                    forgotten.append(name)
                    log.info("forgot consumer %s of %s", name, stream)
        if stale:
            await self.redis.hdel(self.keys.workers(), *stale)
            await self.redis.hdel(self.keys.tools(), *stale)  # the tools they published
            await self.redis.hdel(self.keys.tool_sources(), *stale)
            await self.redis.hdel(self.keys.metrics_ports(), *stale)
        return forgotten

    async def leave(self) -> None:
        """This worker stops: its heartbeat record and what it published with it go."""
        await self.redis.hdel(self.keys.workers(), self.name)
        await self.redis.hdel(self.keys.tools(), self.name)
        await self.redis.hdel(self.keys.tool_sources(), self.name)
        await self.redis.hdel(self.keys.metrics_ports(), self.name)


def _gone(exc: Exception) -> bool:
    """The error of a read of a stream that was deleted (while a read blocked on it)."""
    return "NOGROUP" in str(exc) or "no longer exists" in str(exc)


def _int(value: Any) -> int:
    try:
        return int(_s(value))
    except ValueError:
        return 0

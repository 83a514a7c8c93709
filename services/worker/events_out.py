"""One worker process's event writes to turn streams, grouped into shared pipelines.

Hundreds of turns stream text at once, each flushing a ``text.delta`` every 50 ms: one
round trip per flush is most of a worker's CPU (a socket write and a reply read per
XADD). :class:`EventWriter` queues the writes that are ready at the same time, from
every turn of the process, and sends them as one pipeline; while a pipeline is in
flight the next writes queue behind it and go out together when it returns.

Each caller still waits until its own events are stored (or the pipeline failed, when
it gets the error and its retry decides), so a turn's events keep their order: a turn
writes its next events only after its previous write returned.

A failed pipeline may have run: its reply can be lost with the connection. So that a
retry never writes an event twice, every entry carries, next to its ``data``, the
attempt's write number (``w``: ``<attempt tag>:<n>``), and a retry first reads the tail
of the stream (:meth:`EventWriter.landed`) and writes only what is not there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import redis.asyncio as aioredis

from turnbus.shared.scripts import text as _s

__all__ = ["WRITE_FIELD", "EventWriter"]

# At most this many XADDs in one pipeline (a bigger batch is sent as several).
_MAX_BATCH = 1024
# The entry field that numbers an attempt's writes: ``<attempt tag>:<n>``.
WRITE_FIELD = "w"
# How far past a lost write's own entries its retry looks for them: other writers
# (a cancel request) may have appended since.
_LANDED_SLACK = 32

_Item = tuple[str, Sequence[bytes | str], str, int, asyncio.Future[None]]


class EventWriter:
    """XADDs to turn streams, batched across the turns of one process."""

    def __init__(self, redis: aioredis.Redis, maxlen: int) -> None:
        self._redis = redis
        self._maxlen = maxlen
        self._queue: list[_Item] = []
        self._sender: asyncio.Task[None] | None = None

    async def append(self, key: str, data: Sequence[bytes | str], *, tag: str, first: int) -> None:
        """Append the encoded events ``data`` to the stream ``key``, in order, numbered
        ``first``, ``first + 1``, … among the writes of the attempt ``tag``."""
        if not data:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._queue.append((key, data, tag, first, done))
        if self._sender is None:
            self._sender = loop.create_task(self._send(), name="worker:event-writer")
        await done

    async def _send(self) -> None:
        try:
            while self._queue:
                # One pass of the loop: the writes made ready by the same wake-up join.
                await asyncio.sleep(0)
                await self._write(self._take(_MAX_BATCH))
        finally:
            self._sender = None
            # Cancelled (the loop is closing) with writes queued: they must not hang.
            queued, self._queue = self._queue, []
            for *_, done in queued:
                done.cancel()

    async def landed(self, key: str, tag: str, first: int, count: int) -> int:
        """How many of the writes ``first`` … ``first + count - 1`` of the attempt ``tag``
        the stream holds: a write whose reply was lost may have run. They land in
        order (one pipeline, in order), so it is always the first ones."""
        entries = await self._redis.xrevrange(key, "+", "-", count=count + _LANDED_SLACK)
        mine = tag + ":"
        for _entry_id, fields in entries or []:
            number = _s((fields or {}).get(WRITE_FIELD))
            if number.startswith(mine):
                return min(max(int(number[len(mine) :]) - first + 1, 0), count)
        return 0

    def _take(self, limit: int) -> list[_Item]:
        taken = 0
        size = 0
        for _key, data, *_ in self._queue:
            if taken and size + len(data) > limit:
                break
            taken += 1
            size += len(data)
        batch, self._queue = self._queue[:taken], self._queue[taken:]
        return batch

    async def _write(self, batch: list[_Item]) -> None:
        live = [item for item in batch if not item[-1].done()]
        if not live:
            return
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for key, data, tag, first, _done in live:
                    for n, item in enumerate(data, first):
                        pipe.xadd(
                            key,
                            {"data": item, WRITE_FIELD: f"{tag}:{n}"},
                            maxlen=self._maxlen,
                            approximate=True,
                        )
                await pipe.execute()
        except asyncio.CancelledError:
            for *_, done in live:
                if not done.done():
                    done.cancel()
            raise
        except Exception as exc:  # each caller's retry decides what a failure means
            for *_, done in live:
                if not done.done():
                    done.set_exception(exc)
            return
        for *_, done in live:
            if not done.done():
                done.set_result(None)

"""One worker process's event writes to turn streams, grouped into shared pipelines.

Hundreds of turns stream text at once, each flushing a ``text.delta`` every 50 ms: one
round trip per flush is most of a worker's CPU (a socket write and a reply read per
XADD). :class:`EventWriter` queues the writes that are ready at the same time, from
every turn of the process, and sends them as one pipeline; while a pipeline is in
flight the next writes queue behind it and go out together when it returns.

Each caller still waits until its own events are stored (or the pipeline failed, when
it gets the error and its retry decides), so a turn's events keep their order: a turn
writes its next events only after its previous write returned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import redis.asyncio as aioredis

__all__ = ["EventWriter"]

# At most this many XADDs in one pipeline (a bigger batch is sent as several).
_MAX_BATCH = 1024


class EventWriter:
    """XADDs to turn streams, batched across the turns of one process."""

    def __init__(self, redis: aioredis.Redis, maxlen: int) -> None:
        self._redis = redis
        self._maxlen = maxlen
        self._queue: list[tuple[str, Sequence[bytes | str], asyncio.Future[None]]] = []
        self._sender: asyncio.Task[None] | None = None

    async def append(self, key: str, data: Sequence[bytes | str]) -> None:
        """Append the encoded events ``data`` to the stream ``key``, in order."""
        if not data:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._queue.append((key, data, done))
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
            for _key, _data, done in queued:
                done.cancel()

    def _take(self, limit: int) -> list[tuple[str, Sequence[bytes | str], asyncio.Future[None]]]:
        taken = 0
        size = 0
        for _key, data, _done in self._queue:
            if taken and size + len(data) > limit:
                break
            taken += 1
            size += len(data)
        batch, self._queue = self._queue[:taken], self._queue[taken:]
        return batch

    async def _write(
        self, batch: list[tuple[str, Sequence[bytes | str], asyncio.Future[None]]]
    ) -> None:
        live = [item for item in batch if not item[2].done()]
        if not live:
            return
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for key, data, _done in live:
                    for item in data:
                        pipe.xadd(key, {"data": item}, maxlen=self._maxlen, approximate=True)
                await pipe.execute()
        except asyncio.CancelledError:
            for _key, _data, done in live:
                if not done.done():
                    done.cancel()
            raise
        except Exception as exc:  # each caller's retry decides what a failure means
            for _key, _data, done in live:
                if not done.done():
                    done.set_exception(exc)
            return
        for _key, _data, done in live:
            if not done.done():
                done.set_result(None)

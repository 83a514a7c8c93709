"""Turns on their way to a worker: the work entry on the shard's stream, and the
outbox sweeper that writes it again for a turn accepted without one.

A submit (and an answer to a paused turn) is two calls: the session's script, which
marks the turn in its slot's outbox, then the work entry, which a Redis Cluster keeps on
another slot. The mark stays until a worker starts the turn; :meth:`TurnQueue.sweep_outboxes`
enqueues again any turn accepted more than ``outbox_grace_ms`` ago that no worker has
seen (its second call failed).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis

from turnbus.shared.contracts import WorkEntry
from turnbus.shared.keys import SLOTS, InvalidId, Keys
from turnbus.shared.records import TurnRecord, now_ms
from turnbus.shared.scripts import LuaScript
from turnbus.shared.scripts import text as _s
from turnbus.shared.settings import Settings
from turnbus.shared.turn_scripts import TurnScripts

__all__ = ["TurnQueue", "outboxes_due"]

log = logging.getLogger(__name__)

# A replayed submit looks for its turn's work entry this far either side of the turn's
# acceptance (the gateway's clock against Redis's), a page at a time.
_ENTRY_WINDOW_MS = 10_000
_ENTRY_PAGE = 500
# Marks looked at per outbox per sweeper call, and outboxes counted per round trip.
_SWEEP_MARKS = 100
_SWEEP_BATCH = 2048


async def outboxes_due(
    redis: aioredis.Redis, outboxes: list[str], cutoff: int, *, cluster: bool
) -> list[str]:
    """The outboxes (sorted sets, one per slot) holding a mark scored ``cutoff`` or less."""
    due: list[str] = []
    # One Redis holds every slot's outbox, so one script looks at a whole batch (mostly
    # no mark at all: one EXISTS inside): a command, not 2,048. A cluster refuses a
    # command over several slots; there each outbox is counted on its own.
    look = None if cluster else LuaScript(redis, "outboxes_due.lua", read_only=True)
    for i in range(0, len(outboxes), _SWEEP_BATCH):
        batch = outboxes[i : i + _SWEEP_BATCH]
        if look is not None:
            due.extend(_s(key) for key in await look(batch, [cutoff]))
            continue
        async with redis.pipeline(transaction=False) as pipe:
            for key in batch:
                pipe.zcount(key, "-inf", cutoff)
            counts = await pipe.execute()
        due.extend(key for key, count in zip(batch, counts, strict=True) if int(count))
    return due


class TurnQueue:
    """The work entries of one deployment's turns, and the outbox sweep."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, settings: Settings) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self._scripts = TurnScripts(keys, settings)
        self._outbox_due = LuaScript(redis, "outbox_due.lua")

    async def _has_work_entry(self, record: TurnRecord) -> bool:
        """Whether the work stream holds an entry of this queued turn: one written by its
        submit lies within a few seconds of its acceptance (entry ids are Redis's clock
        in ms; an unstarted turn's entry is never trimmed). Read only for a replay; a
        clock far off makes it answer ``False``, and a second entry is harmless (the
        turn's start runs it once)."""
        stream = self.keys.work(
            Keys.shard_for(record.userId, record.sessionId, self.settings.shards)
        )
        after = f"{max(record.createdAt - _ENTRY_WINDOW_MS, 0)}-0"
        until = str(record.createdAt + _ENTRY_WINDOW_MS)
        while True:
            reply = await self.redis.xrange(stream, after, until, count=_ENTRY_PAGE)
            page: list[Any] = list(reply or [])
            for _entry_id, fields in page:
                try:
                    if WorkEntry.decode(fields or {}).turn == record.turnId:
                        return True
                except InvalidId:
                    continue  # not a turn's entry: no worker runs it either
            if len(page) < _ENTRY_PAGE:
                return False
            after = "(" + _s(page[-1][0])

    async def ensure_work_entry(self, record: TurnRecord) -> None:
        """A turn no worker has started gets a work entry unless it has one."""
        if record.status == "queued" and not await self._has_work_entry(record):
            await self.write_work_entry(record.userId, record.sessionId, record.turnId)

    async def write_work_entry(
        self,
        user: str,
        session: str,
        turn_id: str,
        trace: Mapping[str, str] | None = None,
        *,
        interrupts: str | None = None,
    ) -> None:
        """The submit's second call. A failure leaves the turn to the outbox sweeper:
        its mark stays until a worker starts it."""
        try:
            await self.enqueue(user, session, turn_id, trace, interrupts=interrupts)
        except Exception:
            log.warning("turn %s accepted, its work entry not written", turn_id, exc_info=True)

    async def enqueue(
        self,
        user: str,
        session: str,
        turn_id: str,
        trace: Mapping[str, str] | None = None,
        *,
        interrupts: str | None = None,
    ) -> str:
        """Append the turn's work entry to its shard's stream (the submit's second call).
        ``trace``: a trace context (``traceparent``, ``tracestate``), stored as fields of
        the entry beside the ids, so the worker's turn span joins the submit's trace.
        ``interrupts``: the turn this one interrupted (its worker then looks for the
        session's turn to end without backing off)."""
        shard = Keys.shard_for(user, session, self.settings.shards)
        trace = trace or {}
        entry = WorkEntry(
            user=user,
            session=session,
            turn=turn_id,
            interrupts=interrupts or None,
            traceparent=trace.get("traceparent"),
            tracestate=trace.get("tracestate"),
        )
        entry_id = await self.redis.xadd(self.keys.work(shard), entry.fields())  # type: ignore[arg-type]
        return _s(entry_id)

    async def sweep_outboxes(self, slots: range = range(SLOTS)) -> list[str]:
        """Enqueue again every turn of these slots' outboxes accepted more than
        ``outbox_grace_ms`` ago that no worker has started; returns their ids.

        A turn enqueued twice still runs once: its start takes the session lease and
        refuses a turn that is not queued or resumable."""
        now = now_ms()
        cutoff = now - self.settings.outbox_grace_ms
        outboxes = [self.keys.slot_outbox(slot) for slot in slots]
        due = await outboxes_due(self.redis, outboxes, cutoff, cluster=self.settings.redis_cluster)
        enqueued: list[str] = []
        for key in due:
            call = self._scripts.outbox_due(key, now=now, marks=_SWEEP_MARKS)
            for member in await self._outbox_due(*call):
                user, session, turn_id = _s(member).split(":")
                await self.enqueue(user, session, turn_id)
                log.warning("turn %s had no work entry after the grace period; enqueued", turn_id)
                enqueued.append(turn_id)
        return enqueued

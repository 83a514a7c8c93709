"""One work entry's whole life (:class:`EntryRunner`): its ids checked, its turn's
attempt, and the entry's one ack.

The entry names a turn; the runner builds the turn's session lease and runs one
:meth:`TurnEngine.attempt`, waiting in the session's wait list (without a run slot)
while another turn of the session runs. The attempt's result says what becomes of the
entry (:attr:`AttemptResult.entry`): acked through :class:`WorkQueue` (a turn that
ended, paused, had already ended or is gone; a malformed entry), or left pending. No
other code acks a work entry. Cancel requests for running turns arrive on one pub/sub
subscription per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from turnbus.shared import tracing
from turnbus.shared.contracts import WorkEntry
from turnbus.shared.keys import InvalidId, Keys
from turnbus.shared.muxclient import mux_client
from turnbus.shared.redispy import link_settings
from turnbus.shared.scripts import text as _s
from turnbus.shared.settings import Settings
from turnbus.worker.cancellation import stop_task
from turnbus.worker.health import WorkerMetrics
from turnbus.worker.interrupts import CancelSignal, Signal
from turnbus.worker.lease import SessionLease, new_lease_token
from turnbus.worker.retry import REDIS_ERRORS, REDIS_UNAVAILABLE
from turnbus.worker.slots import SessionWaits
from turnbus.worker.turn import TurnEngine
from turnbus.worker.workqueue import Entry, WorkQueue

__all__ = ["EntryRunner"]

log = logging.getLogger(__name__)

# A lost cancel subscription is tried again this often.
_RESUBSCRIBE_S = 0.5


def _node_of(pubsub: PubSub) -> str:
    """``host:port`` of the node a pub/sub connection is (or will be) on."""
    return link_settings(pubsub.connection_pool).where


class EntryRunner:
    """Runs work entries' turns on one engine; :meth:`run` is one entry's task."""

    def __init__(
        self,
        engine: TurnEngine,
        queue: WorkQueue,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        *,
        name: str,
        waits: SessionWaits,
        metrics: WorkerMetrics,
        abort: Signal,
    ) -> None:
        self.engine = engine
        self.queue = queue
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.name = name
        self.metrics = metrics
        self._waits = waits
        self._abort = abort
        self._cancels: dict[str, CancelSignal] = {}
        self._records: dict[str, str] = {}  # a running turn's record key
        self.turns_finished = 0

    async def run(self, entry: Entry) -> bool:
        """Run the entry's turn. ``True``: the entry is left pending because Redis was
        unreachable, and the next read should take this consumer's own entries back."""
        try:
            return await self._attempt(entry)
        except asyncio.CancelledError:
            raise
        except REDIS_ERRORS as exc:
            # Left pending; the read loop takes it back once Redis answers again.
            log.warning(
                "turn %s: entry %s left pending after a Redis error (%s); taken back once "
                "Redis answers",
                _s(entry.fields.get("turn")),
                entry.id,
                exc,
            )
            return True
        except Exception:
            log.exception(
                "turn %s: entry %s left pending after an unexpected error",
                _s(entry.fields.get("turn")),
                entry.id,
            )
            return False

    async def _attempt(self, entry: Entry) -> bool:
        try:
            work = WorkEntry.decode(entry.fields)
        except InvalidId:
            log.warning("dropping malformed work entry %s: %r", entry.id, dict(entry.fields))
            return await self._ack(entry, None)
        user, session, turn_id = work.user, work.session, work.turn
        lease = SessionLease(
            self.redis,
            self.keys,
            user=user,
            session=session,
            turn_id=turn_id,
            token=new_lease_token(self.name, turn_id),
            lease_ms=self.settings.lease_ms,
            heartbeat_ms=self.settings.heartbeat_ms,
        )
        tag = self.keys.session_tag(user, session)
        cancel = self._cancels.setdefault(turn_id, CancelSignal())
        self._records[turn_id] = self.keys.turn(user, session, turn_id)
        try:
            result = await self.engine.attempt(
                user,
                session,
                turn_id,
                lease=lease,
                # A turn that interrupted the running one looks for its end without
                # backing off: it ends at once.
                wait=self._waits.waiter(tag, turn_id, steady=work.interrupts is not None),
                cancel=cancel,
                stop=self._abort,
                trace=work.trace() if tracing.enabled() else None,
            )
        finally:
            self._cancels.pop(turn_id, None)
            self._records.pop(turn_id, None)
            self._waits.leave(tag, turn_id)
        if result.entry == "done":
            reread = await self._ack(entry, turn_id)
            if result.kind == "ended":
                self.turns_finished += 1
                self.metrics.turns.labels(result.status or "failed").inc()
            elif result.kind == "gone":
                await self.engine.sweep_deleted(user, session, turn_id)
            return reread
        if result.kind == "abandoned":
            self.metrics.abandoned.inc()
            log.warning("turn %s abandoned (%s); left pending", turn_id, result.reason)
        # ``retry``: Redis was gone longer than the in-turn retries; the next read takes
        # the entry back as soon as Redis answers, not after claim_idle_ms.
        return result.entry == "retry"

    async def _ack(self, entry: Entry, turn_id: str | None) -> bool:
        """The entry's one ack (a call of its own: on a Redis Cluster the work stream is
        on another slot than the session), once its turn is done with it. Lost, the
        entry is delivered again and dropped (its start answers that the turn ended);
        ``True`` then: this worker takes its own entries back once Redis answers."""
        try:
            await asyncio.shield(self.queue.ack(entry.stream, entry.id))
        except REDIS_UNAVAILABLE as exc:
            log.warning(
                "turn %s: ack of entry %s failed (%s); it will be delivered again and dropped",
                turn_id,
                entry.id,
                exc,
            )
            return True
        return False

    async def listen_cancels(self) -> None:
        """One pub/sub connection per process: cancel requests for running turns.

        Pub/sub keeps nothing for a subscriber that is away: once (re)subscribed, the
        records of the turns running here are read for a cancel sent meanwhile (beside
        the listening, so a slow read holds no message back). A lost subscription is
        logged once, with its node, and once when it is back; on a cluster each new try
        subscribes on the next master."""
        loop = asyncio.get_running_loop()
        lost = 0  # subscriptions lost since the last one that held
        lost_at = 0.0
        while True:
            pubsub = mux_client(self.redis).pubsub(lost, ignore_subscribe_messages=True)
            node = _node_of(pubsub)
            missed: asyncio.Task[None] | None = None
            try:
                await pubsub.subscribe(self.keys.cancel_channel())
                if lost:
                    log.info(
                        "cancel subscription back on %s after %.1f s", node, loop.time() - lost_at
                    )
                    lost = 0
                missed = loop.create_task(self._cancels_sent_meanwhile(), name="worker:missed")
                async for message in pubsub.listen():
                    self._on_cancel_message(message.get("data"))
            except Exception as exc:  # a background loop must outlive any one failure
                if not lost:
                    lost_at = loop.time()
                    log.warning(
                        "cancel subscription on %s lost (%s: %s); resubscribing every %.1f s",
                        node,
                        type(exc).__name__,
                        exc,
                        _RESUBSCRIBE_S,
                        exc_info=not isinstance(exc, REDIS_ERRORS),
                    )
                else:
                    log.debug("cancel subscription on %s: still failing (%s)", node, exc)
                lost += 1
                await asyncio.sleep(_RESUBSCRIBE_S)
            finally:
                if missed is not None:
                    await stop_task(missed)
                with contextlib.suppress(*REDIS_ERRORS):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # untyped before redis-py 8.2

    async def _cancels_sent_meanwhile(self) -> None:
        """Signal every turn running here whose record holds a cancel request (one sent
        while no subscription heard it); tried again until it succeeds, the first
        failure logged."""
        failed = False
        while True:
            running = list(self._cancels.items())
            if not running:
                return
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for turn_id, _signal in running:
                        pipe.hmget(self._records[turn_id], "cancelRequested", "by")
                    flags = await pipe.execute()
            except Exception as exc:  # a background loop must outlive any one failure
                if not failed:
                    log.warning(
                        "could not read running turns for missed cancels (%s: %s); retrying "
                        "every %.1f s",
                        type(exc).__name__,
                        exc,
                        _RESUBSCRIBE_S,
                        exc_info=not isinstance(exc, REDIS_ERRORS),
                    )
                    failed = True
                await asyncio.sleep(_RESUBSCRIBE_S)
                continue
            for (turn_id, signal), (flag, by) in zip(running, flags, strict=True):
                if flag is not None and _s(flag) == "1" and not signal.is_set():
                    log.info("turn %s: cancelled (requested while nothing listened)", turn_id)
                    signal.interrupt(_s(by) if by is not None else None)
            return

    def _on_cancel_message(self, data: object) -> None:
        """A cancel for a turn running here (``turn``), or word that a session's paused
        turn was cancelled or answered while turns queue behind it: the session's
        waiters here look now (their pace behind a paused turn is seconds)."""
        try:
            payload = json.loads(_s(data))
        except (ValueError, TypeError):
            return
        if not isinstance(payload, dict):
            return
        event = self._cancels.get(payload.get("turn"))  # type: ignore[arg-type]
        if event is not None:
            by = payload.get("by")
            event.interrupt(by if isinstance(by, str) else None)
        user, session = payload.get("user"), payload.get("session")
        if isinstance(user, str) and isinstance(session, str):
            with contextlib.suppress(ValueError):
                self._waits.wake(self.keys.session_tag(user, session))

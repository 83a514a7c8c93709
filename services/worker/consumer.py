"""The worker process: reads turn requests from the work streams and runs them.

One :class:`Worker` is one consumer (a name unique per process) of the group
``workers`` on every shard stream. On start it takes back its own pending entries,
then reads new ones; a background loop reclaims entries idle longer than
``claim_idle_ms`` from dead consumers (XAUTOCLAIM). Each entry is a task: it waits —
without holding a run slot — until its turn is the oldest active one of its session
and it holds the session lease, then runs under a semaphore of ``concurrency`` slots.
The entry is XACKed only after the terminal event and the final status are written.
While an entry is in flight its idle time is reset every heartbeat (XCLAIM JUSTID, which
does not count as a delivery), so a long or queued turn is never reclaimed from a live
worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from shared.envelope import EnvelopeStore
from shared.keys import InvalidId, Keys, validate_id
from shared.scripts import text as _s
from shared.settings import Settings
from shared.turns import TurnNotFound, TurnRecord, TurnStore, now_ms
from worker.health import HealthServer, WorkerMetrics
from worker.lease import SessionLease, new_lease_token
from worker.models.base import ModelClient, UsageCounts
from worker.pressure import LoopLag, MeteredPool, worker_redis
from worker.turn import TurnEngine, TurnOutcome, stop_task

__all__ = ["GROUP", "Worker", "default_worker_name", "run_worker"]

log = logging.getLogger(__name__)

GROUP = "workers"
_READ_BLOCK_MS = 250
_WAIT_POLL_S = 0.05
_WAIT_POLL_MAX_S = 0.4
# A waiting entry that is not its session's oldest here re-checks this often (a safety
# net: it is normally woken when its session's turn ends or a poll finds it at the head).
_WAIT_IDLE_S = 2.0
_REDIS_ERRORS = (redis.exceptions.RedisError, OSError)


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


def _int(value: Any) -> int:
    try:
        return int(_s(value))
    except ValueError:
        return 0


class Worker:
    """A turn worker. ``await run()`` until :meth:`request_stop`; then ``await aclose()``."""

    def __init__(
        self,
        settings: Settings,
        *,
        name: str | None = None,
        concurrency: int | None = None,
        model: ModelClient | None = None,
        redis: aioredis.Redis | None = None,
    ) -> None:
        self.settings = settings
        self.name = name or default_worker_name()
        self.concurrency = concurrency or settings.worker_concurrency
        self.keys = Keys(settings.prefix)
        self.streams = self.keys.work_streams(settings.shards)
        self._model = model
        self._owns_model = model is None
        self._redis = redis
        self._owns_redis = redis is None
        # Entries read but not finished (running, or waiting for their session). Only
        # the ones that run (or are about to try) hold run capacity: ``_busy`` counts them.
        self._in_flight: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._busy = 0
        self._cancels: dict[str, asyncio.Event] = {}
        # Per session (its tag): the turn ids of this process's entries waiting for that
        # session's running turn, each with the event that wakes it.
        self._waiting: dict[str, dict[str, asyncio.Event]] = {}
        self.lag = LoopLag()
        self._settling: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self._abort = asyncio.Event()
        self._room = asyncio.Event()
        self._engine: TurnEngine | None = None
        self.metrics = WorkerMetrics()
        self.health: HealthServer | None = None
        self.turns_finished = 0
        self.running = False
        # A consumer idle this long, owing nothing, is a dead worker's: forgotten.
        self.dead_after_ms = max(settings.claim_idle_ms * 10, 60_000)

    # -- public surface ------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop reading; in-flight turns get ``shutdown_grace_ms`` to finish (SIGTERM)."""
        self._stop.set()
        self._room.set()
        for waiters in self._waiting.values():
            for event in waiters.values():
                event.set()

    @property
    def waiting_count(self) -> int:
        """Entries waiting behind their session's running turn (holding no capacity)."""
        return sum(len(w) for w in self._waiting.values())

    @property
    def saturated(self) -> bool:
        """The event loop runs late or calls wait for Redis connections: take no new work."""
        pool = self.redis.connection_pool
        pool_wait = pool.wait_ms if isinstance(pool, MeteredPool) else 0.0
        return (
            self.lag.lag_ms > self.settings.worker_max_loop_lag_ms
            or pool_wait > self.settings.worker_max_pool_wait_ms
        )

    @property
    def in_flight_count(self) -> int:
        """Entries read and not yet finished (running or waiting for their session)."""
        return len(self._in_flight)

    @property
    def redis(self) -> aioredis.Redis:
        if self._redis is None:
            self._redis = worker_redis(self.settings, self.concurrency)
        return self._redis

    @property
    def model(self) -> ModelClient:
        if self._model is None:
            from worker.models import make_model

            self._model = make_model(self.settings)
        return self._model

    async def aclose(self) -> None:
        """Close what this worker opened (the Redis client and model it built itself)."""
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)
        if self._owns_model and self._model is not None:
            await self._model.aclose()
            self._model = None
        if self._owns_redis and self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def run(self) -> None:
        """Consume until :meth:`request_stop`, then drain within the grace period."""
        redis = self.redis
        store = EnvelopeStore(redis, self.keys, log_maxlen=self.settings.log_maxlen)
        self._engine = TurnEngine(
            redis,
            self.keys,
            self.settings,
            self.model,
            worker_name=self.name,
            store=store,
            turns=TurnStore(redis, self.keys, self.settings),
            metrics=self.metrics,
        )
        await self._ensure_groups()
        if self.settings.metrics_port:
            self.health = HealthServer(
                self.metrics,
                lambda: self.running and not self._stop.is_set(),
                name=self.name,
                port=self.settings.metrics_port,
            )
            await self.health.start()
        self.running = True
        self.lag.start()
        log.info(
            "worker %s consuming %s (concurrency %d)",
            self.name,
            ", ".join(self.streams),
            self.concurrency,
        )
        background = [
            asyncio.create_task(self._listen_cancels(), name="worker:cancels"),
            asyncio.create_task(self._keepalive(), name="worker:keepalive"),
            asyncio.create_task(self._reclaim_loop(), name="worker:reclaim"),
        ]
        try:
            await self._take_own_pending()
            await self._read_loop()
            await self._drain()
        finally:
            for task in background:
                await stop_task(task)
            await self.lag.stop()
            if self.health is not None:
                await self.health.close()
            with contextlib.suppress(*_REDIS_ERRORS):
                await redis.hdel(self.keys.workers(), self.name)
            self.running = False

    # -- reading -------------------------------------------------------------------------

    async def _ensure_groups(self) -> None:
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.exceptions.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _read_loop(self) -> None:
        while not self._stop.is_set():
            room = self.concurrency - self._busy
            if room <= 0 or self.saturated:
                # Full, or the process is saturated: wait for a turn to end (or the
                # pressure to ease) before taking more work.
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), 0.1 if room > 0 else 1.0)
                continue
            try:
                reply = await self.redis.xreadgroup(
                    GROUP,
                    self.name,
                    dict.fromkeys(self.streams, ">"),
                    count=room,
                    block=_READ_BLOCK_MS,
                )
            except _REDIS_ERRORS:
                log.warning("XREADGROUP failed; retrying", exc_info=True)
                await self._sleep_unless_stopped(1.0)
                continue
            for stream, entries in _stream_entries(reply):
                for entry_id, fields in entries:
                    if entry_id is not None:
                        self._spawn(stream, entry_id, fields or {}, deliveries=1)

    def _spawn(
        self, stream: str, entry_id: str, fields: Mapping[Any, Any], deliveries: int
    ) -> None:
        key = (stream, entry_id)
        if key in self._in_flight:
            return
        task = asyncio.create_task(
            self._handle(stream, entry_id, fields, deliveries), name=f"entry:{entry_id}"
        )
        self._in_flight[key] = task
        self._busy += 1  # until it runs and ends, or waits for its session
        self.metrics.in_flight.set(len(self._in_flight))
        task.add_done_callback(lambda _t: self._forget(key))

    def _forget(self, key: tuple[str, str]) -> None:
        self._in_flight.pop(key, None)
        self.metrics.in_flight.set(len(self._in_flight))
        self._room.set()

    async def _take_own_pending(self) -> None:
        """Entries this consumer name was given before a restart come first."""
        for stream in self.streams:
            try:
                pending = await self.redis.xpending_range(
                    stream,
                    GROUP,
                    min="-",
                    max="+",
                    count=10_000,
                    consumername=self.name,
                )
            except _REDIS_ERRORS:
                log.warning("could not list own pending entries", exc_info=True)
                continue
            for item in pending:
                entry_id = _s(item["message_id"])
                deliveries = int(item["times_delivered"]) + 1
                rows = await self.redis.xrange(stream, entry_id, entry_id)
                if not rows:
                    await self.redis.xack(stream, GROUP, entry_id)
                    continue
                # Count this redelivery, as XAUTOCLAIM would.
                await self.redis.xclaim(
                    stream, GROUP, self.name, 0, [entry_id], retrycount=deliveries, justid=True
                )
                self._spawn(stream, entry_id, rows[0][1] or {}, deliveries)

    async def _reclaim_loop(self) -> None:
        interval = max(self.settings.claim_idle_ms / 2000, 0.05)
        while True:
            await asyncio.sleep(interval)
            if self._stop.is_set():
                return
            for stream in self.streams:
                try:
                    await self._reclaim(stream)
                    await self._trim_acked(stream)
                    await self._forget_dead_consumers(stream)
                except Exception:  # a background loop must outlive any one failure
                    log.warning("XAUTOCLAIM on %s failed", stream, exc_info=True)
            try:
                await self._forget_dead_workers()
            except Exception:
                log.warning("could not prune %s", self.keys.workers(), exc_info=True)

    async def _reclaim(self, stream: str) -> None:
        room = self.concurrency - self._busy
        if room <= 0 or self.saturated:
            return
        reply = await self.redis.xautoclaim(
            stream, GROUP, self.name, self.settings.claim_idle_ms, "0-0", count=room
        )
        # Redis 7 answers [cursor, entries, deleted ids] and drops deleted entries from the
        # PEL itself; 6.2 answers [cursor, entries] with a deleted entry as (None, None).
        entries = reply[1] if len(reply) > 1 else []
        saw_deleted = False
        for entry_id, fields in entries:
            if entry_id is None or fields is None:
                saw_deleted = True
                continue
            entry_id = _s(entry_id)
            info = await self.redis.xpending_range(stream, GROUP, entry_id, entry_id, 1)
            deliveries = int(info[0]["times_delivered"]) if info else 1
            log.info("reclaimed %s (delivery %d)", entry_id, deliveries)
            self.metrics.reclaimed.inc()
            self._spawn(stream, entry_id, dict(fields), deliveries)
        if saw_deleted:
            await self._ack_deleted(stream)

    async def _trim_acked(self, stream: str) -> None:
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

    async def _forget_dead_consumers(self, stream: str) -> None:
        """Drop the consumers idle longer than ``dead_after_ms`` that owe nothing.

        Every worker name is a new consumer, so without this the group's consumer list
        grows with every restart. Only a consumer with no pending entry is deleted
        (DELCONSUMER drops its pending entries); a live worker reads every 250 ms, so it
        is never idle that long.
        """
        for consumer in await self.redis.xinfo_consumers(stream, GROUP):
            name = _s(consumer.get("name"))
            if (
                name != self.name
                and _int(consumer.get("pending")) == 0
                and _int(consumer.get("idle")) > self.dead_after_ms
            ):
                await self.redis.xgroup_delconsumer(stream, GROUP, name)
                log.info("forgot consumer %s of %s", name, stream)

    async def _forget_dead_workers(self) -> None:
        """Drop ``tb:workers`` entries whose heartbeat is older than ``dead_after_ms``."""
        cutoff = now_ms() - self.dead_after_ms
        seen = await self.redis.hgetall(self.keys.workers())
        stale = [_s(name) for name, at in seen.items() if _int(at) < cutoff]
        if stale:
            await self.redis.hdel(self.keys.workers(), *stale)

    async def _ack_deleted(self, stream: str) -> None:
        pending = await self.redis.xpending_range(
            stream, GROUP, min="-", max="+", count=1000, consumername=self.name
        )
        for item in pending:
            entry_id = _s(item["message_id"])
            if (stream, entry_id) in self._in_flight:
                continue
            if not await self.redis.xrange(stream, entry_id, entry_id):
                await self.redis.xack(stream, GROUP, entry_id)

    async def _keepalive(self) -> None:
        """Reset the idle time of every in-flight entry; record this worker as alive."""
        interval = max(min(self.settings.heartbeat_ms, self.settings.claim_idle_ms // 3), 50) / 1000
        while True:
            await asyncio.sleep(interval)
            by_stream: dict[str, list[Any]] = {}
            for stream, entry_id in list(self._in_flight):
                by_stream.setdefault(stream, []).append(entry_id)
            try:
                for stream, ids in by_stream.items():
                    await self.redis.xclaim(stream, GROUP, self.name, 0, ids, justid=True)
                await self.redis.hset(self.keys.workers(), self.name, str(now_ms()))
            except Exception:  # a background loop must outlive any one failure
                log.warning("keepalive failed", exc_info=True)

    async def _listen_cancels(self) -> None:
        """One pub/sub connection per process: cancel requests for running turns."""
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.cancel_channel())
                async for message in pubsub.listen():
                    self._on_cancel_message(message.get("data"))
            except Exception:  # a background loop must outlive any one failure
                log.warning("cancel subscription lost; resubscribing", exc_info=True)
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(*_REDIS_ERRORS):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    def _on_cancel_message(self, data: object) -> None:
        try:
            payload = json.loads(_s(data))
            turn_id = payload["turn"]
        except (ValueError, KeyError, TypeError):
            return
        event = self._cancels.get(turn_id)
        if event is not None:
            event.set()

    # -- one entry -----------------------------------------------------------------------

    async def _handle(
        self, stream: str, entry_id: str, fields: Mapping[Any, Any], deliveries: int
    ) -> None:
        try:
            await self._handle_entry(stream, entry_id, fields, deliveries)
        except asyncio.CancelledError:
            raise
        except _REDIS_ERRORS:
            # Left pending: this worker's keepalive stops, another delivery will come.
            log.warning("entry %s left pending after a Redis error", entry_id, exc_info=True)
        except Exception:
            log.exception("entry %s left pending after an unexpected error", entry_id)
        finally:
            self._free_slot()

    async def _handle_entry(
        self, stream: str, entry_id: str, fields: Mapping[Any, Any], deliveries: int
    ) -> None:
        assert self._engine is not None
        engine = self._engine
        fields = {_s(k): v for k, v in fields.items()}
        try:
            user = validate_id(_s(fields.get("user")), "user")
            session = validate_id(_s(fields.get("session")), "session")
            turn_id = validate_id(_s(fields.get("turn")), "turn")
        except InvalidId:
            log.warning("dropping malformed work entry %s: %r", entry_id, dict(fields))
            await self._ack(stream, entry_id)
            return
        record = await engine.turns.get(user, session, turn_id)
        if record is None or record.terminal:
            await self._ack(stream, entry_id)
            return
        if deliveries > self.settings.max_deliveries:
            outcome = TurnOutcome(
                "failed",
                reason="worker_lost",
                error=(
                    f"the turn was delivered {deliveries} times (the limit is "
                    f"{self.settings.max_deliveries}); its workers were lost"
                ),
            )
            await asyncio.shield(self._settle(stream, entry_id, record, outcome, UsageCounts()))
            return
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
        try:
            if not await self._wait_for_lease(lease, record, stream, entry_id):
                return
            if self._stop.is_set():
                return
            await self._run_turn(stream, entry_id, record, lease)
        finally:
            await asyncio.shield(self._release(lease))
            self._wake(self.keys.session_tag(user, session))

    async def _take_slot(self) -> None:
        """Run capacity: wait until fewer than ``concurrency`` entries hold it."""
        try:
            while self._busy >= self.concurrency and not self._stop.is_set():
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), 1.0)
        finally:
            self._busy += 1  # even when cancelled: the caller frees it

    def _free_slot(self) -> None:
        self._busy -= 1
        self._room.set()

    async def _wait_for_lease(
        self, lease: SessionLease, record: TurnRecord, stream: str, entry_id: str
    ) -> bool:
        """Wait until the turn heads its session's active list and holds the lease.

        Called holding a run slot, and returns holding one; while it waits behind its
        session's running turn it gives the slot back, so waiting turns never stop this
        worker from running other sessions' work. Of one session's waiting entries in
        this process only the oldest polls (backing off); the others sleep until a turn
        of the session ends here or a poll finds that they head the session.
        """
        user, session, turn_id = record.userId, record.sessionId, record.turnId
        tag = self.keys.session_tag(user, session)
        assert self._engine is not None
        waiters = self._waiting.setdefault(tag, {})
        mine = waiters[turn_id] = asyncio.Event()
        delay = _WAIT_POLL_S
        try:
            while True:
                if self._stop.is_set():
                    return False
                status, detail = await lease.try_acquire()
                if status == "ok":
                    return True
                if status == "not_head":
                    current = await self._engine.turns.get(user, session, turn_id)
                    if current is None or current.terminal:
                        await self._ack(stream, entry_id)
                        return False
                    if detail and detail != turn_id:
                        await self._clear_dead_head(user, session, detail)
                    head = waiters.get(detail)
                    if head is not None:
                        head.set()  # the head is ours, asleep: its turn now
                oldest = min(waiters) == turn_id
                self._free_slot()
                try:
                    mine.clear()
                    try:
                        await asyncio.wait_for(mine.wait(), delay if oldest else _WAIT_IDLE_S)
                        delay = _WAIT_POLL_S
                    except TimeoutError:
                        if oldest:
                            delay = min(delay * 1.5, _WAIT_POLL_MAX_S)
                finally:
                    await self._take_slot()
        finally:
            waiters.pop(turn_id, None)
            if not waiters:
                self._waiting.pop(tag, None)
            else:
                waiters[min(waiters)].set()  # the next oldest takes over the polling

    async def _clear_dead_head(self, user: str, session: str, head: str) -> None:
        """A head turn that already ended (or vanished) must not block the session."""
        assert self._engine is not None
        try:
            head_record = await self._engine.turns.get(user, session, head)
        except InvalidId:
            head_record = None
        if head_record is None or head_record.terminal:
            await self.redis.lrem(self.keys.active(user, session), 1, head)

    def _wake(self, tag: str) -> None:
        """A turn of the session ended here: its oldest waiting entry polls at once."""
        waiters = self._waiting.get(tag)
        if waiters:
            waiters[min(waiters)].set()

    async def _run_turn(
        self, stream: str, entry_id: str, record: TurnRecord, lease: SessionLease
    ) -> None:
        assert self._engine is not None
        engine = self._engine
        turn_id = record.turnId
        cancel = self._cancels.setdefault(turn_id, asyncio.Event())
        try:
            try:
                started = await engine.start(record, lease.token)
            except TurnNotFound:
                started = None
            if started is None:
                await self._ack(stream, entry_id)
                return
            running, deadline_ms = started
            if running.cancelRequested:
                cancel.set()
            self.metrics.running.inc()
            began = time.monotonic()
            try:
                outcome, usage = await engine.run(
                    running, lease, deadline_ms=deadline_ms, cancel=cancel, stop=self._abort
                )
            finally:
                self.metrics.running.dec()
            self.metrics.turn_seconds.observe(time.monotonic() - began)
            if outcome.status == "gone":
                await self._ack(stream, entry_id)
                await self._sweep_deleted(record)
            elif outcome.terminal:
                await asyncio.shield(self._settle(stream, entry_id, running, outcome, usage, lease))
            else:
                self.metrics.abandoned.inc()
                log.warning("turn %s abandoned (%s); left pending", turn_id, outcome.reason)
        finally:
            self._cancels.pop(turn_id, None)

    async def _sweep_deleted(self, record: TurnRecord) -> None:
        """Events written while the session was being deleted recreate keys; drop them."""
        user, session = record.userId, record.sessionId
        await self.redis.delete(self.keys.turn_events(user, session, record.turnId))
        if not await self.redis.exists(self.keys.env(user, session)):
            await self.redis.delete(self.keys.log(user, session))

    async def _settle(
        self,
        stream: str,
        entry_id: str,
        record: TurnRecord,
        outcome: TurnOutcome,
        usage: UsageCounts,
        lease: SessionLease | None = None,
    ) -> None:
        """Final status and terminal event, then XACK, then the lease: never half-written."""
        task = asyncio.current_task()
        assert task is not None and self._engine is not None
        self._settling.add(task)
        try:
            token = lease.token if lease is not None else None
            await self._engine.finish(record, outcome, usage, lease_token=token)
            await self._ack(stream, entry_id)
            self.turns_finished += 1
            self.metrics.turns.labels(outcome.status).inc()
            if lease is not None:
                await lease.release()
        finally:
            self._settling.discard(task)

    async def _ack(self, stream: str, entry_id: str) -> None:
        await self.redis.xack(stream, GROUP, entry_id)

    async def _release(self, lease: SessionLease) -> None:
        try:
            await lease.release()
        except _REDIS_ERRORS:
            log.warning("lease release failed for %s; it will expire", lease.turn_id)

    # -- stopping ------------------------------------------------------------------------

    async def _sleep_unless_stopped(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _drain(self) -> None:
        """After stop: running turns get the grace period, then are abandoned (pending)."""
        tasks = list(self._in_flight.values())
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.settings.shutdown_grace_ms / 1000)
            if late:
                log.warning(
                    "%d turn(s) still running after the grace period; leaving them", len(late)
                )
                self._abort.set()
                _, stuck = await asyncio.wait(late, timeout=5.0)
                for task in stuck:
                    await stop_task(task)
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)


def _stream_entries(reply: Any) -> list[tuple[str, list[tuple[str | None, Any]]]]:
    """XREADGROUP's reply as ``[(stream, [(id, fields)])]`` (RESP2 list or RESP3 dict)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        items = list(reply.items())
    else:
        items = [(item[0], item[1]) for item in reply]
    return [
        (_s(stream), [(_s(e[0]) if e[0] is not None else None, e[1]) for e in entries or []])
        for stream, entries in items
    ]


def run_worker(settings: Settings, *, concurrency: int | None, name: str | None) -> int:
    """Run a worker until SIGTERM or SIGINT; returns the process exit code."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )

    async def main() -> int:
        worker = Worker(settings, name=name, concurrency=concurrency)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.request_stop)
        try:
            await worker.run()
        except _REDIS_ERRORS as exc:
            log.error("worker %s stopped: Redis unavailable (%s)", worker.name, exc)
            return 1
        finally:
            await worker.aclose()
        log.info("worker %s stopped cleanly", worker.name)
        return 0

    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main())
    except ImportError:
        return asyncio.run(main())

"""The worker process: reads turn requests from the work streams and runs them.

One :class:`Worker` is one consumer (a name unique per process) of the group
``workers`` on every shard stream; the queue mechanics are :class:`WorkQueue`'s. On
start it takes back its own pending entries, then reads new ones while it has run
capacity and is not saturated; a background loop reclaims entries idle longer than
``claim_idle_ms`` from dead consumers, trims the streams and forgets dead workers by
their own heartbeat; a sweeper enqueues accepted turns whose work entry was lost
between the submit's two calls (``TurnStore.sweep_outboxes``). Each entry is a task
running one :meth:`TurnEngine.attempt`. While the turn waits behind its session's
running turn it gives back its run slot and sleeps in its session's wait list. While an
entry is in flight its idle time is reset every heartbeat (XCLAIM JUSTID, which does
not count as a delivery), so a long or queued turn is never reclaimed from a live
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

import redis.asyncio as aioredis
import redis.exceptions

from turnbus.shared.cluster import ClusterMux
from turnbus.shared.connect import check_cluster_mode, connect, pool_wait_ms
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import InvalidId, Keys, validate_id
from turnbus.shared.mux import MuxRedis
from turnbus.shared.replicas import ReplicaWait
from turnbus.shared.runtime import tune_gc
from turnbus.shared.scripts import text as _s
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.cancellation import stop_task
from turnbus.worker.health import HealthServer, WorkerMetrics
from turnbus.worker.interrupts import Signal
from turnbus.worker.lease import SessionLease, new_lease_token
from turnbus.worker.models.base import ModelClient
from turnbus.worker.pressure import LoopLag
from turnbus.worker.turn import TurnEngine
from turnbus.worker.workqueue import GROUP, Entry, WorkQueue

__all__ = ["GROUP", "Worker", "default_worker_name", "run_worker"]

log = logging.getLogger(__name__)

_READ_BLOCK_MS = 250
_WAIT_POLL_S = 0.05
_WAIT_POLL_MAX_S = 0.4
# A waiting entry that is not its session's oldest here re-checks this often (a safety
# net: it is normally woken when its session's turn ends or a poll finds it at the head).
_WAIT_IDLE_S = 2.0
_REDIS_ERRORS = (redis.exceptions.RedisError, OSError)
# After a failed read of the work streams, the next comes this soon, doubling up to the max.
_READ_RETRY_S = 0.1
_READ_RETRY_MAX_S = 1.0
# A blocking read that has not returned this long after its BLOCK ends is given up.
_READ_GRACE_S = 1.0


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


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
        self._model = model
        self._owns_model = model is None
        self._redis = redis
        self._owns_redis = redis is None
        # Entries read but not finished (running, or waiting for their session). Only
        # the ones that run (or are about to try) hold run capacity: ``_busy`` counts them.
        self._in_flight: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._busy = 0
        self._cancels: dict[str, Signal] = {}
        # Per session (its tag): the turn ids of this process's entries waiting for that
        # session's running turn, each with the event that wakes it.
        self._waiting: dict[str, dict[str, asyncio.Event]] = {}
        self.lag = LoopLag()
        self._stop = asyncio.Event()
        self._abort = Signal()
        self._room = asyncio.Event()
        self._engine: TurnEngine | None = None
        self._turns: TurnStore | None = None  # for the outbox sweeps
        self._queue: WorkQueue | None = None
        self.metrics = WorkerMetrics()
        self.health: HealthServer | None = None
        self.turns_finished = 0
        self.forget_passes = 0
        self.running = False
        self._was_saturated = False
        # After a read error an entry may have been delivered with its reply lost, and
        # after Redis outlived a turn's retries its entry was left pending: the next
        # read takes this consumer's own pending entries (not in flight) first.
        self._reread_own = False
        # A worker whose own heartbeat is this old is dead: forgotten.
        self.dead_after_ms = settings.worker_forget_after_ms

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
        """The event loop runs late, or Redis answers slowly or calls wait for pooled
        connections: take no new work."""
        return self._pressure() is not None

    def _pressure(self) -> str | None:
        """Why the process is saturated now (``None``: it is not). Every signal follows
        the present within a second: a worker that takes no work gets few replies, so
        no signal may need replies to come down."""
        lag = self.lag.lag_ms
        if lag > self.settings.worker_max_loop_lag_ms:
            return f"event loop {lag:.0f} ms late"
        redis = self.redis
        wait_ms = pool_wait_ms(redis)
        if wait_ms > self.settings.worker_max_pool_wait_ms:
            return f"calls wait {wait_ms:.0f} ms for a pooled Redis connection"
        latency_ms = redis.latency_ms if isinstance(redis, MuxRedis | ClusterMux) else 0.0
        if latency_ms > self.settings.worker_max_pool_wait_ms:
            return f"Redis answers in {latency_ms:.0f} ms"
        return None

    def _room_now(self) -> int:
        """How many entries to take now: none while full, nor while saturated with turns
        running here. A saturated worker that runs nothing takes one at a time: refusing
        would relieve nothing here, and were every worker saturated (a host short of CPU)
        no turn would start at all."""
        room = self.concurrency - self._busy
        if room > 0 and self._check_saturated():
            return 1 if self._busy == 0 else 0
        return room

    def _check_saturated(self) -> bool:
        """:attr:`saturated`, logging when the state changes (and the gauge follows)."""
        why = self._pressure()
        if (why is not None) != self._was_saturated:
            self._was_saturated = why is not None
            self.metrics.saturated.set(1 if why is not None else 0)
            if why is not None:
                log.warning("worker %s saturated (%s): taking no new work", self.name, why)
            else:
                log.info("worker %s no longer saturated: taking work again", self.name)
        return why is not None

    @property
    def in_flight_count(self) -> int:
        """Entries read and not yet finished (running or waiting for their session)."""
        return len(self._in_flight)

    @property
    def redis(self) -> aioredis.Redis:
        if self._redis is None:
            self._redis = connect(self.settings, "worker", concurrency=self.concurrency)
        return self._redis

    @property
    def model(self) -> ModelClient:
        if self._model is None:
            from turnbus.worker.models import make_model

            self._model = make_model(self.settings)
        return self._model

    @property
    def queue(self) -> WorkQueue:
        if self._queue is None:
            self._queue = WorkQueue(self.redis, self.keys, self.settings, self.name)
        return self._queue

    async def aclose(self) -> None:
        """Close what this worker opened (the Redis client and model it built itself)."""
        if self._owns_model and self._model is not None:
            await self._model.aclose()
            self._model = None
        if self._owns_redis and self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def run(self) -> None:
        """Consume until :meth:`request_stop`, then drain within the grace period."""
        redis = self.redis
        store = EnvelopeStore(
            redis,
            self.keys,
            log_maxlen=self.settings.log_maxlen,
            replicas=ReplicaWait.from_settings(self.settings),
        )
        self._engine = TurnEngine(
            redis,
            self.keys,
            self.settings,
            self.model,
            worker_name=self.name,
            store=store,
            metrics=self.metrics,
        )
        self._turns = TurnStore(redis, self.keys, self.settings)
        queue = self.queue
        await check_cluster_mode(redis, self.settings)
        await queue.ensure_groups()
        await queue.keepalive([])  # the heartbeat record exists before the first read
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
        self.metrics.waiting.set_function(lambda: self.waiting_count)
        self.metrics.loop_lag.set_function(lambda: self.lag.lag_ms / 1000)
        self.metrics.pool_wait.set_function(lambda: pool_wait_ms(redis) / 1000)
        if isinstance(redis, MuxRedis | ClusterMux):
            self.metrics.redis_latency.set_function(lambda: redis.latency_ms / 1000)
        log.info(
            "worker %s consuming %s (concurrency %d)",
            self.name,
            ", ".join(queue.streams),
            self.concurrency,
        )
        background = [
            asyncio.create_task(self._listen_cancels(), name="worker:cancels"),
            asyncio.create_task(self._keepalive(), name="worker:keepalive"),
            asyncio.create_task(self._reclaim_loop(), name="worker:reclaim"),
            asyncio.create_task(self._sweep_loop(), name="worker:sweeper"),
        ]
        try:
            await self._take_own_pending()
            try:
                await self._read_loop()
            finally:
                await queue.stop_reading()
            await self._drain()
        finally:
            for task in background:
                await stop_task(task)
            await self.lag.stop()
            if self.health is not None:
                await self.health.close()
            with contextlib.suppress(*_REDIS_ERRORS):
                await queue.leave()
            self.running = False

    # -- reading -------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        backoff = _READ_RETRY_S
        while not self._stop.is_set():
            room = self._room_now()
            if room <= 0:
                # Full, or the process is saturated: wait for a turn to end (or the
                # pressure to ease) before taking more work.
                self._room.clear()
                full = self._busy >= self.concurrency
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), 1.0 if full else 0.1)
                continue
            try:
                if self._reread_own:
                    entries = await self.queue.own_delivered(self._in_flight)
                    self._reread_own = False
                    if entries:
                        log.info(
                            "worker %s took back %d of its own pending entries",
                            self.name,
                            len(entries),
                        )
                else:
                    # Bounded: a paused Redis or a half-open connection must not hold the
                    # loop (its saturation would go unseen); the cancel drops the
                    # connection, and the next read first takes back what it delivered.
                    entries = await asyncio.wait_for(
                        self.queue.read(room, _READ_BLOCK_MS), _READ_BLOCK_MS / 1000 + _READ_GRACE_S
                    )
            except _REDIS_ERRORS as exc:
                # The reply of a read may be what was lost: entries it delivered are
                # pending on this consumer and no new read returns them.
                self._reread_own = True
                why = str(exc) or f"no answer in {_READ_BLOCK_MS / 1000 + _READ_GRACE_S:.2f} s"
                log.warning("reading work failed (%s); retrying in %.1f s", why, backoff)
                await self._sleep_unless_stopped(backoff)
                backoff = min(backoff * 2, _READ_RETRY_MAX_S)
                continue
            backoff = _READ_RETRY_S
            for entry in entries:
                self._spawn(entry)

    def _spawn(self, entry: Entry) -> None:
        key = entry.key
        if key in self._in_flight:
            return
        task = asyncio.create_task(self._handle(entry), name=f"entry:{entry.id}")
        self._in_flight[key] = task
        self._busy += 1  # until it runs and ends, or waits for its session
        self.metrics.in_flight.set(len(self._in_flight))
        task.add_done_callback(lambda _t: self._done(key))

    def _done(self, key: tuple[str, str]) -> None:
        self._in_flight.pop(key, None)
        self.metrics.in_flight.set(len(self._in_flight))
        self._room.set()

    async def _take_own_pending(self) -> None:
        """Entries this consumer name was given before a restart come first."""
        try:
            entries = await self.queue.own_pending()
        except _REDIS_ERRORS:
            log.warning("could not take back own pending entries", exc_info=True)
            return
        for entry in entries:
            self._spawn(entry)

    async def _reclaim_loop(self) -> None:
        interval = max(self.settings.claim_idle_ms / 2000, 0.05)
        while True:
            await asyncio.sleep(interval)
            if self._stop.is_set():
                return
            for stream in self.queue.streams:
                try:
                    room = self._room_now()
                    if room > 0:
                        for entry in await self.queue.reclaim(stream, room, self._in_flight):
                            log.info("reclaimed %s", entry.id)
                            self.metrics.reclaimed.inc()
                            self._spawn(entry)
                    await self.queue.trim(stream)
                except Exception:  # a background loop must outlive any one failure
                    log.warning("XAUTOCLAIM on %s failed", stream, exc_info=True)
            try:
                await self.queue.forget_dead(self.dead_after_ms)
                self.forget_passes += 1
            except Exception:
                log.warning("could not forget dead workers", exc_info=True)

    async def _sweep_loop(self) -> None:
        """Every half grace period one worker of all (a lock) sweeps the outboxes."""
        interval_ms = max(self.settings.outbox_grace_ms // 2, 50)
        while True:
            await asyncio.sleep(interval_ms / 1000)
            if self._stop.is_set():
                return
            try:
                lock = self.keys.sweeper_lock()
                if await self.redis.set(lock, self.name, nx=True, px=interval_ms):
                    assert self._turns is not None
                    swept = await self._turns.sweep_outboxes()
                    self.metrics.swept.inc(len(swept))
            except Exception:  # a background loop must outlive any one failure
                log.warning("outbox sweep failed", exc_info=True)

    async def _keepalive(self) -> None:
        """Reset the idle time of every in-flight entry; record this worker as alive."""
        interval = max(min(self.settings.heartbeat_ms, self.settings.claim_idle_ms // 3), 50) / 1000
        while True:
            await asyncio.sleep(interval)
            try:
                await self.queue.keepalive(list(self._in_flight))
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

    async def _handle(self, entry: Entry) -> None:
        try:
            await self._handle_entry(entry)
        except asyncio.CancelledError:
            raise
        except _REDIS_ERRORS:
            # Left pending; the read loop takes it back once Redis answers again.
            log.warning("entry %s left pending after a Redis error", entry.id, exc_info=True)
            self._reread_own = True
        except Exception:
            log.exception("entry %s left pending after an unexpected error", entry.id)
        finally:
            self._free_slot()

    async def _handle_entry(self, entry: Entry) -> None:
        assert self._engine is not None
        fields = entry.fields
        try:
            user = validate_id(_s(fields.get("user")), "user")
            session = validate_id(_s(fields.get("session")), "session")
            turn_id = validate_id(_s(fields.get("turn")), "turn")
        except InvalidId:
            log.warning("dropping malformed work entry %s: %r", entry.id, dict(fields))
            await self.queue.ack(entry.stream, entry.id)
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
        tag = self.keys.session_tag(user, session)
        cancel = self._cancels.setdefault(turn_id, Signal())
        delay = _WAIT_POLL_S

        async def wait(head: str) -> bool:
            """Wait for the session without a run slot; ``False``: the worker stops."""
            nonlocal delay
            if self._stop.is_set():
                return False
            waiters = self._waiting.setdefault(tag, {})
            mine = waiters.setdefault(turn_id, asyncio.Event())
            other = waiters.get(head)
            if head != turn_id and other is not None:
                other.set()  # the head is ours, asleep: its turn now
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
            return not self._stop.is_set()

        try:
            result = await self._engine.attempt(
                user,
                session,
                turn_id,
                entry=(entry.stream, GROUP, entry.id),
                lease=lease,
                wait=wait,
                cancel=cancel,
                stop=self._abort,
            )
        finally:
            self._cancels.pop(turn_id, None)
            waiters = self._waiting.get(tag)
            if waiters is not None and waiters.pop(turn_id, None) is not None and not waiters:
                self._waiting.pop(tag, None)
            self._wake(tag)
        if result.kind == "ended":
            self.turns_finished += 1
            self.metrics.turns.labels(result.status or "failed").inc()
        elif result.kind in ("dropped", "gone"):
            await self.queue.ack(entry.stream, entry.id)
            if result.kind == "gone":
                await self._engine.sweep_deleted(user, session, turn_id)
        elif result.kind == "abandoned":
            self.metrics.abandoned.inc()
            log.warning("turn %s abandoned (%s); left pending", turn_id, result.reason)
            if result.reason == "redis_unavailable":
                # Redis was gone longer than the in-turn retries: the next read takes
                # the entry back (a new attempt, from the last committed round) as soon
                # as Redis answers, not after claim_idle_ms.
                self._reread_own = True

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

    def _wake(self, tag: str) -> None:
        """A turn of the session ended here, or left its wait list: the oldest waiting
        entry of the session polls at once."""
        waiters = self._waiting.get(tag)
        if waiters:
            waiters[min(waiters)].set()

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


def run_worker(settings: Settings, *, concurrency: int | None, name: str | None) -> int:
    """Run a worker until SIGTERM or SIGINT; returns the process exit code."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )

    async def main() -> int:
        worker = Worker(settings, name=name, concurrency=concurrency)
        tune_gc()
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

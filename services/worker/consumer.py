"""The worker process: reads turn requests from the work streams and runs them.

One :class:`Worker` is one consumer (a name unique per process) of the group
``workers`` on every shard stream; the queue mechanics are :class:`WorkQueue`'s. The
worker wires its parts and runs them from start to shutdown:

- :class:`~turnbus.worker.intake.Intake` takes entries: its own pending ones at
  start, new ones while there is room, idle ones from dead consumers (and trims the
  streams, forgets dead workers);
- :class:`~turnbus.worker.slots.RunSlots` holds the run capacity and the back-pressure
  gate, :class:`~turnbus.worker.slots.SessionWaits` the entries waiting behind their
  session's running turn (without a run slot);
- :class:`~turnbus.worker.entries.EntryRunner` owns each entry: its
  :meth:`TurnEngine.attempt`, then its one ack; and it hears cancel requests;
- :class:`~turnbus.worker.sweeps.Upkeep` keeps the in-flight entries from being
  reclaimed (the heartbeat) and sweeps the outboxes.

On stop it reads no more; in-flight turns get ``shutdown_grace_ms`` to finish, then
are abandoned, left pending for the next worker.
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

from turnbus.shared import tracing
from turnbus.shared.connect import check_cluster_mode, connect, pool_wait_ms
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import Keys
from turnbus.shared.muxclient import mux_client
from turnbus.shared.replicas import ReplicaWait
from turnbus.shared.runtime import WORKER_GC_THRESHOLDS, tune_gc
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.cancellation import stop_task
from turnbus.worker.entries import EntryRunner
from turnbus.worker.health import HealthServer, WorkerMetrics
from turnbus.worker.intake import Intake
from turnbus.worker.interrupts import Signal
from turnbus.worker.models.base import ModelClient
from turnbus.worker.pressure import LoopLag
from turnbus.worker.registry import ToolRegistry, build_tool_sources
from turnbus.worker.retry import REDIS_ERRORS, RedisRetry
from turnbus.worker.slots import RunSlots, SessionWaits
from turnbus.worker.sweeps import Upkeep
from turnbus.worker.toolsource import ToolSourceError
from turnbus.worker.turn import TurnEngine
from turnbus.worker.webhooks import WebhookSender
from turnbus.worker.workqueue import GROUP, WorkQueue

__all__ = ["GROUP", "Worker", "default_worker_name", "run_worker"]

log = logging.getLogger(__name__)


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
        tools: ToolRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.name = name or default_worker_name()
        self.concurrency = concurrency or settings.worker_concurrency
        self.keys = Keys(settings.prefix)
        self._model = model
        self._owns_model = model is None
        self._redis = redis
        self._owns_redis = redis is None
        # The tools beyond the notes: given (tests), else built from the settings at run.
        self._tools = tools
        self._owns_tools = tools is None
        self.lag = LoopLag()
        self._stop = asyncio.Event()
        self._abort = Signal()
        self.metrics = WorkerMetrics()
        self.slots = RunSlots(
            settings,
            concurrency=self.concurrency,
            name=self.name,
            metrics=self.metrics,
            lag=self.lag,
            redis=lambda: self.redis,
            stop=self._stop,
        )
        self.waits = SessionWaits(self.slots, self._stop)
        self._engine: TurnEngine | None = None
        self._entries: EntryRunner | None = None
        self._intake: Intake | None = None
        self._queue: WorkQueue | None = None
        self.health: HealthServer | None = None
        self.webhooks: WebhookSender | None = None
        self.running = False
        # A worker whose own heartbeat is this old is dead: forgotten.
        self.dead_after_ms = settings.worker_forget_after_ms

    # -- public surface ------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop reading; in-flight turns get ``shutdown_grace_ms`` to finish (SIGTERM)."""
        self._stop.set()
        self.slots.room.set()
        self.waits.wake_all()

    @property
    def waiting_count(self) -> int:
        """Entries waiting behind their session's running turn (holding no capacity)."""
        return self.waits.count

    @property
    def saturated(self) -> bool:
        """The event loop runs late, or Redis answers slowly or calls wait for pooled
        connections: take no new work."""
        return self.slots.pressure() is not None

    @property
    def in_flight_count(self) -> int:
        """Entries read and not yet finished (running or waiting for their session)."""
        return len(self.slots.in_flight)

    @property
    def turns_finished(self) -> int:
        """Turns this worker ended (since :meth:`run`)."""
        return 0 if self._entries is None else self._entries.turns_finished

    @property
    def forget_passes(self) -> int:
        """Passes that forgot dead workers (since :meth:`run`)."""
        return 0 if self._intake is None else self._intake.forget_passes

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

    @property
    def tools(self) -> ToolRegistry:
        if self._tools is None:
            self._tools = ToolRegistry(build_tool_sources(self.settings))
        return self._tools

    async def aclose(self) -> None:
        """Close what this worker opened (the Redis client, model and tools it built)."""
        if self._owns_tools and self._tools is not None:
            await self._tools.aclose()
            self._tools = None
        if self._owns_model and self._model is not None:
            await self._model.aclose()
            self._model = None
        if self._owns_redis and self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def run(self) -> None:
        """Consume until :meth:`request_stop`, then drain within the grace period."""
        redis = self.redis
        tools = self.tools
        # A source that cannot start (a module that does not import, a bad MCP config)
        # stops the worker here, before it takes any work, with a message naming it.
        await tools.start()
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
            tools=tools,
        )
        queue = self.queue
        entries = self._entries = EntryRunner(
            self._engine,
            queue,
            redis,
            self.keys,
            self.settings,
            name=self.name,
            waits=self.waits,
            metrics=self.metrics,
            abort=self._abort,
        )
        intake = self._intake = Intake(
            queue,
            self.slots,
            self.settings,
            run=entries.run,
            name=self.name,
            metrics=self.metrics,
            stop=self._stop,
            dead_after_ms=lambda: self.dead_after_ms,
        )
        upkeep = Upkeep(
            redis,
            self.keys,
            self.settings,
            queue=queue,
            turns=TurnStore(redis, self.keys, self.settings),
            name=self.name,
            metrics=self.metrics,
            stop=self._stop,
        )
        sender = self.webhooks = WebhookSender(
            redis, self.keys, self.settings, name=self.name, stop=self._stop
        )
        self._engine.ending.webhook_queued = sender.queued
        await check_cluster_mode(redis, self.settings)
        # A blip at start is ridden out as a turn rides one out; a Redis that stays
        # unreachable for the whole retry window ends the process (exit 1).
        starting = RedisRetry(self.settings.redis_retry_ms, self.metrics)
        await starting.run("creating the consumer groups", queue.ensure_groups)
        # The heartbeat record, and the tools for the gateway, exist before the first read.
        queue.published = tools.published_json()
        queue.tool_states = lambda: json.dumps(tools.status(), separators=(",", ":"))
        if self.settings.metrics_port:
            queue.metrics_port = self.settings.metrics_port
        await starting.run("the first heartbeat", lambda: queue.keepalive([]))
        if self.settings.metrics_port:
            self.health = HealthServer(
                self.metrics,
                lambda: self.running and not self._stop.is_set(),
                name=self.name,
                host=self.settings.metrics_host,
                port=self.settings.metrics_port,
                detail=lambda: {"tools": tools.status()},
            )
            await self.health.start()
        self.running = True
        self.lag.start()
        self.metrics.waiting.set_function(lambda: self.waiting_count)
        self.metrics.loop_lag.set_function(lambda: self.lag.lag_ms / 1000)
        self.metrics.pool_wait.set_function(lambda: pool_wait_ms(redis) / 1000)
        links = mux_client(redis)
        self.metrics.redis_latency.set_function(lambda: links.latency_ms / 1000)
        log.info(
            "worker %s consuming %s (concurrency %d)",
            self.name,
            ", ".join(queue.streams),
            self.concurrency,
        )
        background = [
            asyncio.create_task(entries.listen_cancels(), name="worker:cancels"),
            asyncio.create_task(
                upkeep.keepalive_loop(self.slots.in_flight), name="worker:keepalive"
            ),
            asyncio.create_task(intake.reclaim_loop(), name="worker:reclaim"),
            asyncio.create_task(upkeep.sweep_loop(), name="worker:sweeper"),
            asyncio.create_task(sender.run(), name="worker:webhooks"),
        ]
        try:
            await intake.take_own_pending()
            try:
                await intake.read_loop()
            finally:
                await queue.stop_reading()
            await self._drain()
        finally:
            for task in background:
                await stop_task(task)
            await self.lag.stop()
            if self.health is not None:
                await self.health.close()
            with contextlib.suppress(*REDIS_ERRORS):
                await queue.leave()
            self.running = False

    async def _drain(self) -> None:
        """After stop: running turns get the grace period, then are abandoned (pending)."""
        tasks = list(self.slots.in_flight.values())
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
        try:
            traced = tracing.start(settings, "turnbus-worker")
        except tracing.TracingUnavailable as exc:
            log.error("worker cannot start: %s", exc)
            return 2
        worker = Worker(settings, name=name, concurrency=concurrency)
        tune_gc(WORKER_GC_THRESHOLDS)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.request_stop)
        try:
            await worker.run()
        except REDIS_ERRORS as exc:
            log.error("worker %s stopped: Redis unavailable (%s)", worker.name, exc)
            return 1
        except ToolSourceError as exc:
            log.error("worker %s cannot start its tools: %s", worker.name, exc)
            return 2
        finally:
            await worker.aclose()
            if traced:
                tracing.stop()  # the spans still held are exported
        log.info("worker %s stopped cleanly", worker.name)
        return 0

    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main())
    except ImportError:
        return asyncio.run(main())

"""The worker's optional health and metrics port (``TURNBUS_METRICS_PORT``; 0 = off), on
``TURNBUS_METRICS_HOST``.

``GET /healthz`` answers 200 while the worker consumes (503 otherwise); ``GET /readyz``
the same, with each tool source's state (``tools``: a Python source's modules and tool
count, an MCP server's connection); ``GET /metrics`` is Prometheus text. Each :class:`WorkerMetrics` has its own registry, so several
workers in one process (tests) never collide.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["HealthServer", "WorkerMetrics"]

log = logging.getLogger(__name__)

_MAX_REQUEST_BYTES = 8192


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.turns = Counter(
            "turnbus_worker_turns",
            "Turns ended by this worker, by final status",
            ["status"],
            registry=r,
        )
        self.turn_seconds = Histogram(
            "turnbus_worker_turn_seconds",
            "Wall time of one turn attempt, start to terminal event",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.running = Gauge("turnbus_worker_turns_running", "Turns running now", registry=r)
        self.in_flight = Gauge(
            "turnbus_worker_entries_in_flight",
            "Work entries read and not finished (running or waiting for their session)",
            registry=r,
        )
        self.rounds = Counter("turnbus_worker_model_rounds", "Model rounds played", registry=r)
        self.tool_calls = Counter(
            "turnbus_worker_tool_calls",
            "Tool calls answered, by tool and outcome (ok, error, timeout, exception, "
            "invalid, refused, cancelled, reused, unknown_outcome, lost)",
            ["tool", "outcome"],
            registry=r,
        )
        self.tool_seconds = Histogram(
            "turnbus_worker_tool_seconds",
            "Time from a tool call's start to its result, by tool and outcome",
            ["tool", "outcome"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.reclaimed = Counter(
            "turnbus_worker_reclaimed_entries",
            "Entries taken over from another consumer (XAUTOCLAIM)",
            registry=r,
        )
        self.swept = Counter(
            "turnbus_worker_swept_turns",
            "Accepted turns enqueued by the outbox sweeper (their work entry was lost)",
            registry=r,
        )
        self.abandoned = Counter(
            "turnbus_worker_abandoned_attempts",
            "Turn attempts left pending (lease lost, or the grace period ran out)",
            registry=r,
        )
        self.waiting = Gauge(
            "turnbus_worker_entries_waiting",
            "Entries waiting behind their session's running turn (holding no run slot)",
            registry=r,
        )
        self.session_looks = Counter(
            "turnbus_worker_session_looks",
            "Looks at a busy session by the entries waiting behind its turn (rarer behind a "
            "turn waiting for its caller)",
            registry=r,
        )
        self.loop_lag = Gauge(
            "turnbus_worker_loop_lag_seconds",
            "How late the event loop runs (moving average): a back-pressure signal",
            registry=r,
        )
        self.pool_wait = Gauge(
            "turnbus_worker_redis_pool_wait_seconds",
            "How long calls wait for a pooled Redis connection (moving average)",
            registry=r,
        )
        self.redis_latency = Gauge(
            "turnbus_worker_redis_latency_seconds",
            "How long Redis takes to answer: the mean of the last second's replies, or the "
            "time commands have waited with nothing read if longer (a back-pressure signal)",
            registry=r,
        )
        self.saturated = Gauge(
            "turnbus_worker_saturated",
            "1 while the worker takes no new work because it or Redis is slow, else 0",
            registry=r,
        )
        self.redis_retries = Counter(
            "turnbus_worker_redis_retries",
            "Redis calls of running turns retried in-process while Redis was unreachable",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HealthServer:
    """A tiny HTTP/1.1 responder: one request per connection, then close."""

    def __init__(
        self,
        metrics: WorkerMetrics,
        is_healthy: Callable[[], bool],
        *,
        name: str,
        host: str = "0.0.0.0",  # a container's probe and scraper come from outside
        port: int = 0,
        detail: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.metrics = metrics
        self.is_healthy = is_healthy
        self.detail = detail
        self.name = name
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        """Listen; returns the bound port."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        sock = self._server.sockets[0]
        self.port = int(sock.getsockname()[1])
        log.info("worker health and metrics on port %d", self.port)
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            if len(head) > _MAX_REQUEST_BYTES:
                raise ValueError("request too large")
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            status, ctype, body = self._answer(method, path.split("?", 1)[0])
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            status, ctype, body = "400 Bad Request", "text/plain", b"bad request\n"
        try:
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode("latin-1")
                + body
            )
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _answer(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method != "GET":
            return "405 Method Not Allowed", "text/plain", b"method not allowed\n"
        if path in ("/healthz", "/readyz"):
            healthy = self.is_healthy()
            answer: dict[str, Any] = {
                "status": "ok" if healthy else "stopping",
                "worker": self.name,
            }
            if path == "/readyz" and self.detail is not None:
                answer.update(self.detail())
            status = "200 OK" if healthy else "503 Service Unavailable"
            return status, "application/json", json.dumps(answer).encode()
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, self.metrics.render()
        return "404 Not Found", "text/plain", b"not found\n"

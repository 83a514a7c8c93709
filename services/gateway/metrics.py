"""Prometheus metrics on a registry the app owns, and the middleware that records requests."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["GatewayMetrics", "MetricsMiddleware"]


class GatewayMetrics:
    """Every gateway metric, registered on this instance's own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "turnbus_gateway_requests_total",
            "HTTP requests answered, by route template, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "turnbus_gateway_request_duration_seconds",
            "Time to answer a request (SSE: the stream's whole life), by route, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.open_streams = Gauge(
            "turnbus_gateway_sse_open_streams",
            "SSE streams currently open.",
            registry=self.registry,
        )
        self.followed_streams = Gauge(
            "turnbus_gateway_sse_followed_redis_streams",
            "Redis streams the SSE hub is reading for its followers.",
            registry=self.registry,
        )
        self.sse_dropped = Counter(
            "turnbus_gateway_sse_dropped_total",
            "SSE followers dropped because they fell behind their queue.",
            registry=self.registry,
        )
        self.sse_resyncs = Counter(
            "turnbus_gateway_sse_resyncs_total",
            "SSE resync events sent (a cursor older than what the stream holds).",
            registry=self.registry,
        )
        self.turns_accepted = Counter(
            "turnbus_gateway_turns_accepted_total",
            "Turns accepted (202), idempotent replays excluded.",
            registry=self.registry,
        )
        self.admission_waiting = Gauge(
            "turnbus_gateway_admission_waiting",
            "Requests waiting for their turn to be worked on (TURNBUS_GATEWAY_ADMIT).",
            registry=self.registry,
        )
        self.admission_waits = Counter(
            "turnbus_gateway_admission_waits_total",
            "Requests that arrived while the gateway was working on TURNBUS_GATEWAY_ADMIT "
            "others, and waited.",
            registry=self.registry,
        )
        self.idempotent_replays = Counter(
            "turnbus_gateway_idempotent_replays_total",
            "Turn submissions answered from an earlier request with the same Idempotency-Key.",
            registry=self.registry,
        )


class MetricsMiddleware:
    """Pure ASGI (streams pass through untouched): counts and times every HTTP request."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics
        # Each label set's counter and histogram, looked up once: ``labels()`` checks
        # its arguments and takes a lock on every call.
        self._series: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = scope.get("route")
            template = (
                route.path
                if isinstance(route, BaseRoute) and hasattr(route, "path")
                else "unmatched"
            )
            key = (template, str(scope.get("method", "?")), status)
            series = self._series.get(key)
            if series is None:
                labels = (*key[:2], str(status))
                series = self.metrics.requests.labels(*labels), self.metrics.latency.labels(*labels)
                self._series[key] = series
            series[0].inc()
            series[1].observe(time.perf_counter() - started)

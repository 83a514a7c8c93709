"""The app factory: routes, middleware, error handlers, and the lifespan that owns the clients."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import BaseRoute
from starlette.types import Lifespan, Receive, Scope, Send

from turnbus.gateway import console_page, errors
from turnbus.gateway.admission import Admission
from turnbus.gateway.auth import TokenVerifier, check_secret
from turnbus.gateway.hub import SseHub
from turnbus.gateway.metrics import GatewayMetrics, MetricsMiddleware
from turnbus.gateway.openapi import build_openapi
from turnbus.gateway.router import IndexedRouter
from turnbus.gateway.routes import events, health, models, sessions, tools, turns, users
from turnbus.gateway.routes.spec import api_routes
from turnbus.gateway.sse import RAW_SEND
from turnbus.gateway.state import Gateway
from turnbus.shared import tracing
from turnbus.shared.connect import check_cluster_mode, connect, connection_options
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import Keys
from turnbus.shared.replicas import NotReplicated, ReplicaWait
from turnbus.shared.settings import Settings, SettingsError
from turnbus.shared.turns import TurnStore

__all__ = ["create_app", "gateway_routes"]


# The API the gateway serves, in the order of its paths; each handler declares its
# method, path and answers (routes/spec.py).
_API = (
    health.index,
    health.healthz,
    health.readyz,
    health.metrics,
    health.openapi,
    models.list_models,
    sessions.list_sessions,
    sessions.create_session,
    tools.list_tools,
    users.erase_user,
    sessions.get_session,
    sessions.delete_session,
    sessions.put_meta,
    sessions.get_notes,
    sessions.get_system,
    sessions.get_messages,
    events.session_events,
    turns.submit_turn,
    turns.get_turn,
    turns.cancel_turn,
    turns.submit_actions,
    events.turn_events,
)


def gateway_routes() -> list[BaseRoute]:
    """The gateway's route table: the API, then the console (a page for browsers, not
    part of the API: left out of the OpenAPI document)."""
    page = console_page.routes()
    for route in page:
        route.include_in_schema = False
    return [*api_routes(_API), *page]


class _GatewayApp(Starlette):
    """Starlette, keeping the server's ``send`` in the scope for SSE body chunks, with a
    route lookup that asks only the routes that can match (:class:`IndexedRouter`)."""

    def __init__(
        self, *, routes: list[BaseRoute], lifespan: Lifespan[Starlette], **kwargs: Any
    ) -> None:
        super().__init__(lifespan=lifespan, **kwargs)
        # Starlette's trailing-slash redirect builds its Location from the Host header;
        # a path with a stray slash is a 404 like any other unknown path.
        self.router = IndexedRouter(routes, lifespan=lifespan, redirect_slashes=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[RAW_SEND] = send
        try:
            await super().__call__(scope, receive, send)
        finally:
            # The server's request cycle holds the scope and ``send`` is that cycle's
            # method: kept, it would make a cycle of every request's objects that only
            # the garbage collector frees, in passes that stop the gateway for tens of
            # milliseconds at thousands of requests.
            del scope[RAW_SEND]


def create_app(settings: Settings) -> Starlette:
    """The gateway's ASGI app. Its lifespan opens and closes the Redis client and the SSE hub."""
    if not settings.jwt_secret:
        raise SettingsError("TURNBUS_JWT_SECRET is required: the gateway has no auth-off mode")
    check_secret(settings.jwt_secret)
    connection_options(settings)  # a Redis URL the client cannot honour stops us here
    keys = Keys(settings.prefix)
    metrics = GatewayMetrics()
    tokens = TokenVerifier(
        settings.jwt_secret,
        max_ttl_s=settings.token_max_ttl_s,
        cache_size=settings.token_cache_size,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        traced = tracing.start(settings, "turnbus-gateway")
        # Every request's commands share one pipelined connection per node (shared.connect).
        client = connect(settings, "gateway")
        hub = SseHub(
            settings,
            client,
            keys,
            queue_size=settings.sse_queue_size,
            metrics=metrics,
        )
        app.state.gateway = Gateway(
            settings=settings,
            keys=keys,
            metrics=metrics,
            redis=client,
            envelopes=EnvelopeStore(
                client,
                keys,
                log_maxlen=settings.log_maxlen,
                replicas=ReplicaWait.from_settings(settings),
                session_ttl_ms=settings.session_ttl_ms,
            ),
            turns=TurnStore(client, keys, settings),
            hub=hub,
            tokens=tokens,
        )
        try:
            await check_cluster_mode(client, settings)
            await hub.start()
            yield
        finally:
            await hub.close()
            await client.aclose()
            if traced:
                tracing.stop()  # the spans still held are exported

    # Metrics outermost: a request's time includes its wait for admission.
    middleware = [Middleware(MetricsMiddleware, metrics=metrics)]
    if settings.gateway_admit:
        middleware.append(Middleware(Admission, limit=settings.gateway_admit, metrics=metrics))
    if settings.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(settings.cors_origins),
                allow_methods=["GET", "POST", "PUT", "DELETE"],
                allow_headers=[
                    "Authorization",
                    "Content-Type",
                    "Idempotency-Key",
                    "Last-Event-ID",
                    # A browser's tracing sends its trace context with the submit.
                    "traceparent",
                    "tracestate",
                ],
                expose_headers=["Location", "Idempotent-Replayed", "X-Turn-Id"],
                max_age=600,
            )
        )
    app = _GatewayApp(
        routes=gateway_routes(),
        middleware=middleware,
        exception_handlers={
            errors.ApiError: errors.handle_api_error,
            HTTPException: errors.handle_http_exception,
            NotReplicated: errors.handle_not_replicated,
            RedisConnectionError: errors.handle_unavailable,
            RedisTimeoutError: errors.handle_unavailable,
            Exception: errors.handle_internal,
        },
        lifespan=lifespan,
    )
    app.state.metrics = metrics
    app.state.openapi = msgspec.json.encode(build_openapi(app.routes))
    return app

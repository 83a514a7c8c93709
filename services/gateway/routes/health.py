"""The index, liveness, readiness, metrics and the OpenAPI document: no auth."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import BusyLoadingError, RedisError
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from turnbus.gateway.errors import UNAVAILABLE_RETRY_AFTER_S, error_response
from turnbus.gateway.routes.spec import Answer, Operation
from turnbus.gateway.schemas import HealthBody, IndexBody, IndexLinks
from turnbus.gateway.state import gateway_of
from turnbus.shared.version import VERSION

__all__ = ["healthz", "index", "metrics", "openapi", "readyz"]

READY_TIMEOUT_S = 1.0

_ok = msgspec.json.encode(HealthBody(status="ok"))
_index = msgspec.json.encode(
    IndexBody(
        name="turnbus",
        version=VERSION,
        links=IndexLinks(
            console="/console",
            openapi="/openapi.json",
            sessions="/v1/sessions",
            health="/healthz",
            ready="/readyz",
            metrics="/metrics",
        ),
    )
)


def _wants_html(request: Request) -> bool:
    """A browser's navigation: its Accept names HTML (an API client's names JSON or ``*/*``)."""
    accept = request.headers.get("accept", "")
    return any(part.split(";")[0].strip() == "text/html" for part in accept.split(","))


@Operation(
    "GET",
    "/",
    "index",
    summary="Where to go: a browser (Accept: text/html) is sent on to the console; an API "
    "client gets this index",
    answers={200: Answer("the index", IndexBody), 303: Answer("to /console, for a browser")},
    public=True,
)
async def index(request: Request) -> Response:
    """``GET /``: a browser goes on to the console (the URL's ``#token=…`` fragment goes
    with it); an API client gets a small JSON index of where to go."""
    if _wants_html(request):
        # Relative, so the Host header never builds it; 303: a GET of the console.
        return RedirectResponse("/console", status_code=303)
    return Response(_index, media_type="application/json")


@Operation(
    "GET",
    "/healthz",
    "healthz",
    summary="Liveness",
    answers={200: Answer("alive", HealthBody)},
    public=True,
)
async def healthz(request: Request) -> Response:
    return Response(_ok, media_type="application/json")


@Operation(
    "GET",
    "/readyz",
    "readyz",
    summary="Readiness: Redis answers",
    answers={200: Answer("ready", HealthBody)},
    errors=["unavailable"],
    public=True,
)
async def readyz(request: Request) -> Response:
    """200 once Redis answers PING; 503 while it is unreachable or loading its data."""
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            await gateway_of(request).redis.ping()
    except BusyLoadingError:
        return error_response(
            "unavailable",
            "Redis is loading its data after a restart",
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
        )
    except (RedisError, OSError, TimeoutError):
        return error_response(
            "unavailable",
            "Redis is unreachable",
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
        )
    return Response(_ok, media_type="application/json")


@Operation(
    "GET",
    "/metrics",
    "metrics",
    summary="Prometheus metrics",
    answers={200: Answer("Prometheus text exposition", media_type="text/plain")},
    public=True,
)
async def metrics(request: Request) -> Response:
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@Operation(
    "GET",
    "/openapi.json",
    "openapi",
    summary="This document: every route the gateway serves",
    answers={200: Answer("the OpenAPI 3.1 document", dict[str, Any])},
    public=True,
)
async def openapi(request: Request) -> Response:
    document: bytes = request.app.state.openapi
    return Response(document, media_type="application/json")

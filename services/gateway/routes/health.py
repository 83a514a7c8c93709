"""Liveness, readiness, metrics and the OpenAPI document: no auth."""

from __future__ import annotations

import asyncio

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import BusyLoadingError, RedisError
from starlette.requests import Request
from starlette.responses import Response

from turnbus.gateway.errors import UNAVAILABLE_RETRY_AFTER_S, error_response
from turnbus.gateway.schemas import HealthBody
from turnbus.gateway.state import gateway_of

__all__ = ["healthz", "metrics", "openapi", "readyz"]

READY_TIMEOUT_S = 1.0

_ok = msgspec.json.encode(HealthBody(status="ok"))


async def healthz(request: Request) -> Response:
    return Response(_ok, media_type="application/json")


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


async def metrics(request: Request) -> Response:
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    document: bytes = request.app.state.openapi
    return Response(document, media_type="application/json")

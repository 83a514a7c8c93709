"""API errors: one exception class, one JSON shape, stable codes.

Every error answers ``{"error": {"code", "message"}}`` (plus ``field``,
``activeTurnId`` or ``turnId`` where they help a client act on it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from redis.exceptions import BusyLoadingError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from turnbus.gateway.schemas import ErrorBody, ErrorDetail
from turnbus.shared.error_codes import ERROR_CODES

__all__ = [
    "CODES",
    "UNAVAILABLE_RETRY_AFTER_S",
    "ApiError",
    "bad_request",
    "error_response",
    "not_found",
    "payload_too_large",
    "unauthorized",
    "unprocessable",
]

# The status of every code the API answers (the one table is ``shared.error_codes``).
CODES: dict[str, int] = {code: entry.status for code, entry in ERROR_CODES.items()}

_encoder = msgspec.json.Encoder()


class ApiError(Exception):
    """An error answered to the client; ``body`` replaces the default shape when given."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        field: str | None = None,
        active_turn_id: str | None = None,
        turn_id: str | None = None,
        call_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        body: msgspec.Struct | None = None,
    ) -> None:
        super().__init__(message)
        self.status = CODES[code]
        self.detail = ErrorDetail(
            code=code,
            message=message,
            field=field,
            activeTurnId=active_turn_id,
            turnId=turn_id,
            callId=call_id,
        )
        self.headers = dict(headers or {})
        self.body = body


def error_response(
    code: str, message: str, *, headers: Mapping[str, str] | None = None, **extra: Any
) -> Response:
    return api_error_response(ApiError(code, message, headers=headers, **extra))


def api_error_response(exc: ApiError) -> Response:
    body = exc.body if exc.body is not None else ErrorBody(error=exc.detail)
    return Response(
        _encoder.encode(body),
        status_code=exc.status,
        headers=exc.headers,
        media_type="application/json",
    )


def bad_request(message: str, field: str | None = None) -> ApiError:
    return ApiError("bad_request", message, field=field)


def unauthorized(message: str) -> ApiError:
    return ApiError("unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


def not_found(message: str = "no such resource") -> ApiError:
    return ApiError("not_found", message)


def payload_too_large(message: str) -> ApiError:
    return ApiError("payload_too_large", message)


def unprocessable(message: str, field: str | None = None) -> ApiError:
    return ApiError("unprocessable", message, field=field)


async def handle_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return api_error_response(exc)


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        return error_response("not_found", "no such route", headers=headers)
    if exc.status_code == 405:
        return error_response("method_not_allowed", "method not allowed", headers=headers)
    code = {400: "bad_request", 401: "unauthorized", 413: "payload_too_large"}.get(
        exc.status_code, "bad_request" if exc.status_code < 500 else "internal"
    )
    return Response(
        _encoder.encode(ErrorBody(error=ErrorDetail(code=code, message=str(exc.detail)))),
        status_code=exc.status_code,
        headers=headers,
        media_type="application/json",
    )


# Redis answers again within seconds of a blip or a restart's load: retry that soon.
UNAVAILABLE_RETRY_AFTER_S = 1


def _unavailable_message(exc: Exception) -> str:
    if isinstance(exc, BusyLoadingError):
        return "the session store is loading its data after a restart; retry shortly"
    return "the session store is unreachable; retry shortly"


async def handle_not_replicated(request: Request, exc: Exception) -> Response:
    return error_response(
        "not_replicated",
        f"the write reached the primary but is not confirmed by a replica ({exc}); "
        "retry (a submit with the same Idempotency-Key answers with the same turn)",
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
    )


async def handle_unavailable(request: Request, exc: Exception) -> Response:
    return error_response(
        "unavailable",
        _unavailable_message(exc),
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
    )


async def handle_internal(request: Request, exc: Exception) -> Response:
    return error_response("internal", "internal error")

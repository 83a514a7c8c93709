"""Turns: submission (with Idempotency-Key), the turn record, cancel."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from turnbus.gateway.auth import tools_claim
from turnbus.gateway.body import JSON_ESCAPE_FACTOR, decode_json_body, read_body
from turnbus.gateway.errors import (
    ApiError,
    bad_request,
    not_found,
    payload_too_large,
    unprocessable,
)
from turnbus.gateway.routes.events import follow_turn
from turnbus.gateway.schemas import TurnAccepted, TurnRequest
from turnbus.gateway.state import authenticate, gateway_of, path_id
from turnbus.shared import caps
from turnbus.shared.envelope import SessionNotFound
from turnbus.shared.meta import utf8_len
from turnbus.shared.settings import Settings
from turnbus.shared.turns import IdempotencyMismatch, SessionBusy, SessionQueueFull, TurnNotFound
from turnbus.shared.webhooks import WebhookRefused, check_webhook_url

__all__ = ["IDEMPOTENCY_KEY_MAX_CHARS", "cancel_turn", "get_turn", "submit_turn"]

TURN_BODY_MAX_BYTES = JSON_ESCAPE_FACTOR * caps.TURN_MESSAGE_MAX_BYTES + 4096
IDEMPOTENCY_KEY_MAX_CHARS = 255
# A full session queue drains at the speed of its turns: a few seconds is a fair wait.
QUEUE_FULL_RETRY_AFTER_S = 2

_encoder = msgspec.json.Encoder()
_turn_decoder = msgspec.json.Decoder(TurnRequest)


def _json(body: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        _encoder.encode(body), status_code=status, headers=headers, media_type="application/json"
    )


def events_url(session: str, turn_id: str) -> str:
    return f"/v1/sessions/{session}/turns/{turn_id}/events"


def _idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not key or len(key) > IDEMPOTENCY_KEY_MAX_CHARS or not key.isprintable():
        raise bad_request(
            f"Idempotency-Key must be 1 to {IDEMPOTENCY_KEY_MAX_CHARS} printable characters",
            field="Idempotency-Key",
        )
    return key


async def submit_turn(request: Request) -> Response:
    user = authenticate(request)
    session = path_id(request, "session_id", "session")
    idempotency_key = _idempotency_key(request)
    body = decode_json_body(await read_body(request, TURN_BODY_MAX_BYTES), _turn_decoder)
    size = utf8_len(body.message)
    if size is None:
        raise unprocessable("message is not valid UTF-8 text", field="message")
    if size > caps.TURN_MESSAGE_MAX_BYTES:
        raise payload_too_large(
            f"message is {size} bytes; the limit is {caps.TURN_MESSAGE_MAX_BYTES} bytes"
        )
    if not body.message.strip():
        raise unprocessable("message must be a non-empty string", field="message")
    gateway = gateway_of(request)
    webhook_url = _webhook_url(body, gateway.settings)
    try:
        record, replayed, queued = await gateway.turns.submit_queued(
            user,
            session,
            body.message,
            multitask=body.multitask,
            idempotency_key=idempotency_key,
            allowed_tools=tools_claim(request),
            webhook_url=webhook_url,
        )
    except SessionNotFound:
        raise not_found("no such session") from None
    except SessionBusy as exc:
        raise ApiError(
            "session_busy",
            f"the session already has an active turn {exc.active_turn_id}; wait for it, "
            "cancel it, or submit with multitask=enqueue",
            active_turn_id=exc.active_turn_id,
        ) from None
    except SessionQueueFull as exc:
        raise ApiError(
            "session_queue_full",
            f"the session already has {exc.active} unfinished turns (the limit is {exc.limit}); "
            "retry after one ends",
            headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
        ) from None
    except IdempotencyMismatch as exc:
        raise ApiError(
            "conflict",
            f"this Idempotency-Key was used for turn {exc.turn_id} with a different body",
            field="Idempotency-Key",
            turn_id=exc.turn_id,
        ) from None
    except TurnNotFound:
        # The replayed turn's record is gone (its session was deleted and re-made).
        raise ApiError(
            "conflict", "this Idempotency-Key names a turn that no longer exists"
        ) from None
    headers = {"Location": f"/v1/sessions/{session}/turns/{record.turnId}"}
    if replayed:
        gateway.metrics.idempotent_replays.inc()
        headers["Idempotent-Replayed"] = "true"
    else:
        gateway.metrics.turns_accepted.inc()
    if _wants_stream(request):
        # Submit and follow in one request: the turn's events from its first.
        headers["X-Turn-Id"] = record.turnId
        return follow_turn(gateway, user, session, record, queued=queued, headers=headers)
    accepted = TurnAccepted(
        turnId=record.turnId, status=record.status, eventsUrl=events_url(session, record.turnId)
    )
    return _json(accepted, 202, headers)


def _webhook_url(body: TurnRequest, settings: Settings) -> str | None:
    """The turn's webhook: the submit's, checked against the allow-list, else the
    deployment's default (checked at start)."""
    if body.webhook is None:
        return settings.webhook_url
    if settings.webhook_secret is None:
        raise ApiError(
            "webhook_not_allowed",
            "this deployment sends no webhooks (it has no TURNBUS_WEBHOOK_SECRET)",
            field="webhook.url",
        )
    try:
        return check_webhook_url(body.webhook.url, settings.webhook_allow)
    except WebhookRefused as exc:
        raise ApiError("webhook_not_allowed", str(exc), field="webhook.url") from None


def _wants_stream(request: Request) -> bool:
    """``Accept: text/event-stream``: the submit answers with the turn's event stream."""
    accept = request.headers.get("accept", "")
    return "text/event-stream" in accept.lower()


async def get_turn(request: Request) -> Response:
    user = authenticate(request)
    session = path_id(request, "session_id", "session")
    turn_id = path_id(request, "turn_id", "turn")
    record = await gateway_of(request).turns.get(user, session, turn_id)
    if record is None:
        raise not_found("no such turn")
    return _json(record)


async def cancel_turn(request: Request) -> Response:
    user = authenticate(request)
    session = path_id(request, "session_id", "session")
    turn_id = path_id(request, "turn_id", "turn")
    try:
        record = await gateway_of(request).turns.request_cancel(user, session, turn_id)
    except TurnNotFound:
        raise not_found("no such turn") from None
    return _json(record, 202)

"""Turns: submission (with Idempotency-Key), the turn record, cancel."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from turnbus.gateway.auth import quotas_claim, tools_claim
from turnbus.gateway.body import JSON_ESCAPE_FACTOR, decode_json_body, read_body
from turnbus.gateway.errors import (
    ApiError,
    bad_request,
    not_found,
    payload_too_large,
    unprocessable,
)
from turnbus.gateway.routes.events import follow_turn
from turnbus.gateway.routes.spec import LOCATION, SESSION_PATH, TURN_PATH, Answer, Operation, header
from turnbus.gateway.schemas import ActionsRequest, TurnAccepted, TurnRequest
from turnbus.gateway.state import authenticate, gateway_of, path_id
from turnbus.shared import caps, tracing
from turnbus.shared.client_tools import ClientToolsInvalid, check_client_tools
from turnbus.shared.envelope import SessionNotFound
from turnbus.shared.meta import utf8_len
from turnbus.shared.quotas import QuotaExceeded, QuotaLimits
from turnbus.shared.records import TurnRecord
from turnbus.shared.settings import Settings
from turnbus.shared.tool_specs import read_published_tools
from turnbus.shared.turns import (
    ActionsInvalid,
    IdempotencyMismatch,
    SessionBusy,
    SessionQueueFull,
    TurnNotFound,
    TurnNotWaiting,
)
from turnbus.shared.webhooks import WebhookRefused, check_webhook_url

__all__ = ["IDEMPOTENCY_KEY_MAX_CHARS", "cancel_turn", "get_turn", "submit_actions", "submit_turn"]

TURN_BODY_MAX_BYTES = (
    JSON_ESCAPE_FACTOR * (caps.TURN_MESSAGE_MAX_BYTES + caps.CLIENT_TOOLS_MAX_BYTES) + 4096
)
IDEMPOTENCY_KEY_MAX_CHARS = 255
# An answer carries at most a result per client tool call; each is cut to the tool
# result cap when stored.
ACTIONS_BODY_MAX_BYTES = JSON_ESCAPE_FACTOR * 1024 * 1024
# A full session queue drains at the speed of its turns: a few seconds is a fair wait.
QUEUE_FULL_RETRY_AFTER_S = 2

_encoder = msgspec.json.Encoder()
# What each quota counts, for the 429's sentence.
_QUOTA_WHAT = {
    "runningTurns": "sessions with a turn running or about to start",
    "queuedTurns": "turns waiting behind their session's running turn",
    "turnsPerMinute": "turns accepted this minute",
    "tokensPerDay": "model tokens used today, UTC",
}
_IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "minLength": 1, "maxLength": IDEMPOTENCY_KEY_MAX_CHARS},
}
# Response links (OpenAPI 3 `links`): from an accepted turn to its record, events and
# cancel, each path parameter filled.
_FROM_TURN = {"session_id": "$request.path.session_id", "turn_id": "$response.body#/turnId"}
_TURN_LINKS = {
    "GetTurn": {"operationId": "getTurn", "parameters": _FROM_TURN},
    "TurnEvents": {"operationId": "turnEvents", "parameters": _FROM_TURN},
    "CancelTurn": {"operationId": "cancelTurn", "parameters": _FROM_TURN},
}
_REPLAYED = header(
    "`true` when answered from an earlier request with this key", required=False, const="true"
)
_turn_decoder = msgspec.json.Decoder(TurnRequest)
_actions_decoder = msgspec.json.Decoder(ActionsRequest)


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


# The submit's span: an HTTP server span, the root of the turn's trace (or a child of the
# client's, when the request carries a traceparent).
_SUBMIT_ROUTE = SESSION_PATH + "/turns"
_SUBMIT_SPAN = f"POST {_SUBMIT_ROUTE}"
_SUBMIT_ATTRIBUTES: dict[str, tracing.AttributeValue | None] = {
    "http.request.method": "POST",
    "http.route": _SUBMIT_ROUTE,
}


def _trace_context(request: Request) -> dict[str, str] | None:
    """The request's W3C trace context (``traceparent``, ``tracestate``), if it has one."""
    headers = request.headers
    if "traceparent" not in headers:
        return None
    return {name: headers[name] for name in tracing.CARRIER_FIELDS if name in headers}


@Operation(
    "POST",
    _SUBMIT_ROUTE,
    "submitTurn",
    summary="Submit a turn",
    description=(
        "With `Accept: text/event-stream` the answer is `200` with the turn's event stream "
        "from its first event, as `GET …/turns/{turn_id}/events` sends it (headers "
        "`Location` and `X-Turn-Id` name the turn): submit and follow in one request. "
        "Errors are JSON, as without it."
    ),
    parameters=[_IDEMPOTENCY_KEY],
    body=TurnRequest,
    answers={
        202: Answer(
            "accepted (or replayed for the same key)",
            TurnAccepted,
            headers={"Location": LOCATION, "Idempotent-Replayed": _REPLAYED},
            links=_TURN_LINKS,
        )
    },
    errors=[
        "conflict",
        "session_busy",
        "webhook_not_allowed",
        "session_queue_full",
        "quota_exceeded",
        "not_replicated",
    ],
)
async def submit_turn(request: Request) -> Response:
    parent = _trace_context(request) if tracing.enabled() else None
    with tracing.span(_SUBMIT_SPAN, _SUBMIT_ATTRIBUTES, parent=parent, kind="server") as span:
        try:
            response = await _submit_turn(request, span)
        except ApiError as exc:
            span.set("http.response.status_code", exc.status)
            span.failed(exc.detail.code)
            raise
        span.set("http.response.status_code", response.status_code)
        return response


async def _submit_turn(request: Request, span: tracing.Span) -> Response:
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
    span.set("gen_ai.conversation.id", session)
    if body.clientTools:
        # The names the session's rounds may be offered besides: a registered tool's
        # (one Redis call, made only for a submit that declares client tools).
        taken = await read_published_tools(gateway.redis, gateway.keys)
        try:
            check_client_tools(body.clientTools, taken)
        except ClientToolsInvalid as exc:
            raise unprocessable(f"{exc.field} {exc}", field=exc.field) from None
    limits = QuotaLimits.of(gateway.settings, quotas_claim(request))
    try:
        record, replayed, queued = await gateway.turns.submit_queued(
            user,
            session,
            body.message,
            multitask=body.multitask,
            idempotency_key=idempotency_key,
            allowed_tools=tools_claim(request),
            trace=span.carrier(),
            client_tools=body.clientTools,
            action_timeout_s=body.actionTimeoutS,
            limits=limits,
            webhook_url=webhook_url,
        )
    except SessionNotFound:
        raise not_found("no such session") from None
    except SessionBusy as exc:
        raise ApiError(
            "session_busy",
            f"the session already has an active turn {exc.active_turn_id}; wait for it, "
            "cancel it, or submit with multitask=enqueue or multitask=interrupt",
            active_turn_id=exc.active_turn_id,
        ) from None
    except SessionQueueFull as exc:
        raise ApiError(
            "session_queue_full",
            f"the session already has {exc.active} unfinished turns (the limit is {exc.limit}); "
            "retry after one ends",
            headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
        ) from None
    except QuotaExceeded as exc:
        raise ApiError(
            "quota_exceeded",
            f"over your {exc.field} quota ({exc.limit}; {_QUOTA_WHAT[exc.field]}); "
            f"retry after {exc.retry_after_s} s",
            field=exc.field,
            headers={"Retry-After": str(exc.retry_after_s)},
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
    span.set("turnbus.turn.id", record.turnId)
    headers = {"Location": f"/v1/sessions/{session}/turns/{record.turnId}"}
    if replayed:
        span.set("turnbus.turn.replayed", True)
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


@Operation(
    "GET",
    TURN_PATH,
    "getTurn",
    summary="The turn record",
    answers={200: Answer("the turn record", TurnRecord)},
)
async def get_turn(request: Request) -> Response:
    user = authenticate(request)
    session = path_id(request, "session_id", "session")
    turn_id = path_id(request, "turn_id", "turn")
    record = await gateway_of(request).turns.get(user, session, turn_id)
    if record is None:
        raise not_found("no such turn")
    return _json(record)


@Operation(
    "POST",
    TURN_PATH + "/cancel",
    "cancelTurn",
    summary="Cancel a turn (queued: at once; running: signalled)",
    answers={202: Answer("the turn record", TurnRecord)},
    errors=["not_replicated"],
)
async def cancel_turn(request: Request) -> Response:
    user = authenticate(request)
    session = path_id(request, "session_id", "session")
    turn_id = path_id(request, "turn_id", "turn")
    try:
        record = await gateway_of(request).turns.request_cancel(user, session, turn_id)
    except TurnNotFound:
        raise not_found("no such turn") from None
    return _json(record, 202)


@Operation(
    "POST",
    TURN_PATH + "/actions",
    "submitActions",
    summary="Answer the calls a turn paused for (requires_action)",
    description=(
        "Every pending call (`pendingCalls` of the record, `calls` of "
        "`turn.requires_action`) is answered in one request: a client call (`kind: "
        "client`) in `toolResults`, a call awaiting approval (`kind: approval`) in "
        "`approvals` (approve, edit with a new input, or reject with a reason); the turn "
        "goes back to `queued` and any worker resumes it at its next round."
    ),
    parameters=[_IDEMPOTENCY_KEY],
    body=ActionsRequest,
    answers={202: Answer("the turn record, queued again", TurnRecord)},
    errors=[
        "conflict",
        "turn_not_waiting",
        "unknown_call",
        "missing_call",
        "duplicate_call",
        "wrong_answer",
        "not_replicated",
    ],
)
async def submit_actions(request: Request) -> Response:
    """The caller's answer to a turn paused for it (``requires_action``): a result for
    every pending client call and a decision for every call awaiting approval, stored with the turn's move back to ``queued``; ``202`` with the
    turn record. A repeat under the same ``Idempotency-Key`` answers the same."""
    user = authenticate(request)
    session = path_id(request, "session_id", "session")
    turn_id = path_id(request, "turn_id", "turn")
    idempotency_key = _idempotency_key(request)
    body = decode_json_body(await read_body(request, ACTIONS_BODY_MAX_BYTES), _actions_decoder)
    try:
        gateway = gateway_of(request)
        schemas: dict[str, dict[str, Any]] = {}
        if any(a.decision == "edit" for a in body.approvals):
            published = await read_published_tools(gateway.redis, gateway.keys)
            schemas = {name: tool.inputSchema for name, tool in published.items()}
        record, replayed = await gateway.turns.submit_actions(
            user,
            session,
            turn_id,
            body.toolResults,
            approvals=body.approvals,
            schemas=schemas,
            idempotency_key=idempotency_key,
        )
    except TurnNotFound:
        raise not_found("no such turn") from None
    except TurnNotWaiting as exc:
        raise ApiError(
            "turn_not_waiting", f"{exc}; only a turn in requires_action takes an answer"
        ) from None
    except ActionsInvalid as exc:
        raise ApiError(exc.code, str(exc), field=exc.field, call_id=exc.call_id) from None
    except IdempotencyMismatch:
        raise ApiError(
            "conflict",
            "this Idempotency-Key was used for an answer to this turn with a different body",
            field="Idempotency-Key",
        ) from None
    headers = {"Idempotent-Replayed": "true"} if replayed else None
    return _json(record, 202, headers)

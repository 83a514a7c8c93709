"""Sessions: list, create, read, host replace of meta, delete, notes, system prompt, history."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from turnbus.gateway.body import JSON_ESCAPE_FACTOR, decode_json_body, read_body
from turnbus.gateway.errors import (
    ApiError,
    bad_request,
    not_found,
    payload_too_large,
    unprocessable,
)
from turnbus.gateway.routes.spec import LOCATION, SESSION_PATH, Answer, Operation
from turnbus.gateway.routes.tools import check_allowed_tools
from turnbus.gateway.schemas import (
    ConflictBody,
    CreateSessionRequest,
    ErrorDetail,
    MessagesResponse,
    ModelMessage,
    NotesResponse,
    PutMetaRequest,
)
from turnbus.gateway.state import authenticate, gateway_of, path_id
from turnbus.shared import caps
from turnbus.shared.contracts import THINKING_BLOCK_TYPES
from turnbus.shared.envelope import (
    ClockAhead,
    Envelope,
    EnvelopeConflict,
    SessionExists,
    SessionNotFound,
)
from turnbus.shared.meta import WORKER_META_KEYS, Meta, MetaInvalid, MetaTooLarge, utf8_len
from turnbus.shared.providers import provider_of
from turnbus.shared.records import SessionPage, new_session_id
from turnbus.shared.session_index import LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX, BadCursor
from turnbus.shared.settings import Settings
from turnbus.shared.system import resolve_system

__all__ = [
    "create_session",
    "delete_session",
    "get_messages",
    "get_notes",
    "get_session",
    "get_system",
    "list_sessions",
    "put_meta",
]

log = logging.getLogger(__name__)

META_BODY_MAX_BYTES = JSON_ESCAPE_FACTOR * caps.HARNESS_SESSION_MAX_META_BYTES + 64 * 1024

_encoder = msgspec.json.Encoder()
_create_decoder = msgspec.json.Decoder(CreateSessionRequest)
_put_decoder = msgspec.json.Decoder(PutMetaRequest)
_message_decoder = msgspec.json.Decoder(ModelMessage)
_row_decoder = msgspec.json.Decoder(dict[str, Any])

_LIST_PARAMETERS = [
    {
        "name": "limit",
        "in": "query",
        "required": False,
        "description": f"Sessions per page (default {LIST_LIMIT_DEFAULT}).",
        "schema": {
            "type": "integer",
            "minimum": 1,
            "maximum": LIST_LIMIT_MAX,
            "default": LIST_LIMIT_DEFAULT,
        },
    },
    {
        "name": "cursor",
        "in": "query",
        "required": False,
        "description": "The previous page's nextCursor (opaque); absent for the first page.",
        "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]+$"},
    },
]
# Response links (OpenAPI 3 `links`): how a client (or a stateful fuzzer) gets from a
# created session to its turns, log and meta. Each names an operationId and fills every
# path parameter.
_FROM_SESSION = {"session_id": "$response.body#/sessionId"}
_SESSION_LINKS = {
    "GetSession": {"operationId": "getSession", "parameters": _FROM_SESSION},
    "PutMeta": {"operationId": "putMeta", "parameters": _FROM_SESSION},
    "SubmitTurn": {"operationId": "submitTurn", "parameters": _FROM_SESSION},
    "SessionEvents": {"operationId": "sessionEvents", "parameters": _FROM_SESSION},
}
# What a meta the host writes (at creation or with PUT) may be refused for.
_META_CODES = ["unknown_provider", "unknown_tool"]


def _json(body: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        _encoder.encode(body), status_code=status, headers=headers, media_type="application/json"
    )


def _session_not_found() -> ApiError:
    return not_found("no such session")


def _meta_error(exc: MetaInvalid | MetaTooLarge) -> ApiError:
    if isinstance(exc, MetaTooLarge):
        return payload_too_large(str(exc))
    field = exc.key if exc.key == "updatedAt" else f"meta.{exc.key}"
    return unprocessable(str(exc), field=field)


async def _envelope(request: Request) -> tuple[str, str, Envelope]:
    user = authenticate(request)
    session = path_id(request, "session_id", "session")
    envelope = await gateway_of(request).envelopes.read(user, session)
    if envelope is None:
        raise _session_not_found()
    return user, session, envelope


def _refuse_worker_keys(meta: Meta) -> None:
    """A new session starts with no notes and no turn state: those keys are the worker's."""
    for key in WORKER_META_KEYS:
        if getattr(meta, key) is not None:
            raise unprocessable(
                f"{key} is worker-owned: a new session starts without it "
                "(only host-owned keys may be set at creation)",
                field=f"meta.{key}",
            )


def _refuse_unknown_provider(meta: Meta | None, settings: Settings) -> None:
    """A selectedModel naming a provider this deployment has not configured is refused
    now, not when a turn runs (the workers read the same provider settings)."""
    if meta is None:
        return
    names = settings.provider_names
    unknown = provider_of(meta.selectedModel, names)
    if unknown is not None and unknown != settings.model:
        raise ApiError(
            "unknown_provider",
            f"selectedModel names the provider {unknown!r}, which is not configured "
            f"(configured: {', '.join(sorted(names))}; a bare model name runs on the "
            f"default, {settings.model!r})",
            field="meta.selectedModel",
        )


def _list_limit(request: Request) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return LIST_LIMIT_DEFAULT
    if not (raw.isascii() and raw.isdigit() and 1 <= int(raw) <= LIST_LIMIT_MAX):
        raise bad_request(f"limit must be an integer from 1 to {LIST_LIMIT_MAX}", field="limit")
    return int(raw)


@Operation(
    "GET",
    "/v1/sessions",
    "listSessions",
    summary="The caller's sessions, newest first (by creation), cursor paged",
    parameters=_LIST_PARAMETERS,
    answers={200: Answer("a page of sessions; nextCursor null on the last", SessionPage)},
    errors=["bad_request"],
)
async def list_sessions(request: Request) -> Response:
    user = authenticate(request)
    limit = _list_limit(request)
    cursor = request.query_params.get("cursor")
    try:
        page = await gateway_of(request).envelopes.index.page(user, cursor=cursor, limit=limit)
    except BadCursor as exc:
        raise bad_request(f"{exc}: start again without one", field="cursor") from None
    return _json(page)


@Operation(
    "POST",
    "/v1/sessions",
    "createSession",
    summary="Create a session (optional initial host meta)",
    body=CreateSessionRequest,
    body_required=False,
    answers={
        201: Answer(
            "the new session's envelope",
            Envelope,
            headers={"Location": LOCATION},
            links=_SESSION_LINKS,
        )
    },
    errors=["conflict", *_META_CODES, "not_replicated"],
)
async def create_session(request: Request) -> Response:
    user = authenticate(request)
    raw = await read_body(request, META_BODY_MAX_BYTES)
    body = decode_json_body(raw, _create_decoder) if raw.strip() else CreateSessionRequest()
    if body.meta is not None:
        _refuse_worker_keys(body.meta)
        _refuse_unknown_provider(body.meta, gateway_of(request).settings)
        await check_allowed_tools(gateway_of(request), body.meta)
    session = new_session_id()
    try:
        envelope = await gateway_of(request).envelopes.create(user, session, body.meta)
    except (MetaInvalid, MetaTooLarge) as exc:
        raise _meta_error(exc) from None
    except SessionExists:
        raise ApiError("conflict", "session id collision; retry") from None
    return _json(envelope, 201, {"Location": f"/v1/sessions/{session}"})


@Operation(
    "GET",
    SESSION_PATH,
    "getSession",
    summary="The envelope, poison dropped",
    answers={200: Answer("the envelope", Envelope)},
)
async def get_session(request: Request) -> Response:
    _, _, envelope = await _envelope(request)
    return _json(envelope)


@Operation(
    "PUT",
    SESSION_PATH + "/meta",
    "putMeta",
    summary="Host replace of the meta (LWW on updatedAt)",
    body=PutMetaRequest,
    answers={
        200: Answer("the envelope after the write", Envelope),
        409: Answer("conflict: stale updatedAt; the current envelope", ConflictBody),
    },
    errors=["conflict", "clock_ahead", *_META_CODES, "not_replicated"],
)
async def put_meta(request: Request) -> Response:
    user = authenticate(request)
    session = path_id(request, "session_id", "session")
    body = decode_json_body(await read_body(request, META_BODY_MAX_BYTES), _put_decoder)
    _refuse_unknown_provider(body.meta, gateway_of(request).settings)
    await check_allowed_tools(gateway_of(request), body.meta)
    try:
        envelope = await gateway_of(request).envelopes.host_replace(
            user, session, body.updatedAt, body.meta
        )
    except (MetaInvalid, MetaTooLarge) as exc:
        raise _meta_error(exc) from None
    except SessionNotFound:
        raise _session_not_found() from None
    except ClockAhead as exc:
        raise ApiError("clock_ahead", str(exc), field="updatedAt") from None
    except EnvelopeConflict as exc:
        detail = ErrorDetail(code="conflict", message=str(exc), field="updatedAt")
        raise ApiError(
            "conflict", str(exc), body=ConflictBody(error=detail, current=exc.current)
        ) from None
    return _json(envelope)


@Operation(
    "DELETE",
    SESSION_PATH,
    "deleteSession",
    summary="Delete the session and every key of it",
    answers={204: Answer("deleted")},
    errors=["not_replicated"],
)
async def delete_session(request: Request) -> Response:
    user = authenticate(request)
    session = path_id(request, "session_id", "session")
    if not await gateway_of(request).envelopes.delete(user, session):
        raise _session_not_found()
    return Response(status_code=204)


@Operation(
    "GET",
    SESSION_PATH + "/notes",
    "getNotes",
    summary="The working notes and their UTF-8 size",
    answers={200: Answer("the notes", NotesResponse)},
)
async def get_notes(request: Request) -> Response:
    _, _, envelope = await _envelope(request)
    notes = envelope.meta.workingNotes
    size = (utf8_len(notes) or 0) if notes is not None else 0
    return _json(NotesResponse(notes=notes, bytes=size))


@Operation(
    "GET",
    SESSION_PATH + "/system",
    "getSystem",
    summary="The resolved system prompt, byte-identical to the worker's",
    answers={200: Answer("the system prompt", media_type="text/plain")},
)
async def get_system(request: Request) -> Response:
    _, _, envelope = await _envelope(request)
    meta = envelope.meta
    text = resolve_system(
        persona=meta.personaSnapshot, notes=meta.workingNotes, skills=meta.attachedSkills
    )
    return PlainTextResponse(text)


@Operation(
    "GET",
    SESSION_PATH + "/messages",
    "getMessages",
    summary="The model-facing history (Anthropic message format)",
    answers={200: Answer("the history", MessagesResponse)},
)
async def get_messages(request: Request) -> Response:
    user = authenticate(request)
    session = path_id(request, "session_id", "session")
    gateway = gateway_of(request)
    async with gateway.redis.pipeline(transaction=False) as pipe:
        pipe.exists(gateway.keys.env(user, session))
        pipe.lrange(gateway.keys.messages(user, session), 0, -1)
        exists, items = await pipe.execute()
    if not exists:
        raise _session_not_found()
    kept: list[bytes] = []
    for item in items:
        raw = item.encode("utf-8", "surrogateescape") if isinstance(item, str) else item
        try:
            message = _message_decoder.decode(raw)
        except msgspec.DecodeError:
            log.warning("skipping an undecodable history row of session %s", session)
            continue
        if b"thinking" in raw and isinstance(message.content, list):
            # Chain of thought is never served (the running turn's rows may hold some).
            blocks = [b for b in message.content if b.get("type") not in THINKING_BLOCK_TYPES]
            if len(blocks) != len(message.content):
                row = _row_decoder.decode(raw)
                row["content"] = blocks
                raw = _encoder.encode(row)
        kept.append(raw)
    return Response(b'{"messages":[' + b",".join(kept) + b"]}", media_type="application/json")

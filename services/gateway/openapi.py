"""The OpenAPI 3.1 document, generated from the same msgspec types the routes use."""

from __future__ import annotations

from typing import Any

import msgspec

from turnbus.gateway.routes.turns import IDEMPOTENCY_KEY_MAX_CHARS
from turnbus.gateway.schemas import (
    ActionsRequest,
    ConflictBody,
    CreateSessionRequest,
    EraseUserRequest,
    EraseUserResponse,
    ErrorBody,
    HealthBody,
    IndexBody,
    MessagesResponse,
    ModelsResponse,
    NotesResponse,
    PutMetaRequest,
    StreamDropped,
    ToolsResponse,
    TurnAccepted,
    TurnRequest,
)
from turnbus.shared.envelope import Envelope
from turnbus.shared.events import Event
from turnbus.shared.keys import ID_MAX_CHARS
from turnbus.shared.meta import HOST_META_KEYS
from turnbus.shared.records import SessionPage, TurnRecord
from turnbus.shared.session_index import LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX

__all__ = ["build_openapi"]

_TYPES: list[Any] = [
    Envelope,
    SessionPage,
    ErrorBody,
    ConflictBody,
    CreateSessionRequest,
    PutMetaRequest,
    NotesResponse,
    ToolsResponse,
    MessagesResponse,
    TurnRequest,
    ActionsRequest,
    TurnAccepted,
    TurnRecord,
    HealthBody,
    ModelsResponse,
    IndexBody,
    Event,
    StreamDropped,
    EraseUserRequest,
    EraseUserResponse,
]

_ERROR_TEXT = {
    400: "bad_request: a malformed body, header, cursor or limit (`field` names it); "
    "cursor_ahead: a cursor past the stream",
    401: "unauthorized: no token, a bad signature, or an expired token",
    404: "not_found: no such session or turn for this user",
    409: "conflict / session_busy",
    413: "payload_too_large: the body or a value is over its cap",
    422: "unprocessable: the body does not match the schema (the field is named); "
    "clock_ahead: updatedAt is more than 24 h ahead of the server's clock; "
    "unknown_provider: meta.selectedModel names a provider that is not configured; "
    "unknown_tool: meta.allowedTools names a tool no worker registered; "
    "confirmation_required: an erasure whose body does not confirm the caller's user id",
    429: "session_queue_full: the session holds its maximum of unfinished turns; "
    "quota_exceeded: over one of the user's quotas, named by field (Retry-After)",
    503: "unavailable: Redis is unreachable; not_replicated: no replica confirmed the write in time (TURNBUS_WAIT_REPLICAS)",
}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str, description: str, **headers: dict[str, Any]) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": _ref(name)}},
    }
    if headers:
        response["headers"] = headers
    return response


def _header(description: str, *, required: bool = True, **schema: Any) -> dict[str, Any]:
    return {
        "description": description,
        "required": required,
        "schema": {"type": "string", **schema},
    }


_LOCATION = _header("the new resource's path")


def _error(status: int) -> dict[str, Any]:
    if status == 401:
        challenge = _header("always `Bearer`", const="Bearer")
        return _json("ErrorBody", _ERROR_TEXT[status], **{"WWW-Authenticate": challenge})
    if status == 429:
        retry = _header("seconds to wait before retrying", pattern=r"^[0-9]+$")
        return _json("ErrorBody", _ERROR_TEXT[status], **{"Retry-After": retry})
    return _json("ErrorBody", _ERROR_TEXT[status])


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): _error(s) for s in (401, 503, *statuses)}


_SESSION = {
    "name": "session_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "minLength": 1, "maxLength": ID_MAX_CHARS},
}
_TURN = {**_SESSION, "name": "turn_id"}
_CURSOR_SCHEMA = {"type": "string", "pattern": r"^[0-9]{1,19}(-[0-9]{1,19})?$"}
_SSE_PARAMS = [
    {
        "name": "Last-Event-ID",
        "in": "header",
        "required": False,
        "description": "Resume after this event id (wins over `after`).",
        "schema": _CURSOR_SCHEMA,
    },
    {
        "name": "after",
        "in": "query",
        "required": False,
        "description": "Resume after this event id.",
        "schema": _CURSOR_SCHEMA,
    },
    {
        "name": "access_token",
        "in": "query",
        "required": False,
        "description": "The bearer token, for clients that cannot set headers (EventSource).",
        "schema": {"type": "string"},
    },
]
# OpenAPI 3.1 reads a text/event-stream schema as the schema of one event.
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"type": "string", "description": "the event's type"},
        "id": {**_CURSOR_SCHEMA, "description": "the stream entry id (absent on control events)"},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_ref("Event"), _ref("StreamDropped")]},
        },
        "retry": {"type": "integer"},
    },
}
_SSE_OK = {
    "description": "text/event-stream; each event's `data` is one JSON event (see Event).",
    "content": {"text/event-stream": {"schema": _SSE_EVENT}},
}

_LIST_PARAMS = [
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
# created session to its turns, log and meta, and from an accepted turn to its record,
# events and cancel. Each names an operationId below and fills every path parameter.
_FROM_SESSION = {"session_id": "$response.body#/sessionId"}
_SESSION_LINKS = {
    "GetSession": {"operationId": "getSession", "parameters": _FROM_SESSION},
    "PutMeta": {"operationId": "putMeta", "parameters": _FROM_SESSION},
    "SubmitTurn": {"operationId": "submitTurn", "parameters": _FROM_SESSION},
    "SessionEvents": {"operationId": "sessionEvents", "parameters": _FROM_SESSION},
}
_FROM_TURN = {"session_id": "$request.path.session_id", "turn_id": "$response.body#/turnId"}
_TURN_LINKS = {
    "GetTurn": {"operationId": "getTurn", "parameters": _FROM_TURN},
    "TurnEvents": {"operationId": "turnEvents", "parameters": _FROM_TURN},
    "CancelTurn": {"operationId": "cancelTurn", "parameters": _FROM_TURN},
}


def _linked(response: dict[str, Any], links: dict[str, Any]) -> dict[str, Any]:
    return {**response, "links": links}


def _body(name: str, required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {"application/json": {"schema": _ref(name)}}}


def _paths() -> dict[str, Any]:
    session_path = "/v1/sessions/{session_id}"
    turn_path = session_path + "/turns/{turn_id}"
    public: list[dict[str, Any]] = []
    return {
        "/": {
            "get": {
                "operationId": "index",
                "summary": "Where to go: a browser (Accept: text/html) is sent on to the "
                "console; an API client gets this index",
                "security": public,
                "responses": {
                    "200": _json("IndexBody", "the index"),
                    "303": {"description": "to /console, for a browser"},
                },
            }
        },
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "Liveness",
                "security": public,
                "responses": {"200": _json("HealthBody", "alive")},
            }
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "summary": "Readiness: Redis answers",
                "security": public,
                "responses": {"200": _json("HealthBody", "ready"), "503": _error(503)},
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics",
                "security": public,
                "responses": {
                    "200": {
                        "description": "Prometheus text exposition",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "summary": "The configured model providers and the default one",
                "responses": {"200": _json("ModelsResponse", "the providers"), **_errors()},
            }
        },
        "/v1/sessions": {
            "get": {
                "operationId": "listSessions",
                "summary": "The caller's sessions, newest first (by creation), cursor paged",
                "parameters": _LIST_PARAMS,
                "responses": {
                    "200": _json("SessionPage", "a page of sessions; nextCursor null on the last"),
                    **_errors(400),
                },
            },
            "post": {
                "operationId": "createSession",
                "summary": "Create a session (optional initial host meta)",
                "requestBody": _body("CreateSessionRequest", required=False),
                "responses": {
                    "201": _linked(
                        _json("Envelope", "the new session's envelope", Location=_LOCATION),
                        _SESSION_LINKS,
                    ),
                    **_errors(400, 409, 413, 422),
                },
            },
        },
        "/v1/tools": {
            "get": {
                "operationId": "listTools",
                "summary": "The tools a session may be offered: the notes tools, then every "
                "tool a live worker registered (narrowed per session by meta.allowedTools)",
                "responses": {"200": _json("ToolsResponse", "the tools"), **_errors()},
            }
        },
        session_path: {
            "parameters": [_SESSION],
            "get": {
                "operationId": "getSession",
                "summary": "The envelope, poison dropped",
                "responses": {"200": _json("Envelope", "the envelope"), **_errors(404)},
            },
            "delete": {
                "operationId": "deleteSession",
                "summary": "Delete the session and every key of it",
                "responses": {"204": {"description": "deleted"}, **_errors(404)},
            },
        },
        session_path + "/meta": {
            "parameters": [_SESSION],
            "put": {
                "operationId": "putMeta",
                "summary": "Host replace of the meta (LWW on updatedAt)",
                "requestBody": _body("PutMetaRequest"),
                "responses": {
                    "200": _json("Envelope", "the envelope after the write"),
                    "409": _json("ConflictBody", "conflict: stale updatedAt; the current envelope"),
                    **_errors(400, 404, 413, 422),
                },
            },
        },
        session_path + "/notes": {
            "parameters": [_SESSION],
            "get": {
                "operationId": "getNotes",
                "summary": "The working notes and their UTF-8 size",
                "responses": {"200": _json("NotesResponse", "the notes"), **_errors(404)},
            },
        },
        session_path + "/system": {
            "parameters": [_SESSION],
            "get": {
                "operationId": "getSystem",
                "summary": "The resolved system prompt, byte-identical to the worker's",
                "responses": {
                    "200": {
                        "description": "the system prompt",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_errors(404),
                },
            },
        },
        session_path + "/messages": {
            "parameters": [_SESSION],
            "get": {
                "operationId": "getMessages",
                "summary": "The model-facing history (Anthropic message format)",
                "responses": {"200": _json("MessagesResponse", "the history"), **_errors(404)},
            },
        },
        session_path + "/turns": {
            "parameters": [_SESSION],
            "post": {
                "operationId": "submitTurn",
                "summary": "Submit a turn",
                "description": (
                    "With `Accept: text/event-stream` the answer is `200` with the turn's "
                    "event stream from its first event, as `GET …/turns/{turn_id}/events` "
                    "sends it (headers `Location` and `X-Turn-Id` name the turn): submit "
                    "and follow in one request. Errors are JSON, as without it."
                ),
                "parameters": [
                    {
                        "name": "Idempotency-Key",
                        "in": "header",
                        "required": False,
                        "schema": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": IDEMPOTENCY_KEY_MAX_CHARS,
                        },
                    }
                ],
                "requestBody": _body("TurnRequest"),
                "responses": {
                    "202": _linked(
                        _json(
                            "TurnAccepted",
                            "accepted (or replayed for the same key)",
                            Location=_LOCATION,
                            **{
                                "Idempotent-Replayed": _header(
                                    "`true` when answered from an earlier request with this key",
                                    required=False,
                                    const="true",
                                )
                            },
                        ),
                        _TURN_LINKS,
                    ),
                    **_errors(400, 404, 409, 413, 422, 429),
                },
            },
        },
        turn_path: {
            "parameters": [_SESSION, _TURN],
            "get": {
                "operationId": "getTurn",
                "summary": "The turn record",
                "responses": {"200": _json("TurnRecord", "the turn record"), **_errors(404)},
            },
        },
        turn_path + "/cancel": {
            "parameters": [_SESSION, _TURN],
            "post": {
                "operationId": "cancelTurn",
                "summary": "Cancel a turn (queued: at once; running: signalled)",
                "responses": {"202": _json("TurnRecord", "the turn record"), **_errors(404)},
            },
        },
        turn_path + "/actions": {
            "parameters": [_SESSION, _TURN],
            "post": {
                "operationId": "submitActions",
                "summary": "Answer the calls a turn paused for (requires_action)",
                "description": (
                    "Every pending call (`pendingCalls` of the record, `calls` of "
                    "`turn.requires_action`) is answered in one request: a client call "
                    "(`kind: client`) in `toolResults`, a call awaiting approval "
                    "(`kind: approval`) in `approvals` (approve, edit with a new input, "
                    "or reject with a reason); the turn goes back to `queued` and any "
                    "worker resumes it at its next round. An unknown, missing or repeated "
                    "call id, or one answered in the wrong list, is a `422` naming it "
                    "(`unknown_call`, `missing_call`, `duplicate_call`, `wrong_answer`); "
                    "an edit that does not fit the tool's schema is `422 unprocessable`; "
                    "a turn that is not waiting is a `409` (`turn_not_waiting`)."
                ),
                "parameters": [
                    {
                        "name": "Idempotency-Key",
                        "in": "header",
                        "required": False,
                        "schema": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": IDEMPOTENCY_KEY_MAX_CHARS,
                        },
                    }
                ],
                "requestBody": _body("ActionsRequest"),
                "responses": {
                    "202": _json("TurnRecord", "the turn record, queued again"),
                    **_errors(400, 404, 409, 413, 422),
                },
            },
        },
        turn_path + "/events": {
            "parameters": [_SESSION, _TURN],
            "get": {
                "operationId": "turnEvents",
                "summary": "SSE of the turn's events; ends after the terminal event",
                "description": (
                    "From `turn.queued` to one terminal event. A round held back by the "
                    "model's rate limit sends `round.waiting` (its `reason` and about how "
                    "long, `waitMs`) before its text: nothing streams until the model's "
                    "key is let through again, or the turn fails with that reason after "
                    "`TURNBUS_MODEL_WAIT_S`."
                ),
                "parameters": _SSE_PARAMS,
                "responses": {
                    "200": _SSE_OK,
                    "204": {"description": "the cursor is at the terminal event already"},
                    **_errors(400, 404),
                },
            },
        },
        session_path + "/events": {
            "parameters": [_SESSION],
            "get": {
                "operationId": "sessionEvents",
                "summary": "SSE of the session log; open-ended",
                "parameters": _SSE_PARAMS,
                "responses": {"200": _SSE_OK, **_errors(400, 404)},
            },
        },
        "/v1/users/me": {
            "delete": {
                "operationId": "eraseUser",
                "summary": "Erase every session of the caller, in batches",
                "description": (
                    'The body `{"confirm": "<your user id>"}` is required. Each call erases '
                    "for up to 5 s: `200` with `done` once nothing is left, else `202`: "
                    "call again."
                ),
                "requestBody": _body("EraseUserRequest", required=False),
                "responses": {
                    "200": _json("EraseUserResponse", "everything of the caller is erased"),
                    "202": _json("EraseUserResponse", "part erased: call again"),
                    **_errors(400, 413, 422),
                },
            },
        },
    }


def _host_meta_at_creation(components: dict[str, Any]) -> None:
    """A new session takes only host-owned keys (the server refuses the worker's with a
    422): ``CreateSessionRequest.meta`` is ``HostMeta``, ``Meta`` less those keys."""
    meta = components["Meta"]
    host = {**meta, "title": "HostMeta"}
    host["properties"] = {k: v for k, v in meta["properties"].items() if k in HOST_META_KEYS}
    host["required"] = [k for k in meta.get("required", []) if k in HOST_META_KEYS]
    components["HostMeta"] = host
    create = components["CreateSessionRequest"]["properties"]["meta"]
    create["anyOf"] = [_ref("HostMeta"), {"type": "null"}]


def build_openapi() -> dict[str, Any]:
    schemas, components = msgspec.json.schema_components(
        _TYPES, ref_template="#/components/schemas/{name}"
    )
    components["Event"] = schemas[_TYPES.index(Event)]
    _host_meta_at_creation(components)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "turnbus gateway",
            "version": "1",
            "description": "Durable agent turns over Redis Streams. See docs/api.md.",
        },
        "security": [{"bearerAuth": []}],
        "paths": _paths(),
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearerAuth": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}
            },
        },
    }

"""The OpenAPI 3.1 document, read from the app's own route table.

Each route the app serves is an :class:`~turnbus.gateway.routes.spec.ApiRoute` whose
operations declare what they take, answer and refuse; the schemas are the msgspec
types they name, the error codes those of ``errors.CODES``. A route of the app that
is not an API route (the console's page and files) says so with
``include_in_schema=False``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
from starlette.routing import BaseRoute, Route

from turnbus.gateway.errors import CODES
from turnbus.gateway.routes.spec import CURSOR_SCHEMA, Answer, ApiRoute, Operation, header
from turnbus.gateway.schemas import ErrorBody, StreamDropped
from turnbus.shared.error_codes import ERROR_CODES
from turnbus.shared.events import Event
from turnbus.shared.keys import ID_MAX_CHARS
from turnbus.shared.meta import HOST_META_KEYS

__all__ = ["build_openapi"]


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


# The headers an error of some statuses carries.
_ERROR_HEADERS = {
    401: {"WWW-Authenticate": header("always `Bearer`", const="Bearer")},
    429: {"Retry-After": header("seconds to wait before retrying", pattern=r"^[0-9]+$")},
}


def _error(status: int, codes: Sequence[str], answer: dict[str, Any] | None) -> dict[str, Any]:
    """The answer of ``status``, naming ``codes``: the route's own when it declares one
    (a body other than ErrorBody), else ErrorBody."""
    text = "; ".join(f"{code}: {ERROR_CODES[code].meaning}" for code in codes)
    body = {"application/json": {"schema": _ref("ErrorBody")}}
    response = {**(answer or {"description": text, "content": body}), "x-error-codes": list(codes)}
    if status in _ERROR_HEADERS:
        response["headers"] = _ERROR_HEADERS[status]
    return response


_ID = {"type": "string", "minLength": 1, "maxLength": ID_MAX_CHARS}
# OpenAPI 3.1 reads a text/event-stream schema as the schema of one event.
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"type": "string", "description": "the event's type"},
        "id": {**CURSOR_SCHEMA, "description": "the stream entry id (absent on control events)"},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_ref("Event"), _ref("StreamDropped")]},
        },
        "retry": {"type": "integer"},
    },
}


def _is_struct(body: Any) -> bool:
    return isinstance(body, type) and issubclass(body, msgspec.Struct)


def _schema(body: Any) -> dict[str, Any]:
    """A struct's schema by reference (it is a component), another type's inline."""
    return _ref(body.__name__) if _is_struct(body) else msgspec.json.schema(body)


def _content(answer: Answer) -> dict[str, Any] | None:
    if answer.media_type == "text/event-stream":
        return {"text/event-stream": {"schema": _SSE_EVENT}}
    if answer.media_type is not None:
        return {answer.media_type: {"schema": {"type": "string"}}}
    if answer.body is not None:
        return {"application/json": {"schema": _schema(answer.body)}}
    return None


def _answer(answer: Answer) -> dict[str, Any]:
    response: dict[str, Any] = {"description": answer.description}
    content = _content(answer)
    if content is not None:
        response["content"] = content
    if answer.headers:
        response["headers"] = dict(answer.headers)
    if answer.links:
        response["links"] = dict(answer.links)
    return response


def _responses(op: Operation) -> dict[str, Any]:
    responses = {str(status): _answer(answer) for status, answer in op.answers.items()}
    by_status: dict[int, list[str]] = {}
    for code in op.codes:
        by_status.setdefault(CODES[code], []).append(code)
    for status, codes in by_status.items():
        responses[str(status)] = _error(status, codes, responses.get(str(status)))
    return dict(sorted(responses.items()))


def _operation(op: Operation) -> dict[str, Any]:
    document: dict[str, Any] = {"operationId": op.operation_id, "summary": op.summary}
    if op.description:
        document["description"] = op.description
    if op.public:
        document["security"] = []
    if op.parameters:
        document["parameters"] = [dict(p) for p in op.parameters]
    if op.body is not None:
        document["requestBody"] = {
            "required": op.body_required,
            "content": {"application/json": {"schema": _schema(op.body)}},
        }
    document["responses"] = _responses(op)
    return document


def _path_parameters(path: str) -> list[dict[str, Any]]:
    names = [part[1:-1] for part in path.split("/") if part.startswith("{")]
    return [{"name": name, "in": "path", "required": True, "schema": _ID} for name in names]


def _operations(routes: Iterable[BaseRoute]) -> list[Operation]:
    """The operations of ``routes``, an app's table; a route in the schema that declares
    none is a mistake, refused here."""
    operations: list[Operation] = []
    for route in routes:
        if isinstance(route, ApiRoute):
            operations += route.operations
        elif getattr(route, "include_in_schema", True):
            path = route.path if isinstance(route, Route) else repr(route)
            raise ValueError(f"the route {path} declares no operation (routes/spec.py)")
    return operations


def _paths(operations: Sequence[Operation]) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for op in operations:
        item = paths.setdefault(op.path, {})
        if "{" in op.path:
            item.setdefault("parameters", _path_parameters(op.path))
        item[op.method.lower()] = _operation(op)
    return paths


def _types(operations: Sequence[Operation]) -> list[Any]:
    """Every type the operations name, and those the SSE events and errors are."""
    named = [ErrorBody, StreamDropped]
    for op in operations:
        named += [a.body for a in op.answers.values()]
        named.append(op.body)
    return list(dict.fromkeys(t for t in named if _is_struct(t)))


def _error_codes(components: dict[str, Any]) -> None:
    """``error.code`` is one of the codes of ``errors.CODES``."""
    code = components["ErrorDetail"]["properties"]["code"]
    code["enum"] = list(CODES)


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


def build_openapi(routes: Iterable[BaseRoute]) -> dict[str, Any]:
    """The document of the API ``routes`` (the app's route table) serve."""
    operations = _operations(routes)
    types = [*_types(operations), Event]
    schemas, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}"
    )
    components["Event"] = schemas[-1]
    _host_meta_at_creation(components)
    _error_codes(components)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "turnbus gateway",
            "version": "1",
            "description": "Durable agent turns over Redis Streams. See docs/api.md.",
        },
        "security": [{"bearerAuth": []}],
        "paths": _paths(operations),
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearerAuth": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}
            },
        },
    }

"""What each route of the API is, declared once, on its handler.

``@Operation(method, path, operation_id, …)`` says what the handler takes and answers
and which error codes it may answer. The app's route table is built from these
(:func:`api_routes`), and the OpenAPI document reads them back from that table
(:mod:`turnbus.gateway.openapi`): a route the app serves is in the document, and
nothing else is.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from turnbus.shared.error_codes import ERROR_CODES

__all__ = [
    "CURSOR_SCHEMA",
    "LOCATION",
    "SESSION_PATH",
    "TURN_PATH",
    "Answer",
    "ApiRoute",
    "Endpoint",
    "Operation",
    "api_routes",
    "header",
]

Endpoint = Callable[[Request], Awaitable[Response]]

# An SSE cursor: a stream entry id.
CURSOR_SCHEMA = {"type": "string", "pattern": r"^[0-9]{1,19}(-[0-9]{1,19})?$"}
# The paths of a session and of one of its turns.
SESSION_PATH = "/v1/sessions/{session_id}"
TURN_PATH = SESSION_PATH + "/turns/{turn_id}"

# What every authenticated route may answer, and what reading a JSON body may.
_AUTHENTICATED_CODES = ("unauthorized", "unavailable")
_BODY_CODES = ("bad_request", "payload_too_large", "unprocessable")


@dataclass(frozen=True, slots=True)
class Answer:
    """A success answer. ``body``: the msgspec type of a JSON body; with
    ``media_type`` text/plain a string, text/event-stream the SSE events; neither, no
    body. ``headers`` and ``links`` are OpenAPI header and link objects by name."""

    description: str
    body: Any = None
    media_type: str | None = None
    headers: Mapping[str, Any] = field(default_factory=dict)
    links: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Operation:
    """One method of one path: what it takes, answers and refuses. Used as a decorator,
    ``@Operation(method, path, operation_id, …)`` on the handler below it.

    ``errors`` names the codes the route answers besides those every route of its kind
    does (see :attr:`codes`); ``parameters`` are OpenAPI parameter objects (query and
    header; path parameters come from the path)."""

    method: str
    path: str
    operation_id: str
    summary: str
    answers: Mapping[int, Answer]
    description: str = ""
    body: Any = None
    body_required: bool = True
    parameters: Sequence[Mapping[str, Any]] = ()
    errors: Sequence[str] = ()
    public: bool = False
    endpoint: Endpoint | None = None

    def __call__(self, endpoint: Endpoint) -> Operation:
        return replace(self, endpoint=endpoint)

    @property
    def handler(self) -> Endpoint:
        if self.endpoint is None:
            raise TypeError(f"{self.operation_id} is declared on no handler")
        return self.endpoint

    def __post_init__(self) -> None:
        unknown = [code for code in self.errors if code not in ERROR_CODES]
        if unknown:
            raise ValueError(f"{self.operation_id} declares unknown error codes {unknown}")

    @property
    def codes(self) -> tuple[str, ...]:
        """Every error code the route may answer: an authenticated route's, a JSON body's,
        ``not_found`` for a path naming a session or turn, then its own."""
        implied: list[str] = []
        if not self.public:
            implied += _AUTHENTICATED_CODES
        if self.body is not None:
            implied += _BODY_CODES
        if "{" in self.path:
            implied.append("not_found")
        return tuple(dict.fromkeys([*implied, *self.errors]))


def header(description: str, *, required: bool = True, **schema: Any) -> dict[str, Any]:
    """An OpenAPI header object: a string, with ``schema``'s further keywords."""
    return {
        "description": description,
        "required": required,
        "schema": {"type": "string", **schema},
    }


LOCATION = header("the new resource's path")


class ApiRoute(Route):
    """The route of one path, serving each of its operations by method.

    Its ASGI app calls the handler and sends its response, no more: Starlette's
    ``request_response`` also wraps each request in the app's exception handlers,
    which the app's ``ExceptionMiddleware`` applies to the same request anyway (the
    handlers never look at the request they are given)."""

    def __init__(self, path: str, operations: Iterable[Operation]) -> None:
        self.operations = tuple(operations)
        endpoints = {op.method: op.handler for op in self.operations}

        async def dispatch(request: Request) -> Response:
            method = "GET" if request.method == "HEAD" else request.method
            return await endpoints[method](request)

        endpoint = self.operations[0].handler if len(endpoints) == 1 else dispatch
        super().__init__(path, endpoint, methods=list(endpoints))

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            response = await endpoint(Request(scope, receive, send))
            await response(scope, receive, send)

        self.app = app


def api_routes(operations: Iterable[Operation]) -> list[ApiRoute]:
    """One route per path, in the order the paths first appear: a 405's ``Allow`` then
    lists every method of the path."""
    by_path: dict[str, list[Operation]] = {}
    for op in operations:
        by_path.setdefault(op.path, []).append(op)
    return [ApiRoute(path, ops) for path, ops in by_path.items()]

"""The indexed route lookup answers as Starlette's router does: for the gateway's own
route table, and for routes it cannot index (a mount, a ``{name:path}`` parameter)."""

from __future__ import annotations

import itertools

import pytest
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route, Router
from starlette.types import Message, Scope

from turnbus.gateway.app import gateway_routes
from turnbus.gateway.router import IndexedRouter


async def _named(request: Request) -> Response:
    route = request.scope["route"]
    return PlainTextResponse(f"{route.path} {sorted(request.path_params.items())}")


def _gateway_table() -> list[BaseRoute]:
    """The gateway's paths and methods, in its order, each answering which route it is."""
    table: list[BaseRoute] = []
    for route in gateway_routes():
        assert isinstance(route, Route)
        methods = sorted(route.methods or ()) or None
        table.append(Route(route.path, _named, methods=methods))
    return table


def _extra_routes() -> list[BaseRoute]:
    return [
        Route("/files/{rest:path}", _named, methods=["GET"]),
        Route("/items/{n:int}", _named, methods=["GET"]),
        Route("/items/{name}", _named, methods=["POST"]),
        Mount("/mounted", routes=[Route("/{x}", _named)]),
        Route("/a/{b}/c", _named, methods=["PUT"]),
    ]


async def _answer(router: Router, method: str, path: str, root_path: str = "") -> Message:
    scope: Scope = {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": root_path,
        "headers": [],
        "query_string": b"",
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await router(scope, receive, send)
    start, *body = sent
    return {
        "status": start["status"],
        "headers": sorted(start["headers"]),
        "body": b"".join(m.get("body", b"") for m in body),
        "route": getattr(scope.get("route"), "path", None),
        "params": scope.get("path_params"),
    }


_PATHS = [
    "/",
    "/healthz",
    "/console",
    "/console/",
    "/console/app.js",
    "/v1/sessions",
    "/v1/sessions/",
    "/v1/sessions/s_1",
    "/v1/sessions/s_1/",
    "/v1/sessions/s_1/turns",
    "/v1/sessions/s_1/turns/t_1",
    "/v1/sessions/s_1/turns/t_1/actions",
    "/v1/sessions/s_1/turns/t_1/cancel",
    "/v1/sessions/s_1/turns/t_1/events",
    "/v1/sessions/s_1/turns/t_1/nothing",
    "/v1/sessions/s_1/turns/t_1/actions/more",
    "//v1//sessions",
    "/files/a/b/c",
    "/items/7",
    "/items/seven",
    "/mounted/x",
    "/a/b/c",
    "/nothing",
]


@pytest.mark.parametrize(
    ("method", "path"), list(itertools.product(["GET", "POST", "HEAD"], _PATHS))
)
async def test_the_same_answer_as_starlettes_router(method: str, path: str) -> None:
    routes = [*_gateway_table(), *_extra_routes()]
    plain = Router(routes, redirect_slashes=False)
    indexed = IndexedRouter(routes, redirect_slashes=False)
    assert await _answer(indexed, method, path) == await _answer(plain, method, path)


async def test_a_root_path_is_matched_as_starlette_does() -> None:
    routes = _extra_routes()
    plain = Router(routes, redirect_slashes=False)
    indexed = IndexedRouter(routes, redirect_slashes=False)
    for path in ("/api/items/7", "/api/a/b/c", "/api/nothing"):
        assert await _answer(indexed, "GET", path, "/api") == await _answer(
            plain, "GET", path, "/api"
        )


async def test_with_slash_redirects_it_is_starlettes_router() -> None:
    routes = _extra_routes()
    plain = Router(routes)
    indexed = IndexedRouter(routes)
    assert await _answer(indexed, "PUT", "/a/b/c/") == await _answer(plain, "PUT", "/a/b/c/")


async def test_a_route_added_later_is_served() -> None:
    indexed = IndexedRouter(_extra_routes(), redirect_slashes=False)
    assert (await _answer(indexed, "GET", "/late/x"))["status"] == 404
    indexed.routes.append(Route("/late/{x}", _named))
    assert (await _answer(indexed, "GET", "/late/x"))["route"] == "/late/{x}"

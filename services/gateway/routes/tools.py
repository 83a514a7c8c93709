"""The tools a caller may use (``GET /v1/tools``), and the check of a host's
``meta.allowedTools`` against the tools the workers registered.

The gateway shares nothing with the workers but Redis: each worker publishes its tools
there (``turnbus.shared.tool_specs``), and this module reads them, one call a request.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from turnbus.gateway.auth import tools_claim
from turnbus.gateway.errors import ApiError
from turnbus.gateway.routes.spec import Answer, Operation
from turnbus.gateway.schemas import ToolsResponse
from turnbus.gateway.state import Gateway, authenticate, gateway_of
from turnbus.shared.meta import Meta, allowed_tools
from turnbus.shared.tool_specs import read_published_tools

__all__ = ["check_allowed_tools", "list_tools"]

_encoder = msgspec.json.Encoder()


async def check_allowed_tools(gateway: Gateway, meta: Meta | None) -> None:
    """Refuse an ``allowedTools`` naming a tool no worker registered: ``422
    unknown_tool`` naming it (one Redis call, made only when the key is set)."""
    names = allowed_tools(meta.allowedTools) if meta is not None else None
    if not names:
        return
    known = await read_published_tools(gateway.redis, gateway.keys)
    for name in names:
        if name not in known:
            raise ApiError(
                "unknown_tool",
                f"allowedTools names {name!r}, which no worker has registered "
                "(GET /v1/tools lists the tools)",
                field="meta.allowedTools",
            )


@Operation(
    "GET",
    "/v1/tools",
    "listTools",
    summary="The tools a session may be offered: the notes tools, then every tool a live "
    "worker registered (narrowed per session by meta.allowedTools)",
    answers={200: Answer("the tools", ToolsResponse)},
)
async def list_tools(request: Request) -> Response:
    """The notes tools (always offered) and every tool a live worker registered (what
    a session without an ``allowedTools`` is offered), each group sorted by name; a
    token with a ``tools`` claim sees only those of them."""
    authenticate(request)
    gateway = gateway_of(request)
    published = await read_published_tools(gateway.redis, gateway.keys)
    claim = tools_claim(request)
    # A token's tools claim narrows what its user may use (the notes tools stay).
    allowed = set(allowed_tools(claim) or ()) if claim is not None else None
    tools = [
        t for t in published.values() if allowed is None or t.source == "notes" or t.name in allowed
    ]
    return Response(_encoder.encode(ToolsResponse(tools=tools)), media_type="application/json")

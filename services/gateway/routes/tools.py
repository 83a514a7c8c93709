"""The tools a caller may use (``GET /v1/tools``), and the check of a host's
``meta.allowedTools`` against the tools the workers registered.

The gateway shares nothing with the workers but Redis: each worker publishes its tools
there (``turnbus.shared.tool_specs``), and this module reads them, one call a request.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from turnbus.gateway.errors import ApiError
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


async def list_tools(request: Request) -> Response:
    """The notes tools (always offered) and every tool a live worker registered (what
    a session without an ``allowedTools`` is offered), each group sorted by name."""
    authenticate(request)
    gateway = gateway_of(request)
    published = await read_published_tools(gateway.redis, gateway.keys)
    tools = list(published.values())
    return Response(_encoder.encode(ToolsResponse(tools=tools)), media_type="application/json")

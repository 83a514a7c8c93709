"""The model providers this deployment configured: what a selectedModel may name."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from turnbus.gateway.routes.spec import Answer, Operation
from turnbus.gateway.schemas import ModelsResponse, ProviderInfo
from turnbus.gateway.state import authenticate, gateway_of

__all__ = ["list_models"]

_encoder = msgspec.json.Encoder()


@Operation(
    "GET",
    "/v1/models",
    "listModels",
    summary="The configured model providers and the default one",
    answers={200: Answer("the providers", ModelsResponse)},
)
async def list_models(request: Request) -> Response:
    """``GET /v1/models``: the default provider and every configured one (never a key
    or an endpoint's address)."""
    authenticate(request)
    settings = gateway_of(request).settings
    providers = [
        ProviderInfo(
            name=p.name,
            kind=p.kind,
            defaultModel=p.model,
            default=p.name == settings.model,
        )
        for p in settings.configured_providers
    ]
    body = ModelsResponse(default=settings.model, providers=providers)
    return Response(_encoder.encode(body), media_type="application/json")

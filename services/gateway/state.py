"""What a request handler needs: the live clients and stores of one gateway app."""

from __future__ import annotations

import dataclasses

import redis.asyncio as aioredis
from starlette.requests import Request

from gateway.auth import TokenVerifier, request_user
from gateway.errors import not_found
from gateway.hub import SseHub
from gateway.metrics import GatewayMetrics
from shared.envelope import EnvelopeStore
from shared.keys import InvalidId, Keys, validate_id
from shared.settings import Settings
from shared.turns import TurnStore

__all__ = ["Gateway", "authenticate", "gateway_of", "path_id"]


@dataclasses.dataclass(slots=True)
class Gateway:
    settings: Settings
    keys: Keys
    metrics: GatewayMetrics
    redis: aioredis.Redis
    envelopes: EnvelopeStore
    turns: TurnStore
    hub: SseHub
    tokens: TokenVerifier


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def authenticate(request: Request, *, allow_query: bool = False) -> str:
    """The request's user (401 otherwise)."""
    return request_user(request, gateway_of(request).tokens, allow_query=allow_query)


def path_id(request: Request, name: str, kind: str) -> str:
    """A path id; one that could never name a key is 404, like any id that does not exist."""
    value = request.path_params[name]
    try:
        return validate_id(value, kind)
    except InvalidId:
        raise not_found(f"no such {kind}") from None

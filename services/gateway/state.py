"""What a request handler needs: the live clients and stores of one gateway app."""

from __future__ import annotations

import dataclasses

import redis.asyncio as aioredis
from starlette.requests import Request

from turnbus.gateway.auth import TokenVerifier, request_user
from turnbus.gateway.errors import not_found
from turnbus.gateway.hub import SseHub
from turnbus.gateway.metrics import GatewayMetrics
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import InvalidId, Keys, validate_id
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore

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

"""The gateway's Redis pool: a call waits for a free connection, it never fails for lack of one.

Request handlers and the SSE hub's catch-up reads share one
``BlockingConnectionPool`` of ``gateway_redis_connections`` connections. When every
connection is busy (a burst of thousands of clients), a call waits up to
``gateway_redis_wait_ms`` for one instead of raising ``MaxConnectionsError``; only a
Redis that does not answer within that deadline makes a route answer ``503``.
"""

from __future__ import annotations

import inspect
from typing import Any

from redis.asyncio.connection import AbstractConnection, BlockingConnectionPool

from shared.settings import Settings

__all__ = ["gateway_pool"]


def gateway_pool(settings: Settings) -> BlockingConnectionPool:
    """The pool of one gateway process (close it with ``aclose``)."""
    extra: dict[str, Any] = {}
    if "driver_info" in inspect.signature(AbstractConnection.__init__).parameters:
        # No CLIENT SETINFO round trips on each new connection of a burst.
        extra["driver_info"] = None
    wait_s = settings.gateway_redis_wait_ms / 1000
    pool: BlockingConnectionPool = BlockingConnectionPool.from_url(
        settings.redis_url,
        decode_responses=True,
        max_connections=settings.gateway_redis_connections,
        timeout=wait_s,
        socket_connect_timeout=2,
        # A reply slower than this means Redis is not healthy: the route answers 503.
        socket_timeout=max(10.0, wait_s),
        **extra,
    )
    return pool

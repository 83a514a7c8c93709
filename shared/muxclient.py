"""What turnbus's Redis clients answer beyond redis-py's commands, on one Redis and on a
Redis Cluster alike: :class:`MuxClient`.

:func:`turnbus.shared.connect.connect` gives a :class:`~turnbus.shared.mux.MuxRedis` (one
Redis) or a :class:`~turnbus.shared.cluster.ClusterMux` (a cluster); both are a
``redis.asyncio.Redis`` and a :class:`MuxClient`. Code that takes any client (a test may
hand in a plain redis-py one) asks :func:`mux_client` for the interface instead of asking
which class it has: a plain client answers as one node with nothing to watch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from turnbus.shared import redispy
from turnbus.shared.cluster import ClusterMux
from turnbus.shared.mux import MuxRedis, NotDedicated, single_link

__all__ = ["MuxClient", "mux_client"]


class MuxClient(Protocol):
    """A client's nodes, how fast they answer, and the links that must not be shared."""

    @property
    def sharded(self) -> bool:
        """``True`` on a Redis Cluster: keys live on several masters, each slot on one."""
        ...

    def address_of(self, node: Any) -> tuple[str, int] | None:
        """``(host, port)`` of ``node``, one of :meth:`masters` (``None``: one Redis on
        a unix socket)."""
        ...

    @property
    def latency_ms(self) -> float:
        """How long Redis takes to answer now (the slowest master's), in ms."""
        ...

    @property
    def node_clients(self) -> Sequence[aioredis.Redis]:
        """The client of every node met so far (their pools, to watch)."""
        ...

    async def masters(self) -> Sequence[aioredis.Redis]:
        """The client of every master (on one Redis, the client itself)."""
        ...

    async def node_for_key(self, key: Any) -> aioredis.Redis:
        """The client of the master serving ``key`` now."""
        ...

    def address_for_key(self, key: Any) -> tuple[str, int] | None:
        """``(host, port)`` of the master serving ``key`` as last known (``None``: not
        known yet on a cluster, or one Redis on a unix socket)."""
        ...

    async def refresh(self) -> None:
        """Read again which node serves what (nothing to read on one Redis)."""
        ...

    def pinned(self) -> aioredis.Redis:
        """A client of one connection of its own, kept for every command it sends (a
        write and its ``WAIT``, which counts the writes of its own connection); on a
        cluster, on the master its first command routes to. Close it with ``aclose``."""
        ...

    def pubsub(self, attempt: int = 0, **kwargs: Any) -> PubSub:
        """A pub/sub connection; ``attempt``: subscriptions lost before this one (a
        cluster takes the next master for each)."""
        ...

    async def call_into(self, on_reply: Callable[[Any], None], *args: Any) -> None:
        """A command whose raw reply goes to ``on_reply`` as soon as it is read (only a
        dedicated link, :func:`turnbus.shared.connect.dedicated_link`, takes it)."""
        ...

    async def listen(
        self, on_lost: Callable[[], None], on_message: Callable[[Any], None] | None = None
    ) -> None:
        """Be told when the connection is lost, and of each pub/sub message pushed on it
        (only a dedicated link takes it)."""
        ...


def mux_client(client: aioredis.Redis) -> MuxClient:
    """``client`` as a :class:`MuxClient`: itself when it is one of turnbus's clients, else
    (a plain redis-py client) a view of it as one node."""
    if isinstance(client, MuxRedis | ClusterMux):
        return client
    return _PlainClient(client)


class _PlainClient(NotDedicated):
    """A plain redis-py client as a :class:`MuxClient`: one node, no link to watch."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client

    @property
    def sharded(self) -> bool:
        return False

    def address_of(self, node: Any) -> tuple[str, int] | None:
        return redispy.link_settings(node.connection_pool).address

    @property
    def latency_ms(self) -> float:
        return 0.0

    @property
    def node_clients(self) -> list[aioredis.Redis]:
        return [self._client]

    async def masters(self) -> list[aioredis.Redis]:
        return [self._client]

    async def node_for_key(self, key: Any) -> aioredis.Redis:
        return self._client

    def address_for_key(self, key: Any) -> tuple[str, int] | None:
        return redispy.link_settings(self._client.connection_pool).address

    async def refresh(self) -> None:
        return None

    def pinned(self) -> aioredis.Redis:
        return single_link(self._client)

    def pubsub(self, attempt: int = 0, **kwargs: Any) -> PubSub:
        return self._client.pubsub(**kwargs)

"""``TURNBUS_WAIT_REPLICAS``: nothing is acknowledged before a replica has it.

With ``wait_replicas = N > 0`` a write that a client is told about (a submit's ``202``,
a committed notes write, a turn's terminal event, a cancel) runs on a link of its own,
followed on that link by ``WAIT N timeout``: Redis answers once N replicas have
everything that link wrote. WAIT counts the writes of its own connection, so it must
follow the script on the same link; it blocks that link meanwhile, so it cannot run on
the shared multiplexed one. :meth:`ReplicaWait.write` is the one place this happens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions

from turnbus.shared.connect import own_link
from turnbus.shared.settings import Settings

__all__ = ["NotReplicated", "ReplicaWait"]

_T = TypeVar("_T")


class NotReplicated(redis.exceptions.RedisError):
    """The write was applied on the primary but fewer replicas than asked confirmed it
    in time: it is not acknowledged (HTTP 503 ``not_replicated``)."""

    def __init__(self, acked: int, wanted: int, timeout_ms: int, result: Any = None) -> None:
        super().__init__(
            f"{acked} of {wanted} replica(s) confirmed the write within {timeout_ms} ms"
        )
        self.acked = acked
        self.wanted = wanted
        # What the write answered on the primary (it ran there): a caller whose write
        # needs a follow-up (a turn's work entry) still does it.
        self.result = result


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaWait:
    """How many replicas must confirm an acknowledged write, and for how long to wait."""

    replicas: int = 0
    timeout_ms: int = 2_000

    @classmethod
    def from_settings(cls, settings: Settings) -> ReplicaWait:
        return cls(settings.wait_replicas, settings.wait_replicas_timeout_ms)

    async def write(
        self, redis: aioredis.Redis, call: Callable[[aioredis.Redis], Awaitable[_T]]
    ) -> _T:
        """``call(link)``, then, when replicas are asked for, ``WAIT`` on the same link.

        Raises :class:`NotReplicated` when fewer replicas confirmed it in time."""
        if self.replicas <= 0:
            return await call(redis)
        # A client of its own on one connection of the same pool (given back on close);
        # on a cluster, of the pool of the node the write goes to.
        link = own_link(redis)
        try:
            result = await call(link)
            acked = int(await link.wait(self.replicas, self.timeout_ms))
        finally:
            await link.aclose()
        if acked < self.replicas:
            raise NotReplicated(acked, self.replicas, self.timeout_ms, result)
        return result

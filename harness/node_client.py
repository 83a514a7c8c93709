"""A blocking client of one Redis node for the benchmarks' counters and probes."""

from __future__ import annotations

import redis

__all__ = ["node_client"]

# INFO of a node busy with a benchmark's load may take seconds to answer.
_REPLY_S = 30.0


def node_client(url: str) -> redis.Redis:
    """A blocking client of the node at ``url`` (a cluster's nodes one by one: nothing
    here follows the slot map) that waits up to 30 s for a reply; replies decoded. It
    sends no ``CLIENT SETINFO``, so the node's command counts are the benchmark's own."""
    return redis.Redis.from_url(
        url,
        socket_timeout=_REPLY_S,
        socket_connect_timeout=5.0,
        decode_responses=True,
        driver_info=None,
    )

"""Every Redis client of turnbus comes from here: :func:`connect`.

The same shape on one Redis and on a Redis Cluster (``TURNBUS_REDIS_CLUSTER=1``):

- ordinary commands are multiplexed on one connection per node (:class:`MuxRedis`; on a
  cluster, :class:`ClusterMux` routes each command to its slot's master);
- blocking reads (``XREAD``/``XREADGROUP`` with ``BLOCK``), ``WAIT`` and pub/sub each
  take a connection of their own from the node's pool, which waits for a free
  connection (up to a deadline) rather than failing;
- :func:`dedicated_link` is a link with one user that may block it (the SSE hub's
  readers, one per node);
- :func:`own_link` is a connection of its own from a client's pool (a write and its
  ``WAIT``);
- :func:`connect_sync` is a plain blocking client of one node, for what runs outside an
  event loop: ``turnbus up``'s check of an external Redis, the local cluster's set-up.

What a role changes is only the pool: its size and how long a call may wait for a
connection. The URL's options are checked first (:func:`connection_options`): one the
client cannot honour is refused at start, with the setting named, never dropped.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Literal

import redis
import redis.asyncio as aioredis
from redis.asyncio import BlockingConnectionPool, Connection, UnixDomainSocketConnection
from redis.exceptions import RedisError

from turnbus.shared import redispy
from turnbus.shared.cluster import Address, ClusterMux
from turnbus.shared.mux import MuxRedis
from turnbus.shared.muxclient import mux_client
from turnbus.shared.settings import Settings, SettingsError
from turnbus.shared.transport import guarded_connection_class

__all__ = [
    "MeteredPool",
    "Role",
    "SyncRole",
    "check_cluster_mode",
    "connect",
    "connect_sync",
    "connection_options",
    "dedicated_link",
    "dedicated_link_of",
    "own_link",
    "pool_size",
    "pool_wait_ms",
    "seed_address",
]

Role = Literal["gateway", "worker", "status"]
# A blocking client's: "admin" (turnbus up's check of an external Redis, a local
# cluster's set-up) answers in 5 s or fails.
SyncRole = Literal["admin"]

# How fast the pool-wait signal forgets a spike (moving average weight of a sample).
_EWMA = 0.3
_WAIT_HALF_LIFE_S = 0.25
# URL query options the client honours: on the multiplexed link and on pooled
# connections alike. Anything else in the URL is refused by name.
_HONOURED = frozenset(
    {
        "db",
        "client_name",
        "socket_connect_timeout",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password",
        "ssl_check_hostname",
        "ssl_min_version",
        "ssl_ciphers",
    }
)
_WHY_NOT = {
    "socket_timeout": "replies on the multiplexed connection are timed by its own watchdog "
    "(a connection silent for 10 s with commands waiting is closed)",
    "socket_keepalive": "every multiplexed connection sets its own TCP keepalive",
    "socket_keepalive_options": "every multiplexed connection sets its own TCP keepalive",
    "retry_on_timeout": "retries are turnbus's own (TURNBUS_REDIS_RETRY_MS)",
    "retry_on_error": "retries are turnbus's own (TURNBUS_REDIS_RETRY_MS)",
    "health_check_interval": "the multiplexed connection runs no health checks",
    "protocol": "the multiplexed connection speaks RESP2 only",
    "max_connections": "pool sizes are TURNBUS_GATEWAY_REDIS_CONNECTIONS and "
    "TURNBUS_WORKER_REDIS_CONNECTIONS",
    "timeout": "pool waits are TURNBUS_GATEWAY_REDIS_WAIT_MS and TURNBUS_REDIS_POOL_TIMEOUT_MS",
    "decode_responses": "turnbus decides how replies are decoded",
    "encoding": "turnbus decides how replies are decoded",
    "encoding_errors": "turnbus decides how replies are decoded",
}


def connection_options(settings: Settings) -> dict[str, Any]:
    """The connection keyword arguments of ``TURNBUS_REDIS_URL``, once checked; raises
    :class:`SettingsError`, naming the setting and the option, for anything the client
    would not honour. Worked out once per URL (the SSE hub makes links often); each
    call returns a fresh copy. Its connection class raises ``ConnectionError`` for what a
    dead transport raises (:mod:`turnbus.shared.transport`)."""
    options = dict(_url_options(settings.redis_url, settings.redis_cluster))
    options["connection_class"] = guarded_connection_class(
        options.get("connection_class", Connection)
    )
    return options


@functools.lru_cache(maxsize=8)
def _url_options(url: str, cluster: bool, sync: bool = False) -> dict[str, Any]:
    """The URL's connection options for redis-py's asyncio connections (``sync``: its
    blocking ones, whose connection classes are others), once checked."""
    try:
        options = redispy.url_options(url, sync=sync)
    except ValueError as exc:
        raise SettingsError(f"TURNBUS_REDIS_URL: {exc}") from None
    for name in options:
        if name in _WHY_NOT:
            raise SettingsError(
                f"TURNBUS_REDIS_URL: the option {name!r} is not supported: {_WHY_NOT[name]}"
            )
    query = {k for k in options if k not in {"username", "password", "host", "port", "path"}}
    query -= {"connection_class"}
    unknown = sorted(query - _HONOURED)
    if unknown:
        raise SettingsError(
            f"TURNBUS_REDIS_URL: unknown option {unknown[0]!r} (supported: "
            + ", ".join(sorted(_HONOURED))
            + ")"
        )
    if cluster:
        if options.get("connection_class") in (
            UnixDomainSocketConnection,
            redis.UnixDomainSocketConnection,
        ):
            raise SettingsError(
                "TURNBUS_REDIS_URL: a unix:// socket cannot reach a Redis Cluster "
                "(TURNBUS_REDIS_CLUSTER=1): give a redis:// or rediss:// node address"
            )
        if options.get("db"):
            raise SettingsError(
                "TURNBUS_REDIS_URL: a Redis Cluster has only database 0 "
                f"(TURNBUS_REDIS_CLUSTER=1), the URL selects {options['db']}"
            )
    if redispy.TAKES_DRIVER_INFO:
        # No CLIENT SETINFO round trips (and package-metadata reads) per new connection.
        options["driver_info"] = None
    return options


def seed_address(options: dict[str, Any]) -> Address:
    return str(options.get("host") or "localhost"), int(options.get("port") or 6379)


class MeteredPool(BlockingConnectionPool):
    """A blocking pool that remembers how long callers waited for a connection."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._wait_ms = 0.0  # moving average of recent waits, as of ``_wait_at``
        self._wait_at = time.monotonic()
        self.waits = 0  # calls that found no free connection

    @property
    def wait_ms(self) -> float:
        """Moving average of recent waits, halved every ``_WAIT_HALF_LIFE_S`` without a
        call: a saturated worker makes few calls, and must see the pressure ease."""
        idle = time.monotonic() - self._wait_at
        decay: float = 0.5 ** (idle / _WAIT_HALF_LIFE_S)
        return self._wait_ms * decay

    def _record(self, waited_ms: float) -> None:
        self._wait_ms = self.wait_ms * (1 - _EWMA) + waited_ms * _EWMA
        self._wait_at = time.monotonic()

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if redispy.has_free_connection(self):
            self._record(0.0)
            return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        began = time.monotonic()
        self.waits += 1
        try:
            return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        finally:
            self._record((time.monotonic() - began) * 1000)


def pool_size(settings: Settings, concurrency: int) -> int:
    """Pooled connections for one worker process (per node): the setting, else half the
    concurrency plus room for the background loops (the blocking read, the cancel
    subscription). The turns' commands share the multiplexed connection: a turn takes a
    pooled one only for the ``WAIT`` of an acknowledged write (``TURNBUS_WAIT_REPLICAS``),
    for a moment."""
    if settings.worker_redis_connections:
        return settings.worker_redis_connections
    return max(concurrency // 2, 8) + 8


def _pool_options(settings: Settings, role: Role, concurrency: int | None) -> dict[str, Any]:
    if role == "gateway":
        wait_s = settings.gateway_redis_wait_ms / 1000
        return {
            "max_connections": settings.gateway_redis_connections,
            "timeout": wait_s,
            "socket_connect_timeout": 2,
            # A reply slower than this means Redis is not healthy: the route answers 503.
            "socket_timeout": max(10.0, wait_s),
        }
    if role == "worker":
        return {
            "max_connections": pool_size(settings, concurrency or settings.worker_concurrency),
            "timeout": settings.redis_pool_timeout_ms / 1000,
            # A pooled call (a WAIT, a blocking read) never waits on a link that died
            # silently longer than the multiplexed link's watchdog would; pub/sub's
            # listen blocks without it.
            "socket_timeout": max(10.0, settings.wait_replicas_timeout_ms / 1000 + 5),
        }
    return {"max_connections": 16, "timeout": 30.0, "socket_connect_timeout": 5}


def connect(settings: Settings, role: Role, *, concurrency: int | None = None) -> aioredis.Redis:
    """The Redis client of one process's ``role`` (close it with ``aclose``).

    ``concurrency``: a worker's turns at once (its pool is sized from it). Nothing
    connects until the first command."""
    options = connection_options(settings)
    pool_options = _pool_options(settings, role, concurrency)
    pool_class = MeteredPool if role == "worker" else BlockingConnectionPool

    def node_client(host: str | None = None, port: int | None = None) -> MuxRedis:
        kwargs = {**pool_options, **options, "decode_responses": True}
        if host is not None:
            kwargs.update(host=host, port=port)
        return MuxRedis(
            pool_class(**kwargs),
            reply_timeout_s=settings.redis_reply_timeout_ms / 1000,
            max_in_flight=settings.redis_max_in_flight,
        )

    if not settings.redis_cluster:
        return node_client()
    return ClusterMux(
        node_client,
        [seed_address(options)],
        failover_wait_s=settings.redis_failover_wait_ms / 1000,
    )


async def check_cluster_mode(client: aioredis.Redis, settings: Settings) -> None:
    """Refuse a Redis whose kind is not the one ``TURNBUS_REDIS_CLUSTER`` says (a
    cluster node taken for one Redis answers most commands with ``MOVED``). A Redis that
    cannot be reached is not judged here: the first command meets it."""
    try:
        node = (await mux_client(client).masters())[0]
        info = await node.info("cluster")
    except (RedisError, OSError) as exc:
        if settings.redis_cluster and "cluster support disabled" in str(exc):
            raise SettingsError(
                "TURNBUS_REDIS_CLUSTER=1, but TURNBUS_REDIS_URL names a Redis that is not "
                "a cluster node: set TURNBUS_REDIS_CLUSTER=0"
            ) from None
        return
    enabled = str(info.get("cluster_enabled", "0")) == "1" if isinstance(info, dict) else False
    if enabled and not settings.redis_cluster:
        raise SettingsError(
            "TURNBUS_REDIS_URL names a Redis Cluster node: set TURNBUS_REDIS_CLUSTER=1"
        )


def dedicated_link(
    settings: Settings, address: Address | None = None, *, reply_timeout_s: float = 10.0
) -> MuxRedis:
    """A link with one user, which may block it (the SSE hub's links to one node);
    replies undecoded. ``address``: the node (``None``: the URL's)."""
    kwargs = {**connection_options(settings), "max_connections": 1, "socket_connect_timeout": 2}
    if address is not None:
        kwargs.update(host=address[0], port=address[1])
    return MuxRedis(
        BlockingConnectionPool(**kwargs), reply_timeout_s=reply_timeout_s, dedicated=True
    )


def dedicated_link_of(client: aioredis.Redis, *, reply_timeout_s: float) -> MuxRedis:
    """A link with one user, which may block it, to the one Redis ``client`` reaches,
    its connection made as ``client``'s are (address, credentials, TLS, decoding)."""
    return MuxRedis(
        redispy.pool_of_one(client.connection_pool),
        reply_timeout_s=reply_timeout_s,
        dedicated=True,
    )


def own_link(client: aioredis.Redis) -> aioredis.Redis:
    """A client of one connection of its own, from ``client``'s pool (given back on
    ``aclose``); on a cluster, of the pool of the master its first command routes to
    (:meth:`ClusterMux.pinned`)."""
    return mux_client(client).pinned()


def connect_sync(
    settings: Settings, role: SyncRole, *, address: Address | None = None
) -> redis.Redis:
    """A blocking redis-py client of one Redis node, for code outside an event loop
    (close it with ``close``): the URL's node, or ``address`` (a cluster's nodes are
    reached one by one: nothing here follows the slot map). The URL's options are
    checked as :func:`connect` checks them; decoded replies."""
    options = dict(_url_options(settings.redis_url, settings.redis_cluster, sync=True))
    timeout_s = 5.0
    options.update(socket_timeout=timeout_s, socket_connect_timeout=min(timeout_s, 5.0))
    if address is not None:
        options.update(host=address[0], port=address[1])
    return redis.Redis.from_pool(redis.ConnectionPool(**options, decode_responses=True))


def pool_wait_ms(client: aioredis.Redis) -> float:
    """How long calls have lately waited for a pooled connection (the worst node's)."""
    pools = [n.connection_pool for n in mux_client(client).node_clients]
    return max(
        (pool.wait_ms for pool in pools if isinstance(pool, MeteredPool)),
        default=0.0,
    )

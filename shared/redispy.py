"""The only module of turnbus that touches redis-py beyond its public API.

redis-py promises its command methods, its exceptions and what ``redis.asyncio``
exports; turnbus's own clients (:mod:`turnbus.shared.mux`, :mod:`turnbus.shared.cluster`,
:mod:`turnbus.shared.connect`) and the SSE hub lean on more than that: its reply-error
parser (which exception each ``-ERR`` line becomes, and ``MOVED``/``ASK``'s slot and
address), its RESP2 reply callbacks (every command method's reply shape), the options
that tell ``execute_command`` not to decode a reply or what an empty one means, the
non-transaction pipeline's constructor and command stack, a pool's connection class and
keyword arguments, an SSL connection's context, a blocking pool's "is a connection free"
test, the URL parser, a client's sign-in on its own connection, and the cluster slot of
a key. Each is imported here and given a name of ours; no other module imports a
redis-py private or undocumented name (a test greps the tree for them).

``pyproject.toml`` pins ``redis`` to the releases where all of them hold as used here
(:data:`SUPPORTED`). A release that drops or reshapes one fails at import with
:class:`RedisInternalsError`, naming the internal (:func:`check`), instead of a client
that misreads replies at its first command.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.exceptions as rex
from redis.asyncio.client import Pipeline
from redis.credentials import CredentialProvider

__all__ = [
    "EMPTY_REPLY_OPTION",
    "RESP2_CALLBACKS",
    "SUPPORTED",
    "TAKES_DRIVER_INFO",
    "UNDECODED",
    "UNDECODED_OPTION",
    "LinkSettings",
    "QueuedPipeline",
    "RedisInternalsError",
    "check",
    "close_pool_on_aclose",
    "has_free_connection",
    "link_settings",
    "open_connection",
    "pool_of_one",
    "reply_error",
    "url_options",
]

# The range pyproject.toml pins, said in the error.
SUPPORTED = "redis>=8.1,<9"


class RedisInternalsError(ImportError):
    """The installed redis-py lacks (or has reshaped) an internal turnbus uses."""


try:
    from redis._parsers.base import BaseParser
    from redis._parsers.response_callbacks import get_response_callbacks
    from redis.asyncio.connection import (
        AbstractConnection,
        BlockingConnectionPool,
        SSLConnection,
        UnixDomainSocketConnection,
    )
    from redis.asyncio.connection import parse_url as _parse_url
    from redis.client import EMPTY_RESPONSE, NEVER_DECODE, CaseInsensitiveDict
    from redis.connection import parse_url as _parse_url_sync
except ImportError as exc:  # pragma: no cover - only with an unsupported redis-py
    raise RedisInternalsError(
        f"redis {redis.__version__} lacks {exc.name or exc}: turnbus supports {SUPPORTED} "
        "(pyproject.toml)"
    ) from None


def _attr(dotted: str) -> Any:
    """``module.path:Name.attr`` imported and looked up."""
    module, _, name = dotted.partition(":")
    value: Any = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _takes(dotted: str, *names: str) -> Callable[[], bool]:
    def probe() -> bool:
        parameters = inspect.signature(_attr(dotted)).parameters
        return all(n in parameters for n in names)

    return probe


def _parses_errors() -> bool:
    parse = _attr("redis._parsers.base:BaseParser.parse_error")
    moved = parse("MOVED 3999 10.0.0.1:6381")
    return (
        isinstance(moved, rex.MovedError)
        and (moved.slot_id, moved.host, moved.port) == (3999, "10.0.0.1", 6381)
        and isinstance(parse("ASK 1 10.0.0.1:6381"), rex.AskError)
        and isinstance(parse("NOSCRIPT No matching script"), rex.NoScriptError)
        and isinstance(parse("LOADING Redis is loading"), rex.BusyLoadingError)
        and isinstance(parse("TRYAGAIN Multiple keys request"), rex.TryAgainError)
        and isinstance(parse("ERR anything else"), rex.ResponseError)
    )


def _resp2_callbacks() -> bool:
    callbacks = _attr("redis._parsers.response_callbacks:get_response_callbacks")(
        2, legacy_responses=True
    )
    table = _attr("redis.client:CaseInsensitiveDict")(callbacks)
    return bool(table["hgetall"](["a", "1"]) == {"a": "1"} and table["SET"]("OK") is True)


def _pool_shape() -> bool:
    from redis.asyncio.connection import ConnectionPool, SSLConnection

    pool = ConnectionPool(host="127.0.0.1", port=1)
    context = SSLConnection(host="127.0.0.1", port=1, driver_info=None).ssl_context
    return (
        pool.connection_kwargs.get("port") == 1
        and isinstance(pool.connection_class, type)
        and callable(context.get)
    )


def _pipeline_shape() -> bool:
    from redis.asyncio.client import Pipeline
    from redis.asyncio.connection import ConnectionPool

    pipe = Pipeline(ConnectionPool(), {}, False, None)
    return pipe.command_stack == [] and callable(pipe.pipeline_execute_command)


def _own_link() -> bool:
    from redis.asyncio import Redis
    from redis.asyncio.connection import ConnectionPool

    client = Redis(connection_pool=ConnectionPool(), single_connection_client=True)
    return (
        isinstance(client.auto_close_connection_pool, bool)
        and callable(client.initialize)
        and _takes("redis.asyncio:Redis.aclose", "close_connection_pool")()
    )


# What each internal is, as said in the error, and how it is checked.
_PROBES: tuple[tuple[str, Callable[[], bool]], ...] = (
    (
        "redis._parsers.base.BaseParser.parse_error (an error reply to its exception, "
        "MOVED/ASK with slot_id, host, port): the mux's reply reader",
        _parses_errors,
    ),
    (
        "redis._parsers.response_callbacks.get_response_callbacks(2, "
        "legacy_responses=True) and redis.client.CaseInsensitiveDict: the RESP2 reply "
        "callbacks the mux parses replies with",
        _resp2_callbacks,
    ),
    (
        "redis.client.EMPTY_RESPONSE and NEVER_DECODE: the execute_command options the mux honours",
        lambda: bool(_attr("redis.client:EMPTY_RESPONSE") and _attr("redis.client:NEVER_DECODE")),
    ),
    (
        "redis.asyncio.client.Pipeline(connection_pool, response_callbacks, transaction, "
        "shard_hint), its command_stack and pipeline_execute_command: the mux's and the "
        "cluster client's pipelines",
        _pipeline_shape,
    ),
    (
        "redis.asyncio.connection.ConnectionPool.connection_kwargs and connection_class, "
        "SSLConnection.ssl_context.get(): the settings the mux connects with",
        _pool_shape,
    ),
    (
        "redis.asyncio.connection.BlockingConnectionPool.can_get_connection(): the "
        "worker's pool-wait meter",
        lambda: callable(
            _attr("redis.asyncio.connection:BlockingConnectionPool.can_get_connection")
        ),
    ),
    (
        "redis.asyncio.connection.parse_url: the URL options checked at start",
        lambda: callable(_attr("redis.asyncio.connection:parse_url")),
    ),
    (
        "redis.asyncio.Redis(connection_pool=..., single_connection_client=...), its "
        "initialize(), and aclose() closing the pool by auto_close_connection_pool: a "
        "write's own link for WAIT, and a client closing its pool",
        _own_link,
    ),
)


def check(probes: tuple[tuple[str, Callable[[], bool]], ...] = _PROBES) -> None:
    """Raise :class:`RedisInternalsError` naming the first internal that is missing or
    does not behave as turnbus uses it."""
    for what, probe in probes:
        try:
            ok = probe()
        except Exception as exc:
            raise RedisInternalsError(
                f"redis {redis.__version__} lacks {what} ({type(exc).__name__}: {exc}); "
                f"turnbus supports {SUPPORTED} (pyproject.toml)"
            ) from None
        if not ok:
            raise RedisInternalsError(
                f"redis {redis.__version__} changed {what}; turnbus supports {SUPPORTED} "
                "(pyproject.toml)"
            )


check()


# -- what turnbus uses, under names of its own ------------------------------------------

# execute_command options: the reply as Redis sent it (bytes), whatever the client's
# decode_responses; and what an error reply stands for instead of being raised.
UNDECODED_OPTION: str = NEVER_DECODE
EMPTY_REPLY_OPTION: str = EMPTY_RESPONSE
UNDECODED: Mapping[str, Any] = {NEVER_DECODE: True}

# redis-py's RESP2 reply callbacks (every command method's reply shape), built once:
# read only, shared by every client (building them costs more than a link's other setup).
RESP2_CALLBACKS: Mapping[str, Any] = CaseInsensitiveDict(
    get_response_callbacks(2, legacy_responses=True)  # type: ignore[arg-type]
)


# Whether redis-py's connections take ``driver_info`` (read once: inspecting a signature
# is slow, and links are made often).
TAKES_DRIVER_INFO = "driver_info" in inspect.signature(AbstractConnection.__init__).parameters


def reply_error(message: str) -> Exception:
    """The exception redis-py raises for an error reply (``MOVED``/``ASK`` with their slot
    and address, ``-LOADING`` as ``BusyLoadingError``, ...)."""
    error: Exception = BaseParser.parse_error(message)  # type: ignore[no-untyped-call]
    return error


def url_options(url: str, *, sync: bool = False) -> dict[str, Any]:
    """A Redis URL as redis-py's connection keyword arguments: for its asyncio
    connections, or (``sync``) its blocking ones, whose connection classes are others.
    Raises ``ValueError`` for a URL redis-py cannot read."""
    parsed = _parse_url_sync(url) if sync else _parse_url(url)  # type: ignore[no-untyped-call]
    return dict(parsed)


@dataclasses.dataclass(frozen=True, slots=True)
class LinkSettings:
    """How a redis-py pool's connections reach their node and sign in."""

    host: str
    port: int
    path: str | None  # a unix socket's (then host and port are unused)
    username: str | None
    password: str | None
    db: int
    client_name: str | None
    connect_timeout_s: float | None
    decode_responses: bool
    tls: Callable[[], ssl.SSLContext] | None  # the TLS context of a rediss:// link
    credentials: CredentialProvider | None = None  # asked afresh at each connect

    @property
    def where(self) -> str:
        """``host:port``, or the socket's path."""
        return self.path if self.path is not None else f"{self.host}:{self.port}"

    @property
    def address(self) -> tuple[str, int] | None:
        """``(host, port)``; ``None`` for a unix socket."""
        return None if self.path is not None else (self.host, self.port)


def link_settings(pool: aioredis.ConnectionPool) -> LinkSettings:
    """What ``pool``'s connections are made with (its connection class and keyword
    arguments), for a link that connects by itself."""
    kwargs = pool.connection_kwargs
    cls = pool.connection_class
    path = str(kwargs["path"]) if issubclass(cls, UnixDomainSocketConnection) else None
    tls: Callable[[], ssl.SSLContext] | None = None
    if path is None and issubclass(cls, SSLConnection):

        def tls() -> ssl.SSLContext:
            context: ssl.SSLContext = cls(**kwargs).ssl_context.get()
            return context

    timeout = kwargs.get("socket_connect_timeout")
    return LinkSettings(
        host=str(kwargs.get("host") or "localhost"),
        port=int(kwargs.get("port") or 6379),
        path=path,
        username=kwargs.get("username"),
        password=kwargs.get("password"),
        db=int(kwargs.get("db") or 0),
        client_name=kwargs.get("client_name") or None,
        connect_timeout_s=float(timeout) if timeout else None,
        decode_responses=bool(kwargs.get("decode_responses", False)),
        tls=tls,
        credentials=kwargs.get("credential_provider"),
    )


def pool_of_one(pool: aioredis.ConnectionPool) -> BlockingConnectionPool:
    """A pool of one connection, made as ``pool``'s are (the same connection class and
    keyword arguments): a link of its own to the same Redis."""
    return BlockingConnectionPool(
        connection_class=pool.connection_class, max_connections=1, **pool.connection_kwargs
    )


def has_free_connection(pool: BlockingConnectionPool) -> bool:
    """Whether a call would get a pooled connection without waiting."""
    return bool(pool.can_get_connection())


def close_pool_on_aclose(client: aioredis.Redis) -> None:
    """``client.aclose()`` closes its pool too (a client built on a pool of its own)."""
    client.auto_close_connection_pool = True


def open_connection(client: aioredis.Redis) -> Awaitable[Any]:
    """Take and connect the one connection of a ``single_connection_client`` now (its
    connect errors raised here, before any command is sent on it)."""
    return client.initialize()


class QueuedPipeline(Pipeline):
    """redis-py's non-transaction pipeline on ``client``: command methods queue their
    command (with the options its reply is parsed with); a subclass takes the queue with
    :meth:`take_queued` and sends it its own way."""

    def __init__(self, client: aioredis.Redis) -> None:
        super().__init__(client.connection_pool, client.response_callbacks, False, None)

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return self.pipeline_execute_command(*args, **kwargs)  # type: ignore[no-untyped-call]

    def take_queued(self) -> list[tuple[Sequence[Any], Mapping[str, Any]]]:
        """The commands queued so far, as ``(args, options)``; the queue is left empty."""
        stack, self.command_stack = self.command_stack, []
        return stack  # type: ignore[return-value]

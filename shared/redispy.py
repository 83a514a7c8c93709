"""The parts of redis-py that are not its public API and that turnbus's own clients use
(:mod:`turnbus.shared.mux`, :mod:`turnbus.shared.cluster`, :mod:`turnbus.shared.connect`), imported here only
and checked once, when :mod:`turnbus.shared.mux` or :mod:`turnbus.shared.cluster` first imports them.

redis-py promises its command methods and its exceptions; the multiplexed link leans on
more than that: its reply-error parser (which exception each ``-ERR`` line becomes, and
``MOVED``/``ASK``'s slot and address), its RESP2 reply callbacks (every command method's
reply shape), the options that tell ``execute_command`` not to decode a reply or what an
empty one means, the non-transaction pipeline's constructor and command stack, a pool's
connection class and keyword arguments, an SSL connection's context, and a blocking
pool's "is a connection free" test. ``pyproject.toml`` pins ``redis`` to the releases
where all of them hold as used here (:data:`SUPPORTED`: 8.1, the one installed and
tested; 8.0 and redis-py's main branch have the same). A release that drops or reshapes
one fails :func:`check` with :class:`RedisInternalsError`, naming the internal, at
import, instead of a client that misreads replies at its first command.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import redis
import redis.exceptions as rex

__all__ = ["SUPPORTED", "RedisInternalsError", "check"]

# The range pyproject.toml pins, said in the error.
SUPPORTED = "redis>=8.1,<9"


class RedisInternalsError(ImportError):
    """The installed redis-py lacks (or has reshaped) an internal turnbus uses."""


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
    (
        "redis.crc.key_slot: the cluster client's slot of a key",
        lambda: (
            _attr("redis.crc:key_slot")(b"{user:session}")
            == _attr("redis.crc:key_slot")(b"user:session")
        ),
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

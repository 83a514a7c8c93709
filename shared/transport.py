"""What a dead transport raises, made a ``ConnectionError`` on every kind of link.

A connection that the peer reset or that was closed under a command does not always
fail with an ``OSError``: uvloop (which the services run on) refuses an operation on a
closed transport with ``RuntimeError: unable to perform operation on <TCPTransport
closed=True …>; the handler is closed``, and redis-py lets that through as it is. Every
retry path of turnbus catches ``redis.exceptions.ConnectionError``, so such an error
would unwind a worker's read loop, a pub/sub listener or a turn as if it were a bug.

:func:`lost_link_error` tells such an error apart and says it as a ``ConnectionError``;
:func:`guarded_connection_class` is redis-py's connection class of a pool (plain, TLS or
unix socket) whose writes and reads raise that instead: the pools of the blocking reads,
``WAIT``'s own links and pub/sub use it. The multiplexed link
(:mod:`turnbus.shared.mux`) checks its own writes with :func:`lost_link_error`.
"""

from __future__ import annotations

import functools
from typing import Any

import redis.exceptions
from redis.asyncio import Connection, UnixDomainSocketConnection

__all__ = ["guarded_connection_class", "lost_link_error"]

# A redis-py asyncio connection class: plain or TLS (a Connection), or a unix socket's.
_ConnectionClass = type[Connection] | type[UnixDomainSocketConnection]

# What uvloop's transports say when asked to write or read once closed (asyncio's own
# fail with OSError subclasses, which redis-py already makes ConnectionError).
_CLOSED_MARKS = ("the handler is closed", "closed=true")


def lost_link_error(exc: BaseException) -> redis.exceptions.ConnectionError | None:
    """``exc`` as the ``ConnectionError`` of a lost link, when it is what a closed
    transport raises (else ``None``)."""
    if isinstance(exc, redis.exceptions.ConnectionError):
        return exc
    if isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _CLOSED_MARKS):
        return redis.exceptions.ConnectionError(f"Redis connection lost: {exc}")
    return None


class _LostLinkIsConnectionError:
    """Mixed into a redis-py connection class: a write or a read on a transport that is
    already closed raises ``ConnectionError`` (redis-py has dropped the connection by
    then; the pool connects again for the next command)."""

    async def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
        try:
            await super().send_packed_command(*args, **kwargs)  # type: ignore[misc]
        except RuntimeError as exc:
            lost = lost_link_error(exc)
            if lost is None:
                raise
            raise lost from exc

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except RuntimeError as exc:
            lost = lost_link_error(exc)
            if lost is None:
                raise
            raise lost from exc


@functools.cache
def guarded_connection_class(cls: _ConnectionClass) -> _ConnectionClass:
    """``cls`` (a redis-py asyncio connection class) whose lost-transport errors are
    ``ConnectionError``; the same class for the same ``cls``."""
    if issubclass(cls, _LostLinkIsConnectionError):
        return cls
    return type(f"Guarded{cls.__name__}", (_LostLinkIsConnectionError, cls), {})

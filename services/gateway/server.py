"""Run the gateway under uvicorn (uvloop, httptools with request deadlines) until SIGINT or
SIGTERM."""

from __future__ import annotations

import logging
import re
import resource
import socket
from types import FrameType
from typing import Any

import uvicorn

from turnbus.gateway.app import create_app
from turnbus.gateway.connections import GuardedHttpToolsProtocol, guarded_protocol
from turnbus.gateway.state import Gateway
from turnbus.shared.runtime import tune_gc
from turnbus.shared.settings import Settings

__all__ = [
    "AccessTokenRedactor",
    "GatewayServer",
    "make_server",
    "redact_tokens",
    "serve",
]

_TOKEN_RE = re.compile(r"([?&]access_token=)[^&#\s]*", re.IGNORECASE)
GRACEFUL_SHUTDOWN_S = 10
KEEP_ALIVE_S = 30
# File descriptors kept back from client connections: the Redis pool (64), the SSE
# hub's connection, the listening socket, logs.
RESERVED_FDS = 128

log = logging.getLogger(__name__)


def connection_cap(setting: int) -> int:
    """``TURNBUS_MAX_CONNECTIONS``, lowered to fit the process's open-file limit.

    A process out of file descriptors cannot accept a connection nor open one to
    Redis, so ``/healthz`` and every request would fail; refusing at the cap keeps
    the process serving those already connected.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft - RESERVED_FDS >= setting:
        return setting
    cap = max(soft - RESERVED_FDS, 1)
    log.warning(
        "open-file limit %d: serving at most %d connections (TURNBUS_MAX_CONNECTIONS=%d)",
        soft,
        cap,
        setting,
    )
    return cap


def redact_tokens(text: str) -> str:
    """``text`` with every ``access_token`` query value replaced by ``***``."""
    return _TOKEN_RE.sub(r"\1***", text)


class AccessTokenRedactor(logging.Filter):
    """Keeps ``?access_token=`` values out of uvicorn's access log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(
                redact_tokens(arg) if isinstance(arg, str) else arg for arg in record.args
            )
        elif isinstance(record.msg, str):
            record.msg = redact_tokens(record.msg)
        return True


def _install_redactor() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, AccessTokenRedactor) for f in access.filters):
        access.addFilter(AccessTokenRedactor())


class GatewayServer(uvicorn.Server):
    """uvicorn's server, which also ends open SSE streams cleanly when told to exit, and
    accepts a burst of connections at once (:mod:`turnbus.gateway.connections`)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        protocol = self.config.http_protocol_class
        if not issubclass(protocol, GuardedHttpToolsProtocol) or not hasattr(self, "servers"):
            return
        listeners = []
        for server in self.servers:
            for sock in server.sockets or ():
                listener = socket.fromfd(sock.fileno(), sock.family, sock.type)
                listener.setblocking(False)
                listeners.append(listener)
        protocol.listeners = tuple(listeners)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # The duplicates keep the socket listening: they close with the server's.
        protocol = self.config.http_protocol_class
        if issubclass(protocol, GuardedHttpToolsProtocol):
            listeners, protocol.listeners = protocol.listeners, ()
            for listener in listeners:
                listener.close()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        app = self.config.app
        gateway: Gateway | None = getattr(getattr(app, "state", None), "gateway", None)
        if gateway is not None:
            gateway.hub.drain_threadsafe()


def make_server(settings: Settings, host: str, port: int, **overrides: Any) -> GatewayServer:
    """A configured, not yet started uvicorn server for the gateway app."""
    options: dict[str, Any] = {
        "loop": "uvloop",
        "http": guarded_protocol(
            header_timeout_s=settings.header_timeout_ms / 1000,
            body_timeout_s=settings.body_timeout_ms / 1000,
            max_connections=connection_cap(settings.max_connections),
        ),
        # One line per request is a cost on the hot path: opt in with TURNBUS_ACCESS_LOG=1.
        "access_log": settings.access_log,
        "lifespan": "on",
        "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S,
        # Longer than clients keep an idle connection for reuse (httpx 5 s, aiohttp 15 s):
        # at uvicorn's 5 s a client that reuses a connection just as it is closed loses
        # the request (a POST is not retried by httpx).
        "timeout_keep_alive": KEEP_ALIVE_S,
        "proxy_headers": False,
        "ws": "none",
    }
    options.update(overrides)
    config = uvicorn.Config(create_app(settings), host=host, port=port, **options)
    _install_redactor()
    return GatewayServer(config)


def serve(settings: Settings, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM, then drain SSE streams and close the Redis clients."""
    server = make_server(settings, host, port)
    tune_gc()
    server.run()

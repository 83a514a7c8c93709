"""Run the gateway under uvicorn (uvloop, httptools) until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import re
from types import FrameType
from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.state import Gateway
from shared.settings import Settings

__all__ = [
    "AccessTokenRedactor",
    "GatewayServer",
    "make_server",
    "redact_tokens",
    "serve",
]

_TOKEN_RE = re.compile(r"([?&]access_token=)[^&#\s]*", re.IGNORECASE)
GRACEFUL_SHUTDOWN_S = 10


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
    """uvicorn's server, which also ends open SSE streams cleanly when told to exit."""

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
        "http": "httptools",
        "access_log": True,
        "lifespan": "on",
        "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S,
        "proxy_headers": False,
        "ws": "none",
    }
    options.update(overrides)
    config = uvicorn.Config(create_app(settings), host=host, port=port, **options)
    _install_redactor()
    return GatewayServer(config)


def serve(settings: Settings, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM, then drain SSE streams and close the Redis clients."""
    make_server(settings, host, port).run()

"""The web console: static files shipped in this package, served at ``/console``.

No build step and no third-party origin: the page, its scripts and its stylesheet are
served from the gateway itself, so it works with ``TURNBUS_CORS_ORIGINS`` unset. The
token travels in the URL fragment (``/console#token=…``), which browsers never send to
a server; the page keeps it in sessionStorage and calls the API with it.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from turnbus.gateway.errors import not_found

__all__ = ["CONSOLE_DIR", "routes"]

CONSOLE_DIR = Path(__file__).with_name("console")

_FILES = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    # Generated from turnbus.shared.contracts (``make generate``).
    "statuses.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}

# Only our own script and stylesheet may run or load; the API is same-origin.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _file(name: str) -> Response:
    return FileResponse(CONSOLE_DIR / name, media_type=_FILES[name], headers=_HEADERS)


async def _index(request: Request) -> Response:
    return _file("index.html")


async def _asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in _FILES:
        raise not_found("no such console file")
    return _file(name)


def routes() -> list[Route]:
    """``/console`` (the page) and ``/console/<file>`` (its script, stylesheet and icon)."""
    return [
        Route("/console", _index, methods=["GET", "HEAD"]),
        Route("/console/", _index, methods=["GET", "HEAD"]),
        Route("/console/{name}", _asset, methods=["GET", "HEAD"]),
    ]

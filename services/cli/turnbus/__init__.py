"""turnbus: the ``turnbus`` command and the Python client of the HTTP API.

``from turnbus import Client, AsyncClient`` — see :mod:`turnbus.client`. The command
(``turnbus up | gateway | worker | token | chat | status``) is :mod:`turnbus.cli`; it
is the only package that stands on both the gateway and the worker.
"""

from __future__ import annotations

from turnbus.client import (
    ApiError,
    AsyncClient,
    AsyncEventStream,
    Client,
    Conflict,
    EventStream,
    Notes,
    NotFound,
    Session,
    SessionBusy,
    SessionPage,
    SessionQueueFull,
    SessionSummary,
    StreamLost,
    TurnAccepted,
    TurnbusError,
    Unauthorized,
    Unavailable,
)

__all__ = [
    "ApiError",
    "AsyncClient",
    "AsyncEventStream",
    "Client",
    "Conflict",
    "EventStream",
    "NotFound",
    "Notes",
    "Session",
    "SessionBusy",
    "SessionPage",
    "SessionQueueFull",
    "SessionSummary",
    "StreamLost",
    "TurnAccepted",
    "TurnbusError",
    "Unauthorized",
    "Unavailable",
]

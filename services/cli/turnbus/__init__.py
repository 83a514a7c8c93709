"""turnbus: durable agent turns over Redis Streams, in one package.

``from turnbus import Client, AsyncClient`` — see :mod:`turnbus.client`; importing it
imports no Redis client. ``turnbus.dev_token()`` signs a development token with the
secret of a running ``turnbus up``. The parts: :mod:`turnbus.shared` (what the gateway and the
worker both need), :mod:`turnbus.gateway`, :mod:`turnbus.worker`, and the command
(``turnbus up | gateway | worker | token | chat | status``): :mod:`turnbus.cli` and
``turnbus up``'s :mod:`turnbus.supervisor` are the only modules that import the
gateway or the worker.

The client's names are loaded on first use (:func:`__getattr__`), so the gateway and
the worker, which import this package, import neither the client nor httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from turnbus.devtoken import dev_token
from turnbus.shared.version import VERSION as __version__
from turnbus.stackfile import NoStack

if TYPE_CHECKING:
    # The client's names, for the type checker (at run time: __getattr__ below).
    from turnbus.client import *  # noqa: F403

# ruff: noqa: F405 (the client's names in __all__ come from the import above)
# Every name here but NoStack, __version__ and dev_token is the client's (its __all__; a
# test checks that the two lists agree), imported on first use.
__all__ = [
    "ERROR_CLASSES",
    "ActiveTurn",
    "ApiError",
    "Approval",
    "ApprovalAnswer",
    "ApprovalCallback",
    "AsyncApprovalCallback",
    "AsyncClient",
    "AsyncEventStream",
    "BadRequest",
    "Client",
    "ClientToolSpec",
    "Conflict",
    "EventStream",
    "InvalidAnswer",
    "NoStack",
    "NotFound",
    "Notes",
    "PayloadTooLarge",
    "PendingCall",
    "QuotaExceeded",
    "Session",
    "SessionBusy",
    "SessionPage",
    "SessionQueueFull",
    "SessionSummary",
    "StreamLost",
    "Tool",
    "ToolResultAnswer",
    "TurnAccepted",
    "TurnNotWaiting",
    "TurnRecord",
    "TurnUsage",
    "TurnWebhook",
    "TurnbusError",
    "Unauthorized",
    "Unavailable",
    "Unprocessable",
    "__version__",
    "dev_token",
]
_CLIENT_NAMES = frozenset(__all__) - {"NoStack", "__version__", "dev_token"}


def __getattr__(name: str) -> Any:
    """A client name, imported from :mod:`turnbus.client` on first use."""
    if name in _CLIENT_NAMES:
        value = getattr(importlib.import_module("turnbus.client"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'turnbus' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

"""turnbus: durable agent turns over Redis Streams, in one package.

``from turnbus import Client, AsyncClient`` — see :mod:`turnbus.client`; importing it
imports no Redis client. ``turnbus.dev_token()`` signs a development token with the
secret of a running ``turnbus up``. The parts: :mod:`turnbus.shared` (what the gateway and the
worker both need), :mod:`turnbus.gateway`, :mod:`turnbus.worker`, and the command
(``turnbus up | gateway | worker | token | chat | status``): :mod:`turnbus.cli` and
``turnbus up``'s :mod:`turnbus.supervisor` are the only modules that import the
gateway or the worker.
"""

from __future__ import annotations

from turnbus import client
from turnbus.client import *  # noqa: F403  (the client's public names, listed in its __all__)
from turnbus.devtoken import dev_token
from turnbus.shared.version import VERSION as __version__
from turnbus.stackfile import NoStack

__all__: list[str] = ["NoStack", "__version__", "dev_token"]
__all__ += client.__all__

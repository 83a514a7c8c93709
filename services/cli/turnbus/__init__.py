"""turnbus: the ``turnbus`` command and the Python client of the HTTP API.

``from turnbus import Client, AsyncClient`` — see :mod:`turnbus.client`. The command
(``turnbus up | gateway | worker | token | chat | status``) is :mod:`turnbus.cli`; it
is the only package that stands on both the gateway and the worker.
"""

from __future__ import annotations

from turnbus import client
from turnbus.client import *  # noqa: F403  (the client's public names, listed in its __all__)

__all__: list[str] = []
__all__ += client.__all__

"""The installed turnbus's version, as ``turnbus --version`` and ``GET /`` give it."""

from __future__ import annotations

from importlib import metadata

__all__ = ["VERSION"]


def _installed_version() -> str:
    try:
        return metadata.version("turnbus")
    except metadata.PackageNotFoundError:  # run from a tree that was never installed
        return "0+unknown"


VERSION = _installed_version()

"""Model clients behind one small protocol; :func:`make_model` gives the worker its one
client, a router over every configured provider."""

from __future__ import annotations

from turnbus.shared.settings import Settings
from turnbus.worker.models.base import ModelClient

__all__ = ["ModelClient", "make_model"]


def make_model(settings: Settings) -> ModelClient:
    """The worker's model client: :class:`~turnbus.worker.models.router.ModelRouter`."""
    from turnbus.worker.models.router import ModelRouter

    return ModelRouter(settings)

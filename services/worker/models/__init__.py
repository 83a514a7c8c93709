"""Model clients behind one small protocol; :func:`make_model` picks one from the settings."""

from __future__ import annotations

from turnbus.shared.settings import Settings
from turnbus.worker.models.base import ModelClient

__all__ = ["ModelClient", "UnknownModel", "make_model"]


class UnknownModel(ValueError):
    """``settings.model`` names no model client."""


def make_model(settings: Settings) -> ModelClient:
    """The configured model client. The implementations are imported on demand, so the
    scripted model never loads the Anthropic SDK."""
    if settings.model == "scripted":
        from turnbus.worker.models.scripted import ScriptedModel

        return ScriptedModel(settings)
    if settings.model == "anthropic":
        from turnbus.worker.models.anthropic import AnthropicModel

        return AnthropicModel(settings)
    raise UnknownModel(f"no model client named {settings.model!r}; use 'anthropic' or 'scripted'")

"""The model client a worker holds: one per configured provider, picked per round by the
request's ``model`` (``meta.selectedModel``).

``provider:model`` runs ``model`` on that provider; a bare name runs on the default
provider (``TURNBUS_MODEL``); unset, the provider's own default model. The engine sees
one :class:`~turnbus.worker.models.base.ModelClient` and never asks which it has. Each
provider's client is built at its first round, so a worker pays only for the SDKs its
sessions use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from turnbus.shared.providers import Provider, split_model
from turnbus.shared.settings import Settings
from turnbus.worker.models.base import (
    ModelClient,
    ModelError,
    ModelRequest,
    ModelWaiting,
    RoundResult,
    TextChunk,
)

__all__ = ["ModelRouter", "client_for", "provider_and_model"]


def client_for(settings: Settings, provider: Provider) -> ModelClient:
    """A new client of the provider's kind. The implementations are imported on demand,
    so the scripted model never loads an SDK."""
    if provider.kind == "scripted":
        from turnbus.worker.models.scripted import ScriptedModel

        return ScriptedModel(settings)
    if provider.kind == "anthropic":
        from turnbus.worker.models.anthropic import AnthropicModel

        return AnthropicModel(settings, provider=provider)
    from turnbus.worker.models.openai import OpenAIModel

    return OpenAIModel(settings, provider=provider)


def provider_and_model(settings: Settings, selected: str | None) -> tuple[str, str]:
    """The kind of provider (``anthropic``, ``openai``, ``scripted``) and the model a
    round with this ``selectedModel`` asks for, as the router picks them (for traces)."""
    name, model = split_model(selected)
    name = name or settings.model
    provider = settings.provider(name)
    kind = provider.kind if provider is not None else name
    if model is None and provider is not None:
        model = provider.model
    if model is None:
        defaults = {"anthropic": settings.anthropic_model, "openai": settings.openai_model}
        model = defaults.get(kind, kind)
    return kind, model


class ModelRouter:
    """See the module docstring. ``clients`` seeds the clients by provider name (tests)."""

    def __init__(self, settings: Settings, clients: dict[str, ModelClient] | None = None) -> None:
        self._settings = settings
        self._clients: dict[str, ModelClient] = dict(clients or {})
        self._default = settings.model
        self.name = settings.model

    def client(self, name: str) -> ModelClient:
        """The provider's client, built at its first use; ModelError when not configured."""
        client = self._clients.get(name)
        if client is not None:
            return client
        provider = self._settings.provider(name)
        if provider is None and name == self._default and name in ("anthropic", "openai"):
            # The default named without its key in the settings: the SDK reads its own
            # environment, and a missing key fails the turn with ``auth``.
            provider = Provider(name, name)
        if provider is None:
            raise ModelError("bad_request", f"no model provider {name!r} is configured here")
        client = self._clients[name] = client_for(self._settings, provider)
        return client

    def stream_round(
        self, request: ModelRequest
    ) -> AsyncIterator[TextChunk | ModelWaiting | RoundResult]:
        provider, model = split_model(request.model)
        try:
            client = self.client(provider or self._default)
        except ModelError as exc:
            return _failed(exc)  # raised where the engine reads the round
        if provider is not None:
            request = dataclasses.replace(request, model=model)
        return client.stream_round(request)

    async def aclose(self) -> None:
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.aclose()


async def _failed(error: ModelError) -> AsyncIterator[TextChunk | ModelWaiting | RoundResult]:
    raise error
    yield  # an async generator, never reached

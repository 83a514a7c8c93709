"""The model providers a deployment configures, and ``provider:model`` names.

A provider is a named endpoint of one kind (``anthropic``, ``openai`` for any
OpenAI-compatible Chat Completions API, ``scripted``). The gateway and the worker read
the same providers from the same environment (:meth:`Settings.from_env
<turnbus.shared.settings.Settings.from_env>`), so a session's ``selectedModel`` that
names a provider nobody configured is refused when it is written, not at turn time.

Where they come from (docs/models.md):

- ``scripted``: always;
- ``anthropic``: when ``ANTHROPIC_API_KEY`` is set (``ANTHROPIC_BASE_URL``);
- ``openai``: when ``OPENAI_API_KEY`` is set (``OPENAI_BASE_URL``, e.g. a vLLM or
  Ollama server);
- named endpoints, each configured when its key is set: env settings with the name in
  them, ``TURNBUS_PROVIDER_<NAME>_API_KEY`` / ``_BASE_URL`` / ``_MODEL`` / ``_KIND``
  (``openai`` by default), or the tables of the TOML or JSON file
  ``TURNBUS_PROVIDERS`` names (``[providers.<name>]`` with ``kind``,
  ``base_url``, ``model`` and ``api_key`` or ``api_key_env``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "KINDS",
    "SCRIPTED",
    "Provider",
    "ProviderError",
    "load_providers",
    "provider_of",
    "split_model",
]

KINDS = ("anthropic", "openai", "scripted")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_ENV = re.compile(r"^TURNBUS_PROVIDER_([A-Z0-9][A-Z0-9_]*?)_(API_KEY|BASE_URL|MODEL|KIND)$")
_FIELDS = {"API_KEY": "api_key", "BASE_URL": "base_url", "MODEL": "model", "KIND": "kind"}


class ProviderError(ValueError):
    """A provider setting cannot be used (a bad name, kind or file)."""


@dataclasses.dataclass(frozen=True)
class Provider:
    """One configured endpoint. ``model`` is its default model (None: the kind's)."""

    name: str
    kind: str
    api_key: str | None = dataclasses.field(default=None, repr=False)
    base_url: str | None = None
    model: str | None = None


SCRIPTED = Provider("scripted", "scripted")


def split_model(selected: str | None) -> tuple[str | None, str | None]:
    """``provider:model`` as ``(provider, model)``; a bare name is ``(None, name)``.

    The provider is what comes before the first colon, so a model name with a colon of
    its own (Ollama's ``qwen3:32b``) needs its provider named (``local:qwen3:32b``)."""
    if not selected:
        return None, None
    provider, colon, model = selected.partition(":")
    if not colon:
        return None, selected
    return provider, model or None


def provider_of(selected: str | None, names: Collection[str]) -> str | None:
    """The provider ``selected`` names when it is not one of ``names``, else None."""
    name, _ = split_model(selected)
    if name is None or name in names:
        return None
    return name


def _clean(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ProviderError(f"provider settings are strings, got {value!r}")
    return value.strip() or None


def _provider(name: str, fields: Mapping[str, Any], env: Mapping[str, str]) -> Provider | None:
    """The named endpoint, or None while it has no key (not configured)."""
    if not _NAME.match(name) or name in KINDS:
        raise ProviderError(
            f"provider name {name!r}: lower-case letters, digits, '-' and '_', "
            f"and not one of {', '.join(KINDS)}"
        )
    unknown = set(fields) - {"kind", "api_key", "api_key_env", "base_url", "model"}
    if unknown:
        raise ProviderError(f"provider {name!r}: unknown settings {', '.join(sorted(unknown))}")
    kind = _clean(fields.get("kind")) or "openai"
    if kind not in ("anthropic", "openai"):
        raise ProviderError(f"provider {name!r}: kind must be 'openai' or 'anthropic'")
    key = _clean(fields.get("api_key"))
    key_env = _clean(fields.get("api_key_env"))
    if key is None and key_env is not None:
        key = _clean(env.get(key_env))
    if key is None:
        return None
    return Provider(name, kind, key, _clean(fields.get("base_url")), _clean(fields.get("model")))


def _file_tables(path: str) -> dict[str, Any]:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ProviderError(f"TURNBUS_PROVIDERS {path!r}: {exc.strerror}") from None
    try:
        data: Any = json.loads(raw) if path.endswith(".json") else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProviderError(f"TURNBUS_PROVIDERS {path!r}: {exc}") from None
    tables = data.get("providers") if isinstance(data, dict) else None
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise ProviderError(f"TURNBUS_PROVIDERS {path!r}: expected a 'providers' table of tables")
    return tables


def load_providers(
    env: Mapping[str, str], *, anthropic_model: str, openai_model: str, file: str | None = None
) -> dict[str, Provider]:
    """Every configured provider by name (module docstring), ``scripted`` first;
    ``file``: the ``TURNBUS_PROVIDERS`` file's path."""
    out: dict[str, Provider] = {"scripted": SCRIPTED}
    key = _clean(env.get("ANTHROPIC_API_KEY"))
    if key:
        base = _clean(env.get("ANTHROPIC_BASE_URL"))
        out["anthropic"] = Provider("anthropic", "anthropic", key, base, anthropic_model)
    key = _clean(env.get("OPENAI_API_KEY"))
    if key:
        base = _clean(env.get("OPENAI_BASE_URL"))
        out["openai"] = Provider("openai", "openai", key, base, openai_model)
    named: dict[str, dict[str, Any]] = {}
    if file:
        for name, table in _file_tables(file).items():
            named[name] = dict(table)
    for var, value in env.items():
        match = _ENV.match(var)
        if match is not None:
            name = match.group(1).lower()
            named.setdefault(name, {})[_FIELDS[match.group(2)]] = value
    for name in sorted(named):
        provider = _provider(name, named[name], env)
        if provider is not None:
            out[name] = provider
    return out

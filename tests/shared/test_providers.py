"""The configured providers, from the environment and a file; provider:model names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turnbus.shared.providers import Provider, provider_of, split_model
from turnbus.shared.settings import Settings, SettingsError


def test_without_keys_only_the_scripted_model_is_configured_and_the_default() -> None:
    settings = Settings.from_env({})
    assert settings.model == "scripted"
    assert settings.providers == ()
    assert settings.configured_providers == (Provider("scripted", "scripted"),)


def test_openai_by_its_key_and_base_url() -> None:
    env = {"OPENAI_API_KEY": "sk-1", "OPENAI_BASE_URL": "http://127.0.0.1:11434/v1"}
    settings = Settings.from_env(env)
    assert settings.model == "openai"  # the only key set
    openai = settings.provider("openai")
    assert openai == Provider(
        "openai", "openai", "sk-1", "http://127.0.0.1:11434/v1", "gpt-4.1-mini"
    )
    assert "sk-1" not in repr(settings)


def test_anthropic_stays_the_default_when_both_keys_are_set() -> None:
    settings = Settings.from_env({"OPENAI_API_KEY": "a", "ANTHROPIC_API_KEY": "b"})
    assert settings.model == "anthropic"
    assert settings.provider_names == {"scripted", "anthropic", "openai"}
    assert Settings.from_env({"OPENAI_API_KEY": "a", "TURNBUS_MODEL": "scripted"}).model == (
        "scripted"
    )


def test_named_endpoints_from_env_settings_with_the_name_in_them() -> None:
    env = {
        "TURNBUS_PROVIDER_LOCAL_API_KEY": "none",
        "TURNBUS_PROVIDER_LOCAL_BASE_URL": "http://127.0.0.1:8000/v1",
        "TURNBUS_PROVIDER_LOCAL_MODEL": "qwen3-32b",
        "TURNBUS_PROVIDER_MY_AZURE_API_KEY": "az",
        "TURNBUS_PROVIDER_NOKEY_BASE_URL": "http://nowhere/v1",  # no key: not configured
        "TURNBUS_MODEL": "local",
    }
    settings = Settings.from_env(env)
    assert settings.model == "local"
    assert settings.provider("local") == Provider(
        "local", "openai", "none", "http://127.0.0.1:8000/v1", "qwen3-32b"
    )
    assert settings.provider("my_azure") == Provider("my_azure", "openai", "az")
    assert settings.provider("nokey") is None


def test_named_endpoints_from_a_toml_or_json_file(tmp_path: Path) -> None:
    toml = tmp_path / "providers.toml"
    toml.write_text(
        '[providers.local]\nbase_url = "http://127.0.0.1:8000/v1"\napi_key_env = "LOCAL_KEY"\n'
        'model = "qwen3-32b"\n\n[providers.other]\nkind = "anthropic"\napi_key = "k2"\n'
    )
    settings = Settings.from_env({"TURNBUS_PROVIDERS": str(toml), "LOCAL_KEY": "k1"})
    assert settings.provider("local") == Provider(
        "local", "openai", "k1", "http://127.0.0.1:8000/v1", "qwen3-32b"
    )
    assert settings.provider("other") == Provider("other", "anthropic", "k2")
    as_json = tmp_path / "providers.json"
    as_json.write_text(json.dumps({"providers": {"vllm": {"api_key": "k"}}}))
    assert Settings.from_env({"TURNBUS_PROVIDERS": str(as_json)}).provider("vllm")


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"TURNBUS_MODEL": "local"}, "TURNBUS_MODEL must name a configured provider"),
        ({"TURNBUS_PROVIDER_OPENAI_API_KEY": "k"}, "not one of"),
        ({"TURNBUS_PROVIDER_X_API_KEY": "k", "TURNBUS_PROVIDER_X_KIND": "grpc"}, "kind"),
        ({"TURNBUS_PROVIDERS": "/nonexistent/providers.toml"}, "TURNBUS_PROVIDERS"),
    ],
)
def test_unusable_provider_settings_are_refused_at_start(env: dict[str, str], match: str) -> None:
    with pytest.raises(SettingsError, match=match):
        Settings.from_env(env)


def test_a_provider_is_what_comes_before_the_first_colon() -> None:
    assert split_model(None) == (None, None)
    assert split_model("gpt-4.1") == (None, "gpt-4.1")
    assert split_model("openai:gpt-4.1-mini") == ("openai", "gpt-4.1-mini")
    assert split_model("local:qwen3:32b") == ("local", "qwen3:32b")
    assert split_model("local:") == ("local", None)
    names = {"scripted", "openai"}
    assert provider_of("openai:x", names) is None
    assert provider_of("x", names) is None
    assert provider_of("mistral:large", names) == "mistral"

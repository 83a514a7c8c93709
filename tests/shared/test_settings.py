from __future__ import annotations

import pytest

from turnbus.shared import caps
from turnbus.shared.settings import Settings, SettingsError


def test_defaults_without_environment() -> None:
    s = Settings.from_env({})
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    assert s.prefix == "tb"
    assert s.shards == 1
    assert s.model == "scripted"
    assert s.turn_wall_clock_ms == caps.TURN_WALL_CLOCK_MAX_MS
    assert s.jwt_secret is None


def test_model_follows_the_api_key_unless_set() -> None:
    assert Settings.from_env({"ANTHROPIC_API_KEY": "k"}).model == "anthropic"
    assert (
        Settings.from_env({"ANTHROPIC_API_KEY": "k", "TURNBUS_MODEL": "scripted"}).model
        == "scripted"
    )


def test_turnbus_redis_url_wins_over_redis_url() -> None:
    env = {"REDIS_URL": "redis://a:1/0", "TURNBUS_REDIS_URL": "redis://b:2/0"}
    assert Settings.from_env(env).redis_url == "redis://b:2/0"
    assert Settings.from_env({"REDIS_URL": "redis://a:1/0"}).redis_url == "redis://a:1/0"


def test_wall_clock_can_be_lowered_never_raised() -> None:
    assert Settings.from_env({"TURNBUS_TURN_WALL_CLOCK_MS": "500"}).turn_wall_clock_ms == 500
    with pytest.raises(SettingsError, match="TURNBUS_TURN_WALL_CLOCK_MS"):
        Settings.from_env({"TURNBUS_TURN_WALL_CLOCK_MS": str(caps.TURN_WALL_CLOCK_MAX_MS + 1)})


def test_bad_values_name_the_variable() -> None:
    with pytest.raises(SettingsError, match="TURNBUS_SHARDS must be an integer"):
        Settings.from_env({"TURNBUS_SHARDS": "many"})
    with pytest.raises(SettingsError, match="TURNBUS_MODEL"):
        Settings.from_env({"TURNBUS_MODEL": "gpt"})


def test_cors_origins_are_a_comma_list() -> None:
    s = Settings.from_env({"TURNBUS_CORS_ORIGINS": "https://a.example, https://b.example ,"})
    assert s.cors_origins == ("https://a.example", "https://b.example")


def test_secret_is_not_in_repr() -> None:
    assert "hunter2" not in repr(Settings.from_env({"TURNBUS_JWT_SECRET": "hunter2"}))


def test_webhook_settings_are_checked_at_start() -> None:
    secret = "whsec_" + "a2V5a2V5a2V5a2V5"
    base = {
        "TURNBUS_WEBHOOK_SECRET": secret,
        "TURNBUS_WEBHOOK_ALLOW": "Hooks.example.com, 10.0.0.7:8443",
    }
    settings = Settings.from_env({**base, "TURNBUS_WEBHOOK_URL": "https://hooks.example.com/t"})
    assert settings.webhook_allow == ("hooks.example.com", "10.0.0.7:8443")
    assert secret not in repr(settings)
    for bad in (
        {**base, "TURNBUS_WEBHOOK_URL": "https://elsewhere.example.com/"},
        {**base, "TURNBUS_WEBHOOK_URL": "http://169.254.169.254/"},
        {
            "TURNBUS_WEBHOOK_ALLOW": "hooks.example.com",
            "TURNBUS_WEBHOOK_URL": "https://hooks.example.com/",
        },
        {**base, "TURNBUS_WEBHOOK_SECRET": "whsec_not base64!"},
    ):
        with pytest.raises(SettingsError):
            Settings.from_env(bad)

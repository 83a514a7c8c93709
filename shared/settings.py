"""Every knob, with its default and its environment variable, read once.

Each field is documented in docs/operations.md's settings table; keep both in step.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from functools import cache
from typing import Any

from turnbus.shared import caps
from turnbus.shared.providers import SCRIPTED, Provider, ProviderError, load_providers
from turnbus.shared.webhooks import WebhookRefused, check_webhook_url, parse_secret

__all__ = ["Settings", "SettingsError", "get_settings"]

_DAY_MS = 86_400_000
# Ten years: a lifetime past it is a typo (and PEXPIRE's argument stays far from overflow).
_SESSION_TTL_DAYS_MAX = 3650.0


class SettingsError(ValueError):
    """A setting's environment value cannot be used."""


def _int(
    env: Mapping[str, str], name: str, default: int, *, lo: int = 0, hi: int | None = None
) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r}") from None
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise SettingsError(f"{name} must be {bound}, got {value}")
    return value


def _days(env: Mapping[str, str], name: str, default: float, *, hi: float) -> float:
    """A non-negative decimal number of days (``0``: off)."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(
            f"{name} must be a number of days such as 30 or 0.5, got {raw!r}"
        ) from None
    if not 0 <= value <= hi:  # NaN fails both
        raise SettingsError(f"{name} must be between 0 (off) and {hi:g} days, got {raw.strip()}")
    if 0 < value * _DAY_MS < 1:
        raise SettingsError(f"{name} is shorter than a millisecond: {raw.strip()}")
    return value


def _str(env: Mapping[str, str], name: str, default: str | None) -> str | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    return raw.strip()


@dataclasses.dataclass(frozen=True)
class Settings:
    """Resolved settings. Build with :meth:`from_env`; tests build them directly."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: bool = False
    redis_failover_wait_ms: int = 20_000
    # A connection that answers nothing this long while commands wait on it is closed.
    redis_reply_timeout_ms: int = 10_000
    # Commands waiting for replies on one shared connection before callers wait for room.
    redis_max_in_flight: int = 8192
    prefix: str = "tb"
    shards: int = 1
    jwt_secret: str | None = dataclasses.field(default=None, repr=False)
    # The default provider: the one a bare (or unset) selectedModel runs on.
    model: str = "scripted"
    anthropic_model: str = "claude-sonnet-4-6"
    openai_model: str = "gpt-4.1-mini"
    # The providers configured beside the scripted one (shared/providers.py): from the
    # keys, the named endpoints' env settings and the TURNBUS_PROVIDERS file.
    providers: tuple[Provider, ...] = ()
    anthropic_max_tokens: int = 4096
    model_max_retries: int = 4
    # How long a round may wait for a rate-limited (429) or overloaded (529) model key
    # before its turn fails: the key's gate holds every turn of the process meanwhile.
    model_wait_s: float = 180.0
    turn_wall_clock_ms: int = caps.TURN_WALL_CLOCK_MAX_MS
    # How long a turn paused for its caller (requires_action) waits for the answer; a
    # submit may ask for less (actionTimeoutS).
    action_timeout_s: int = 24 * 3600
    scripted_delay_ms: int = 0
    scripted_ttft_ms: int = 0
    scripted_tokens_per_s: int = 0
    scripted_rounds: int = 1
    cors_origins: tuple[str, ...] = ()
    # Tools: the modules (or .py files) holding the deployment's @tool functions, and
    # the MCP servers' config file (docs/tools.md).
    tools: tuple[str, ...] = ()
    mcp_config: str | None = None
    # Worker.
    # 2 workers (`turnbus up`) take 2,000 LLM-paced turns at once: one process served
    # 1,100 streaming turns with its event loop lagging < 100 ms (docs/benchmarks.md).
    worker_concurrency: int = 1024
    worker_redis_connections: int = 0
    redis_pool_timeout_ms: int = 30_000
    worker_max_loop_lag_ms: int = 200
    worker_max_pool_wait_ms: int = 100
    lease_ms: int = 15_000
    heartbeat_ms: int = 5_000
    claim_idle_ms: int = 30_000
    max_deliveries: int = 3
    # A turn accepted this long ago that no worker has started is enqueued again by the
    # sweeper (its work entry may have been lost between the submit's two calls).
    outbox_grace_ms: int = 30_000
    worker_forget_after_ms: int = 300_000
    redis_retry_ms: int = 10_000
    shutdown_grace_ms: int = 20_000
    # Replicas that must confirm a write before it is acknowledged (0: none), and how
    # long to wait for them (docs/operations.md, "Replicas").
    wait_replicas: int = 0
    wait_replicas_timeout_ms: int = 2_000
    # Streams.
    events_ttl_s: int = 24 * 3600
    events_maxlen: int = 10_000
    log_maxlen: int = 10_000
    # Gateway.
    sse_ping_s: int = 15
    sse_queue_size: int = 1_000
    # The SSE hub learns of new stream entries from Redis's client tracking (1), or
    # runs blocking reads over every followed stream (0; also what it falls back to when
    # Redis refuses CLIENT TRACKING).
    sse_tracking: bool = True
    idempotency_ttl_s: int = 24 * 3600
    # How long a session's keys live without a turn or a write of its user (0: forever).
    session_ttl_days: float = 0.0
    session_queue_max: int = 32
    # Per-user quotas (0: off); a token's ``quotas`` claim may lower each for its user.
    quota_running_turns: int = 0
    quota_queued_turns: int = 0
    quota_turns_per_minute: int = 0
    quota_tokens_per_day: int = 0
    gateway_redis_connections: int = 512
    gateway_redis_wait_ms: int = 30_000
    metrics_port: int = 0
    # Where a worker's health and metrics port listens: every interface by default, for
    # a container's probe and scraper; ``turnbus up`` sets its gateway's host.
    metrics_host: str = "0.0.0.0"
    access_log: bool = False
    token_max_ttl_s: int = 24 * 3600
    token_cache_size: int = 10_000
    header_timeout_ms: int = 10_000
    body_timeout_ms: int = 30_000
    max_connections: int = 8192
    # Requests worked on at once, arrival to answer: a burst of submits cannot stall
    # the open streams (docs/operations.md).
    gateway_admit: int = 64
    # Traces over OTLP/HTTP (the otel extra; docs/operations.md, "Tracing"), and whether
    # their spans may carry message text, tool arguments and results.
    otel: bool = False
    otel_capture_content: bool = False
    # Webhooks (docs/operations.md, "Webhooks"): the deployment's default receiver, the
    # hosts a receiver may be on, the signing key (``whsec_<base64>``), and delivery.
    webhook_url: str | None = None
    webhook_allow: tuple[str, ...] = ()
    webhook_secret: str | None = dataclasses.field(default=None, repr=False)
    webhook_timeout_ms: int = 10_000
    webhook_retry_ms: int = 5_000
    webhook_retry_max_ms: int = 3_600_000
    webhook_retry_window_s: int = 24 * 3600
    webhook_host_concurrency: int = 4
    webhook_poll_ms: int = 1_000

    @property
    def session_ttl_ms(self) -> int:
        """The session lifetime in ms (``0``: sessions never expire)."""
        return round(self.session_ttl_days * _DAY_MS)

    @property
    def configured_providers(self) -> tuple[Provider, ...]:
        """Every configured provider: the scripted model, then :attr:`providers`."""
        return (SCRIPTED, *(p for p in self.providers if p.name != "scripted"))

    def provider(self, name: str) -> Provider | None:
        """The configured provider of that name."""
        return next((p for p in self.configured_providers if p.name == name), None)

    @property
    def provider_names(self) -> frozenset[str]:
        """The names a selectedModel may put before its colon."""
        return frozenset(p.name for p in self.configured_providers)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        values = _models_from_env(env, cls)
        values.update(_webhooks_from_env(env))
        values.update(
            redis_url=_str(env, "TURNBUS_REDIS_URL", None)
            or _str(env, "REDIS_URL", None)
            or cls.redis_url,
            prefix=_str(env, "TURNBUS_PREFIX", cls.prefix) or cls.prefix,
            jwt_secret=_str(env, "TURNBUS_JWT_SECRET", None),
            cors_origins=_list(env, "TURNBUS_CORS_ORIGINS"),
            tools=_list(env, "TURNBUS_TOOLS"),
            mcp_config=_str(env, "TURNBUS_MCP_CONFIG", None),
            metrics_host=_str(env, "TURNBUS_METRICS_HOST", None) or cls.metrics_host,
            session_ttl_days=_days(
                env, "TURNBUS_SESSION_TTL_DAYS", cls.session_ttl_days, hi=_SESSION_TTL_DAYS_MAX
            ),
        )
        for field, (name, lo, hi) in _NUMBERS.items():
            default = getattr(cls, field)
            value = _int(env, name, int(default), lo=lo, hi=hi)
            values[field] = bool(value) if isinstance(default, bool) else value
        return cls(**values)


def _list(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """A comma-separated list, blanks dropped."""
    return tuple(item.strip() for item in (_str(env, name, "") or "").split(",") if item.strip())


def _models_from_env(env: Mapping[str, str], cls: type[Settings]) -> dict[str, Any]:
    """The default provider and the configured ones."""
    anthropic_model = (
        _str(env, "TURNBUS_ANTHROPIC_MODEL", cls.anthropic_model) or cls.anthropic_model
    )
    openai_model = _str(env, "TURNBUS_OPENAI_MODEL", cls.openai_model) or cls.openai_model
    try:
        providers = load_providers(
            env,
            anthropic_model=anthropic_model,
            openai_model=openai_model,
            file=_str(env, "TURNBUS_PROVIDERS", None),
        )
    except ProviderError as exc:
        raise SettingsError(str(exc)) from None
    fallback = next((n for n in ("anthropic", "openai") if n in providers), "scripted")
    model = _str(env, "TURNBUS_MODEL", fallback) or fallback
    if model not in providers and model not in ("anthropic", "openai"):
        names = ", ".join(sorted(providers))
        raise SettingsError(
            f"TURNBUS_MODEL must name a configured provider ({names}), got {model!r}"
        )
    return {
        "model": model,
        "anthropic_model": anthropic_model,
        "openai_model": openai_model,
        "providers": tuple(p for p in providers.values() if p is not SCRIPTED),
    }


def _webhooks_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """The default receiver, checked at start: its secret, its host."""
    webhook_allow = tuple(h.lower() for h in _list(env, "TURNBUS_WEBHOOK_ALLOW"))
    webhook_url = _str(env, "TURNBUS_WEBHOOK_URL", None)
    webhook_secret = _str(env, "TURNBUS_WEBHOOK_SECRET", None)
    try:
        if webhook_secret is not None:
            parse_secret(webhook_secret)
        if webhook_url is not None:
            if webhook_secret is None:
                raise ValueError("TURNBUS_WEBHOOK_URL needs TURNBUS_WEBHOOK_SECRET")
            check_webhook_url(webhook_url, webhook_allow)
    except (ValueError, WebhookRefused) as exc:
        raise SettingsError(str(exc)) from None
    return {
        "webhook_url": webhook_url,
        "webhook_allow": webhook_allow,
        "webhook_secret": webhook_secret,
    }


# The numeric settings: field → (environment variable, lowest, highest). A field whose
# default is a bool is a flag, 0 or 1.
_NUMBERS: dict[str, tuple[str, int, int | None]] = {
    "redis_cluster": ("TURNBUS_REDIS_CLUSTER", 0, 1),
    "redis_failover_wait_ms": ("TURNBUS_REDIS_FAILOVER_WAIT_MS", 0, None),
    "redis_reply_timeout_ms": ("TURNBUS_REDIS_REPLY_TIMEOUT_MS", 500, 600_000),
    "redis_max_in_flight": ("TURNBUS_REDIS_MAX_IN_FLIGHT", 1, 1_000_000),
    "shards": ("TURNBUS_SHARDS", 1, 1024),
    "anthropic_max_tokens": ("TURNBUS_ANTHROPIC_MAX_TOKENS", 1, None),
    "model_max_retries": ("TURNBUS_MODEL_MAX_RETRIES", 0, 20),
    "model_wait_s": ("TURNBUS_MODEL_WAIT_S", 0, 3600),
    "turn_wall_clock_ms": ("TURNBUS_TURN_WALL_CLOCK_MS", 1, caps.TURN_WALL_CLOCK_MAX_MS),
    "action_timeout_s": ("TURNBUS_ACTION_TIMEOUT_S", 1, caps.ACTION_TIMEOUT_MAX_S),
    "scripted_delay_ms": ("TURNBUS_SCRIPTED_DELAY_MS", 0, None),
    "scripted_ttft_ms": ("TURNBUS_SCRIPTED_TTFT_MS", 0, caps.TURN_WALL_CLOCK_MAX_MS),
    "scripted_tokens_per_s": ("TURNBUS_SCRIPTED_TOKENS_PER_S", 0, 1_000_000),
    "scripted_rounds": ("TURNBUS_SCRIPTED_ROUNDS", 1, caps.MAX_MODEL_ROUNDS + 1),
    "worker_concurrency": ("TURNBUS_WORKER_CONCURRENCY", 1, 4096),
    "worker_redis_connections": ("TURNBUS_WORKER_REDIS_CONNECTIONS", 0, 4096),
    "redis_pool_timeout_ms": ("TURNBUS_REDIS_POOL_TIMEOUT_MS", 1, None),
    "worker_max_loop_lag_ms": ("TURNBUS_WORKER_MAX_LOOP_LAG_MS", 1, None),
    "worker_max_pool_wait_ms": ("TURNBUS_WORKER_MAX_POOL_WAIT_MS", 1, None),
    "lease_ms": ("TURNBUS_LEASE_MS", 100, None),
    "heartbeat_ms": ("TURNBUS_HEARTBEAT_MS", 50, None),
    "claim_idle_ms": ("TURNBUS_CLAIM_IDLE_MS", 100, None),
    "max_deliveries": ("TURNBUS_MAX_DELIVERIES", 1, None),
    "outbox_grace_ms": ("TURNBUS_OUTBOX_GRACE_MS", 100, None),
    "redis_retry_ms": ("TURNBUS_REDIS_RETRY_MS", 0, None),
    "worker_forget_after_ms": ("TURNBUS_WORKER_FORGET_AFTER_MS", 100, None),
    "shutdown_grace_ms": ("TURNBUS_SHUTDOWN_GRACE_MS", 0, None),
    "wait_replicas": ("TURNBUS_WAIT_REPLICAS", 0, 16),
    "wait_replicas_timeout_ms": ("TURNBUS_WAIT_REPLICAS_TIMEOUT_MS", 1, None),
    "events_ttl_s": ("TURNBUS_EVENTS_TTL_S", 1, None),
    "events_maxlen": ("TURNBUS_EVENTS_MAXLEN", 10, None),
    "log_maxlen": ("TURNBUS_LOG_MAXLEN", 10, None),
    "sse_ping_s": ("TURNBUS_SSE_PING_S", 1, None),
    "sse_queue_size": ("TURNBUS_SSE_QUEUE_SIZE", 1, None),
    "sse_tracking": ("TURNBUS_SSE_TRACKING", 0, 1),
    "idempotency_ttl_s": ("TURNBUS_IDEMPOTENCY_TTL_S", 1, None),
    "session_queue_max": ("TURNBUS_SESSION_QUEUE_MAX", 1, 100_000),
    "quota_running_turns": ("TURNBUS_QUOTA_RUNNING_TURNS", 0, None),
    "quota_queued_turns": ("TURNBUS_QUOTA_QUEUED_TURNS", 0, None),
    "quota_turns_per_minute": ("TURNBUS_QUOTA_TURNS_PER_MINUTE", 0, None),
    "quota_tokens_per_day": ("TURNBUS_QUOTA_TOKENS_PER_DAY", 0, None),
    "gateway_redis_connections": ("TURNBUS_GATEWAY_REDIS_CONNECTIONS", 2, 65_536),
    "gateway_redis_wait_ms": ("TURNBUS_GATEWAY_REDIS_WAIT_MS", 1, None),
    "metrics_port": ("TURNBUS_METRICS_PORT", 0, 65535),
    "access_log": ("TURNBUS_ACCESS_LOG", 0, 1),
    "token_max_ttl_s": ("TURNBUS_TOKEN_MAX_TTL_S", 1, None),
    "token_cache_size": ("TURNBUS_TOKEN_CACHE_SIZE", 0, None),
    "header_timeout_ms": ("TURNBUS_HEADER_TIMEOUT_MS", 1, None),
    "body_timeout_ms": ("TURNBUS_BODY_TIMEOUT_MS", 1, None),
    "max_connections": ("TURNBUS_MAX_CONNECTIONS", 1, None),
    "gateway_admit": ("TURNBUS_GATEWAY_ADMIT", 0, 65_536),
    "otel": ("TURNBUS_OTEL", 0, 1),
    "otel_capture_content": ("TURNBUS_OTEL_CAPTURE_CONTENT", 0, 1),
    "webhook_timeout_ms": ("TURNBUS_WEBHOOK_TIMEOUT_MS", 100, 120_000),
    "webhook_retry_ms": ("TURNBUS_WEBHOOK_RETRY_MS", 10, None),
    "webhook_retry_max_ms": ("TURNBUS_WEBHOOK_RETRY_MAX_MS", 10, None),
    "webhook_retry_window_s": ("TURNBUS_WEBHOOK_RETRY_WINDOW_S", 1, None),
    "webhook_host_concurrency": ("TURNBUS_WEBHOOK_HOST_CONCURRENCY", 1, 256),
    "webhook_poll_ms": ("TURNBUS_WEBHOOK_POLL_MS", 10, None),
}


@cache
def get_settings() -> Settings:
    """The process's settings, read from the environment once."""
    return Settings.from_env()

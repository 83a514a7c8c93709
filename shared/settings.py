"""Every knob, with its default and its environment variable, read once.

Each field is documented in docs/operations.md's settings table; keep both in step.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from functools import cache

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
        origins = _str(env, "TURNBUS_CORS_ORIGINS", "") or ""
        webhook_allow = tuple(
            h.strip().lower()
            for h in (_str(env, "TURNBUS_WEBHOOK_ALLOW", "") or "").split(",")
            if h.strip()
        )
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
        return cls(
            redis_url=_str(env, "TURNBUS_REDIS_URL", None)
            or _str(env, "REDIS_URL", None)
            or cls.redis_url,
            redis_cluster=bool(_int(env, "TURNBUS_REDIS_CLUSTER", int(cls.redis_cluster), hi=1)),
            redis_failover_wait_ms=_int(
                env, "TURNBUS_REDIS_FAILOVER_WAIT_MS", cls.redis_failover_wait_ms
            ),
            prefix=_str(env, "TURNBUS_PREFIX", cls.prefix) or cls.prefix,
            shards=_int(env, "TURNBUS_SHARDS", cls.shards, lo=1, hi=1024),
            jwt_secret=_str(env, "TURNBUS_JWT_SECRET", None),
            model=model,
            anthropic_model=anthropic_model,
            openai_model=openai_model,
            providers=tuple(p for p in providers.values() if p is not SCRIPTED),
            anthropic_max_tokens=_int(
                env, "TURNBUS_ANTHROPIC_MAX_TOKENS", cls.anthropic_max_tokens, lo=1
            ),
            model_max_retries=_int(env, "TURNBUS_MODEL_MAX_RETRIES", cls.model_max_retries, hi=20),
            model_wait_s=_int(env, "TURNBUS_MODEL_WAIT_S", int(cls.model_wait_s), hi=3600),
            turn_wall_clock_ms=_int(
                env,
                "TURNBUS_TURN_WALL_CLOCK_MS",
                cls.turn_wall_clock_ms,
                lo=1,
                hi=caps.TURN_WALL_CLOCK_MAX_MS,
            ),
            action_timeout_s=_int(
                env,
                "TURNBUS_ACTION_TIMEOUT_S",
                cls.action_timeout_s,
                lo=1,
                hi=caps.ACTION_TIMEOUT_MAX_S,
            ),
            scripted_delay_ms=_int(env, "TURNBUS_SCRIPTED_DELAY_MS", cls.scripted_delay_ms),
            scripted_ttft_ms=_int(
                env,
                "TURNBUS_SCRIPTED_TTFT_MS",
                cls.scripted_ttft_ms,
                hi=caps.TURN_WALL_CLOCK_MAX_MS,
            ),
            scripted_tokens_per_s=_int(
                env, "TURNBUS_SCRIPTED_TOKENS_PER_S", cls.scripted_tokens_per_s, hi=1_000_000
            ),
            scripted_rounds=_int(
                env,
                "TURNBUS_SCRIPTED_ROUNDS",
                cls.scripted_rounds,
                lo=1,
                hi=caps.MAX_MODEL_ROUNDS + 1,
            ),
            cors_origins=tuple(o.strip() for o in origins.split(",") if o.strip()),
            tools=tuple(
                m.strip() for m in (_str(env, "TURNBUS_TOOLS", "") or "").split(",") if m.strip()
            ),
            mcp_config=_str(env, "TURNBUS_MCP_CONFIG", None),
            worker_concurrency=_int(
                env, "TURNBUS_WORKER_CONCURRENCY", cls.worker_concurrency, lo=1, hi=4096
            ),
            worker_redis_connections=_int(
                env, "TURNBUS_WORKER_REDIS_CONNECTIONS", cls.worker_redis_connections, hi=4096
            ),
            redis_pool_timeout_ms=_int(
                env, "TURNBUS_REDIS_POOL_TIMEOUT_MS", cls.redis_pool_timeout_ms, lo=1
            ),
            worker_max_loop_lag_ms=_int(
                env, "TURNBUS_WORKER_MAX_LOOP_LAG_MS", cls.worker_max_loop_lag_ms, lo=1
            ),
            worker_max_pool_wait_ms=_int(
                env, "TURNBUS_WORKER_MAX_POOL_WAIT_MS", cls.worker_max_pool_wait_ms, lo=1
            ),
            lease_ms=_int(env, "TURNBUS_LEASE_MS", cls.lease_ms, lo=100),
            heartbeat_ms=_int(env, "TURNBUS_HEARTBEAT_MS", cls.heartbeat_ms, lo=50),
            claim_idle_ms=_int(env, "TURNBUS_CLAIM_IDLE_MS", cls.claim_idle_ms, lo=100),
            max_deliveries=_int(env, "TURNBUS_MAX_DELIVERIES", cls.max_deliveries, lo=1),
            outbox_grace_ms=_int(env, "TURNBUS_OUTBOX_GRACE_MS", cls.outbox_grace_ms, lo=100),
            redis_retry_ms=_int(env, "TURNBUS_REDIS_RETRY_MS", cls.redis_retry_ms),
            worker_forget_after_ms=_int(
                env, "TURNBUS_WORKER_FORGET_AFTER_MS", cls.worker_forget_after_ms, lo=100
            ),
            shutdown_grace_ms=_int(env, "TURNBUS_SHUTDOWN_GRACE_MS", cls.shutdown_grace_ms),
            wait_replicas=_int(env, "TURNBUS_WAIT_REPLICAS", cls.wait_replicas, hi=16),
            wait_replicas_timeout_ms=_int(
                env, "TURNBUS_WAIT_REPLICAS_TIMEOUT_MS", cls.wait_replicas_timeout_ms, lo=1
            ),
            events_ttl_s=_int(env, "TURNBUS_EVENTS_TTL_S", cls.events_ttl_s, lo=1),
            events_maxlen=_int(env, "TURNBUS_EVENTS_MAXLEN", cls.events_maxlen, lo=10),
            log_maxlen=_int(env, "TURNBUS_LOG_MAXLEN", cls.log_maxlen, lo=10),
            sse_ping_s=_int(env, "TURNBUS_SSE_PING_S", cls.sse_ping_s, lo=1),
            sse_queue_size=_int(env, "TURNBUS_SSE_QUEUE_SIZE", cls.sse_queue_size, lo=1),
            sse_tracking=bool(_int(env, "TURNBUS_SSE_TRACKING", int(cls.sse_tracking), hi=1)),
            idempotency_ttl_s=_int(env, "TURNBUS_IDEMPOTENCY_TTL_S", cls.idempotency_ttl_s, lo=1),
            session_ttl_days=_days(
                env, "TURNBUS_SESSION_TTL_DAYS", cls.session_ttl_days, hi=_SESSION_TTL_DAYS_MAX
            ),
            session_queue_max=_int(
                env, "TURNBUS_SESSION_QUEUE_MAX", cls.session_queue_max, lo=1, hi=100_000
            ),
            quota_running_turns=_int(env, "TURNBUS_QUOTA_RUNNING_TURNS", cls.quota_running_turns),
            quota_queued_turns=_int(env, "TURNBUS_QUOTA_QUEUED_TURNS", cls.quota_queued_turns),
            quota_turns_per_minute=_int(
                env, "TURNBUS_QUOTA_TURNS_PER_MINUTE", cls.quota_turns_per_minute
            ),
            quota_tokens_per_day=_int(
                env, "TURNBUS_QUOTA_TOKENS_PER_DAY", cls.quota_tokens_per_day
            ),
            gateway_redis_connections=_int(
                env,
                "TURNBUS_GATEWAY_REDIS_CONNECTIONS",
                cls.gateway_redis_connections,
                lo=2,
                hi=65_536,
            ),
            gateway_redis_wait_ms=_int(
                env, "TURNBUS_GATEWAY_REDIS_WAIT_MS", cls.gateway_redis_wait_ms, lo=1
            ),
            metrics_port=_int(env, "TURNBUS_METRICS_PORT", cls.metrics_port, hi=65535),
            metrics_host=_str(env, "TURNBUS_METRICS_HOST", None) or cls.metrics_host,
            access_log=bool(_int(env, "TURNBUS_ACCESS_LOG", int(cls.access_log), hi=1)),
            token_max_ttl_s=_int(env, "TURNBUS_TOKEN_MAX_TTL_S", cls.token_max_ttl_s, lo=1),
            token_cache_size=_int(env, "TURNBUS_TOKEN_CACHE_SIZE", cls.token_cache_size),
            header_timeout_ms=_int(env, "TURNBUS_HEADER_TIMEOUT_MS", cls.header_timeout_ms, lo=1),
            body_timeout_ms=_int(env, "TURNBUS_BODY_TIMEOUT_MS", cls.body_timeout_ms, lo=1),
            max_connections=_int(env, "TURNBUS_MAX_CONNECTIONS", cls.max_connections, lo=1),
            gateway_admit=_int(env, "TURNBUS_GATEWAY_ADMIT", cls.gateway_admit, hi=65_536),
            otel=bool(_int(env, "TURNBUS_OTEL", int(cls.otel), hi=1)),
            otel_capture_content=bool(
                _int(env, "TURNBUS_OTEL_CAPTURE_CONTENT", int(cls.otel_capture_content), hi=1)
            ),
            webhook_url=webhook_url,
            webhook_allow=webhook_allow,
            webhook_secret=webhook_secret,
            webhook_timeout_ms=_int(
                env, "TURNBUS_WEBHOOK_TIMEOUT_MS", cls.webhook_timeout_ms, lo=100, hi=120_000
            ),
            webhook_retry_ms=_int(env, "TURNBUS_WEBHOOK_RETRY_MS", cls.webhook_retry_ms, lo=10),
            webhook_retry_max_ms=_int(
                env, "TURNBUS_WEBHOOK_RETRY_MAX_MS", cls.webhook_retry_max_ms, lo=10
            ),
            webhook_retry_window_s=_int(
                env, "TURNBUS_WEBHOOK_RETRY_WINDOW_S", cls.webhook_retry_window_s, lo=1
            ),
            webhook_host_concurrency=_int(
                env, "TURNBUS_WEBHOOK_HOST_CONCURRENCY", cls.webhook_host_concurrency, lo=1, hi=256
            ),
            webhook_poll_ms=_int(env, "TURNBUS_WEBHOOK_POLL_MS", cls.webhook_poll_ms, lo=10),
        )


@cache
def get_settings() -> Settings:
    """The process's settings, read from the environment once."""
    return Settings.from_env()

"""``turnbus up``: the whole local stack — Redis, one gateway, N workers — in one command.

The supervisor runs each part as a child process in its own session (so a Ctrl-C in
the terminal reaches only the supervisor, which then stops the children in order:
gateway and workers first, Redis last). Children write their logs to
``<data-dir>/logs/<name>.log``; the terminal shows the supervisor's own lines.

Each worker serves its health and metrics on a port of its own (``TURNBUS_METRICS_PORT``
in its environment): consecutive ports from the one the user set, else free loopback
ports; a restarted worker keeps its port. The stack is ready once the gateway's
``/readyz`` and every worker's ``/healthz`` answer 200.

Restart policy: a gateway or worker that exits without being asked to is reported
and restarted with a growing delay (they are stateless; a restarted worker keeps
its consumer name, so it reads its own pending entries first). Five quick crashes
in a row of one child stop the stack. Redis exiting stops the stack: nothing works
without it, and its AOF is what a second ``up`` starts from.

The supervisor starts no threads, so it may set ``PR_SET_PDEATHSIG`` in each child
before exec: if the supervisor itself is killed, the children get SIGTERM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import http.client
import os
import re
import shlex
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import redis

from turnbus.devtoken import DEV_TOKEN_TTL_S
from turnbus.hints import show_path, turnbus_command
from turnbus.procs import (
    Child,
    UpError,
    check_listen,
    describe_exit,
    free_port,
    rotate,
    tail,
    wait_all,
)
from turnbus.redis_local import PrivateRedis, redact_url
from turnbus.shared.backoff import Backoff
from turnbus.shared.connect import connect_sync
from turnbus.shared.settings import Settings, SettingsError
from turnbus.stackfile import (
    DEFAULT_DATA_DIR,
    forget_stack,
    load_or_create_secret,
    read_stack_file,
    remember_stack,
    remove_stack_file,
    write_stack_file,
)

__all__ = ["UpError", "UpOptions", "run_up", "worker_metrics_ports"]

LOCK_FILE = "up.lock"
DEV_USER = "dev"

_POLL_S = 0.1
_QUICK_CRASH_S = 10.0
_MAX_QUICK_CRASHES = 5
# A service that crashed soon after its start waits 0.5 s before the next, doubling to 10 s.
_RESTART_BACKOFF = Backoff(0.5, 10.0)


@dataclasses.dataclass(frozen=True, slots=True)
class UpOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 2
    data_dir: Path = Path(DEFAULT_DATA_DIR)
    redis_port: int = 0  # 0: a free loopback port
    redis_server: str | None = None  # the binary; None: find_redis_server()
    log_level: str = "info"
    ready_timeout_s: float = 30.0


# --- the stack -------------------------------------------------------------------------


class _Stop(Exception):
    pass


class Stack:
    def __init__(self, options: UpOptions, env: Mapping[str, str]) -> None:
        self.options = options
        self.data_dir = options.data_dir.resolve()
        self.base_env = dict(env)
        self.redis: PrivateRedis | None = None
        self.redis_url = ""
        self.services: list[Child] = []
        # Each worker's health and metrics port, and the host they listen on.
        self.metrics_ports: list[int] = []
        self.metrics_host = ""
        self.signals = 0
        self._wake = threading.Event()
        self.exit_code = 0

    # signals

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1
        self._wake.set()

    def _interrupted(self) -> bool:
        return self.signals > 0

    @contextlib.contextmanager
    def _signal_handlers(self) -> Iterator[None]:
        previous = {
            sig: signal.signal(sig, self._on_signal)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    # startup

    @property
    def url(self) -> str:
        return _http_url(self.options.host, self.options.port)

    @property
    def worker_metrics_urls(self) -> list[str]:
        return [_http_url(self.metrics_host, port) + "/metrics" for port in self.metrics_ports]

    def _settings(self) -> Settings:
        try:
            return Settings.from_env(self.base_env)
        except SettingsError as exc:
            raise UpError(str(exc)) from None

    def _child_env(self, secret: str) -> dict[str, str]:
        env = dict(self.base_env)
        env["TURNBUS_REDIS_URL"] = self.redis_url
        env["TURNBUS_JWT_SECRET"] = secret
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _start_redis(self) -> None:
        external = self.base_env.get("TURNBUS_REDIS_URL") or self.base_env.get("REDIS_URL")
        if external and external.strip():
            self.redis_url = external.strip()
            warning = _check_external_redis(
                dataclasses.replace(self._settings(), redis_url=self.redis_url)
            )
            _say(f"redis    {redact_url(self.redis_url)} (from the environment)")
            if warning:
                _say(f"warning: {warning}")
            return
        self.redis = PrivateRedis(
            self.data_dir / "redis",
            self.data_dir / "logs" / "redis.log",
            port=self.options.redis_port,
            binary=self.options.redis_server,
        )
        self.redis.start(self._interrupted)
        if self._interrupted():
            raise _Stop
        self.redis_url = self.redis.url
        _say(
            f"redis    {self.redis.url} (pid {self.redis.child.pid if self.redis.child else '?'}, "
            f"AOF appendfsync everysec in {show_path(self.redis.directory)})"
        )

    def _start_services(self, secret: str, settings: Settings) -> None:
        env = self._child_env(secret)
        # The workers' metrics listen where the gateway does, unless the user says where.
        self.metrics_host = (
            settings.metrics_host
            if self.base_env.get("TURNBUS_METRICS_HOST", "").strip()
            else self.options.host
        )
        self.metrics_ports = worker_metrics_ports(
            settings.metrics_port,
            self.options.workers,
            host=self.metrics_host,
            taken={self.options.port},
        )
        self.services += _service_children(
            self.options, self.data_dir, env, self.metrics_host, self.metrics_ports
        )
        for child in self.services:
            rotate(child.log_path)
            child.start()

    def _not_ready(self) -> list[str]:
        """What does not answer 200 yet: the gateway's ``/readyz``, a worker's ``/healthz``."""
        waiting: list[str] = []
        if _http_status(_reachable(self.options.host), self.options.port, "/readyz") != 200:
            waiting.append("the gateway's /readyz")
        for i, port in enumerate(self.metrics_ports, start=1):
            if _http_status(_reachable(self.metrics_host), port, "/healthz") != 200:
                waiting.append(f"worker-{i}'s /healthz (port {port})")
        return waiting

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.options.ready_timeout_s
        waiting: list[str] = []
        while time.monotonic() < deadline:
            if self._interrupted():
                raise _Stop
            for child in self.services:
                code = child.poll()
                if code is not None:
                    raise UpError(
                        f"{child.name} {describe_exit(code)} while starting; "
                        f"{show_path(child.log_path)} ends:\n{tail(child.log_path)}"
                    )
            waiting = self._not_ready()
            if not waiting:
                return
            self._wake.wait(_POLL_S)
        raise UpError(
            f"{', '.join(waiting)} did not answer 200 within "
            f"{self.options.ready_timeout_s:.0f} s; see {show_path(self.data_dir / 'logs')}"
        )

    def _write_stack_file(self) -> None:
        data: dict[str, Any] = {
            "url": self.url,
            "pid": os.getpid(),
            "dataDir": str(self.data_dir),
            "children": {c.name: c.pid for c in self._all_children()},
        }
        if self.redis is not None:
            data["redisUrl"] = self.redis.url  # private, no password
        write_stack_file(self.data_dir, data)

    def _all_children(self) -> list[Child]:
        redis_child = [self.redis.child] if self.redis is not None and self.redis.child else []
        return [*redis_child, *self.services]

    # running

    def _supervise(self) -> None:
        while not self._interrupted():
            if self.redis is not None and self.redis.child is not None:
                code = self.redis.child.poll()
                if code is not None:
                    _say(
                        f"redis {describe_exit(code)}; stopping the stack "
                        f"(see {show_path(self.redis.child.log_path)})"
                    )
                    self.exit_code = 1
                    return
            now = time.monotonic()
            changed = False
            for child in self.services:
                if child.restart_at is not None:
                    if now >= child.restart_at:
                        child.start()
                        changed = True
                        _say(f"{child.name} restarted (pid {child.pid})")
                    continue
                code = child.poll()
                if code is None:
                    continue
                ran = now - child.started_at
                child.quick_crashes = child.quick_crashes + 1 if ran < _QUICK_CRASH_S else 1
                if child.quick_crashes >= _MAX_QUICK_CRASHES:
                    _say(
                        f"{child.name} {describe_exit(code)} {child.quick_crashes} times in a row "
                        f"soon after starting; stopping the stack. "
                        f"{show_path(child.log_path)} ends:\n{tail(child.log_path)}"
                    )
                    self.exit_code = 1
                    return
                delay = _RESTART_BACKOFF.delay(child.quick_crashes)
                child.restart_at = now + delay
                _say(
                    f"{child.name} {describe_exit(code)} unexpectedly; restarting in {delay:.1f} s "
                    f"(see {show_path(child.log_path)})"
                )
            if changed:
                self._write_stack_file()
            self._wake.wait(_POLL_S)
            self._wake.clear()

    def _stop_all(self, settings: Settings | None) -> None:
        alive = [c for c in self.services if c.poll() is None]
        if alive:
            _say("stopping: " + ", ".join(c.name for c in alive))
        for child in alive:
            child.signal(signal.SIGTERM)
        grace = (settings.shutdown_grace_ms / 1000 if settings else 20.0) + 10.0
        signals_before = self.signals
        # Another Ctrl-C while stopping kills the gateway and workers at once.
        wait_all(alive, grace, lambda: self.signals > signals_before)
        for child in self.services:
            child.close()
        if self.redis is not None and self.redis.child is not None:
            if self.redis.child.poll() is None:
                _say("stopping: redis")
            self.redis.stop()
        remove_stack_file(self.data_dir)
        forget_stack(self.data_dir, self.base_env)

    def run(self) -> int:
        with self._signal_handlers():
            settings: Settings | None = None
            try:
                settings = self._settings()
                _check_mcp_config(settings)
                self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                (self.data_dir / "logs").mkdir(exist_ok=True)
                with _locked(self.data_dir):
                    return self._run_locked(settings)
            except UpError as exc:
                _say(str(exc))
                return 1

    def _run_locked(self, settings: Settings) -> int:
        secret = self.base_env.get("TURNBUS_JWT_SECRET", "").strip() or load_or_create_secret(
            self.data_dir
        )
        check_listen(self.options.host, self.options.port, "pass another --port")
        try:
            rotate(self.data_dir / "logs" / "redis.log")
            self._start_redis()
            self._start_services(secret, settings)
            self._wait_ready()
            self._write_stack_file()
            remember_stack(self.data_dir, self.base_env)
            _banner(
                self.url,
                secret,
                settings,
                data_dir=self.data_dir,
                workers=self.options.workers,
                gateway_pid=self.services[0].pid,
                worker_metrics=self.worker_metrics_urls,
            )
            print(f"ready: {self.url}  (Ctrl-C stops the stack)", flush=True)
            self._supervise()
            return self.exit_code
        except _Stop:
            return 0
        except UpError as exc:
            _say(str(exc))
            return 1
        finally:
            self._stop_all(settings)
            _say("stopped")


def _check_external_redis(settings: Settings) -> str | None:
    """Reach the Redis of ``settings.redis_url``; a warning about its shards, if any."""
    try:
        client = connect_sync(settings, "admin")
    except SettingsError as exc:
        raise UpError(str(exc)) from None
    try:
        client.ping()
        return shards_warning(settings, client)
    except redis.RedisError as exc:
        raise UpError(f"cannot reach Redis at {redact_url(settings.redis_url)}: {exc}") from None
    finally:
        client.close()


def _service_children(
    options: UpOptions, data_dir: Path, env: dict[str, str], metrics_host: str, ports: list[int]
) -> list[Child]:
    """The gateway and one worker per metrics port, not started."""
    logs = data_dir / "logs"
    py = [sys.executable, "-m", "turnbus"]
    level = ["--log-level", options.log_level]
    gateway = [*py, "gateway", "--host", options.host, "--port", str(options.port), *level]
    children = [Child("gateway", gateway, env, logs / "gateway.log")]
    # Stable names: a restarted worker (or the next `up`) reads its own pending entries first.
    tag = hashlib.sha256(str(data_dir).encode()).hexdigest()[:6]
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"
    for i, port in enumerate(ports, start=1):
        worker_env = {
            **env,
            "TURNBUS_METRICS_PORT": str(port),
            "TURNBUS_METRICS_HOST": metrics_host,
        }
        children.append(
            Child(
                f"worker-{i}",
                [*py, "worker", "--name", f"{host}-{tag}-w{i}", *level],
                worker_env,
                logs / f"worker-{i}.log",
            )
        )
    return children


def shards_warning(settings: Settings, client: redis.Redis) -> str | None:
    """On a Redis Cluster, what to say when ``TURNBUS_SHARDS`` is below the number of
    masters: the work streams (and every submit's second write) then sit on fewer
    masters than the cluster has, which carry the whole queue."""
    if not settings.redis_cluster:
        return None
    slots: Any = client.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
    masters = {(str(entry[2][0]), int(entry[2][1])) for entry in slots}
    if settings.shards >= len(masters):
        return None
    return (
        f"TURNBUS_SHARDS={settings.shards} is below the cluster's {len(masters)} masters: "
        f"the work queue sits on {settings.shards} of them; set TURNBUS_SHARDS to at "
        f"least {len(masters)} (with the queue drained)"
    )


def worker_metrics_ports(base: int, workers: int, *, host: str, taken: set[int]) -> list[int]:
    """Each worker's health and metrics port: ``base``, ``base + 1``, … when the user set
    ``TURNBUS_METRICS_PORT`` (each checked free now), else a free loopback port each."""
    if base:
        ports = list(range(base, base + workers))
        what = f"set another TURNBUS_METRICS_PORT (the workers take {base}-{base + workers - 1})"
        if ports and ports[-1] > 65535:
            raise UpError(
                f"TURNBUS_METRICS_PORT={base} leaves no room for {workers} workers; {what}"
            )
        for port in ports:
            if port in taken:
                raise UpError(f"port {port} is the gateway's; {what}")
            check_listen(host, port, what)
        return ports
    ports = []
    while len(ports) < workers:
        port = free_port()
        if port not in ports and port not in taken:
            ports.append(port)
    return ports


def _reachable(host: str) -> str:
    """The address to connect to for a server listening on ``host``."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def _http_url(host: str, port: int) -> str:
    host = _reachable(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _say(line: str) -> None:
    print(f"turnbus up: {line}", flush=True)


@contextlib.contextmanager
def _locked(data_dir: Path) -> Iterator[None]:
    with (data_dir / LOCK_FILE).open("a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            running = read_stack_file(data_dir) or {}
            where = f" (pid {running['pid']}, {running.get('url')})" if "pid" in running else ""
            raise UpError(
                f"another `turnbus up` is running on {data_dir}{where}; stop it or pass --data-dir"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _http_status(host: str, port: int, path: str) -> int | None:
    conn = http.client.HTTPConnection(host, port, timeout=1.0)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def _check_mcp_config(settings: Settings) -> None:
    """A bad MCP config stops ``up`` before anything starts, with the workers' message
    (the file and the entry), rather than as workers that exit while starting."""
    if not settings.mcp_config:
        return
    from turnbus.worker.mcp_config import McpConfigError, load_mcp_config

    try:
        load_mcp_config(settings.mcp_config)
    except McpConfigError as exc:
        raise UpError(str(exc)) from None


def run_up(options: UpOptions, env: Mapping[str, str] | None = None) -> int:
    """Run the stack until SIGINT/SIGTERM; 0 on a requested stop, 1 on a failure."""
    return Stack(options, os.environ if env is None else env).run()


def _banner(
    url: str,
    secret: str,
    settings: Settings,
    *,
    data_dir: Path,
    workers: int,
    gateway_pid: int | None,
    worker_metrics: list[str],
) -> None:
    """What the user reads once the stack is ready: where it is, a dev token, a walk-through."""
    from turnbus.gateway.auth import mint_token

    token = mint_token(secret, DEV_USER, DEV_TOKEN_TTL_S)
    pick = "python3 -c 'import json,sys; d=sys.stdin.read(); d or sys.exit(1); print(json.loads(d)[sys.argv[1]])' \"$1\""
    dir_arg = shlex.quote(show_path(data_dir))
    turnbus = turnbus_command()
    model = settings.model
    provider = settings.provider(model)
    if model == "scripted":
        model += " (offline; set ANTHROPIC_API_KEY or OPENAI_API_KEY to use a model API)"
    elif provider is not None and provider.model:
        model += f" ({provider.model})"
    elif model == "anthropic":
        model += f" ({settings.anthropic_model})"
    others = sorted(n for n in settings.provider_names if n != settings.model)
    if others:
        model += f"; per session also {', '.join(others)} (selectedModel provider:model)"
    _say(f"gateway  {url} (pid {gateway_pid})")
    _say(f"workers  {workers} x concurrency {settings.worker_concurrency}")
    metrics = f"gateway {url}/metrics"
    if worker_metrics:
        metrics += ", workers " + ", ".join(worker_metrics)
    _say(f"metrics  {metrics}")
    _say(f"model    {model}")
    _say(f"logs     {show_path(data_dir / 'logs')}/")
    # The same walk-through as the README's: ids captured, a refused request stops it.
    lines = [
        "",
        f"  URL      {url}",
        f"  console  {url}/console#token={token}",
        f"  token    {token}",
        f'           (user "{DEV_USER}", valid 24 h; more: {turnbus} token --user NAME --data-dir {dir_arg})',
        "",
        "  Try it:",
        f"    export TOKEN={token}",
        f"    API={url}",
        '    AUTH="Authorization: Bearer $TOKEN"',
        f"    pick() {{ {pick}; }}",
        '    SID=$(curl -fsS -X POST -H "$AUTH" "$API/v1/sessions" | pick sessionId)',
        "    TID=$(curl -fsS -X POST -H \"$AUTH\" -H 'content-type: application/json' \\",
        '          -d \'{"message": "remember the build is green"}\' "$API/v1/sessions/${SID:?}/turns" | pick turnId)',
        '    curl -fsSN -H "$AUTH" "$API/v1/sessions/${SID:?}/turns/${TID:?}/events"',
        '    curl -fsS -H "$AUTH" "$API/v1/sessions/${SID:?}/notes" | pick notes',
        "",
        f"  Or chat in a terminal:  {turnbus} chat --data-dir {dir_arg}",
        "  Or from Python, in any folder:  import turnbus; token = turnbus.dev_token()",
        "",
    ]
    if settings.model == "scripted":
        lines[-1:-1] = [_delay_hint(settings.scripted_delay_ms)]
    print("\n".join(lines), flush=True)


def _delay_hint(delay_ms: int) -> str:
    """One line on slowing the scripted model, so a turn lasts long enough to cancel it
    or reload the console mid-turn."""
    if delay_ms:
        return (
            f"  The scripted model waits {delay_ms} ms per chunk (TURNBUS_SCRIPTED_DELAY_MS): "
            "time to cancel a turn or reload mid-turn."
        )
    return (
        "  For a turn long enough to cancel or reload mid-turn, restart with "
        "TURNBUS_SCRIPTED_DELAY_MS=500 (e.g. TURNBUS_SCRIPTED_DELAY_MS=500 make run)."
    )

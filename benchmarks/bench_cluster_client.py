"""Cluster clients compared on a turn's Redis traffic, on a local 3-master cluster.

Each "turn" is what a turn sends most: a Lua script on its session's slot (a hash
write and a log append), a pipeline of three event appends to the turn's stream, and
the envelope read back. ``--concurrency`` sessions run at once until ``--turns`` are
done. Candidates, turn about in each round (so machine noise falls on each alike):

- ``mux``: turnbus's own client (``shared.connect``: ``ClusterMux``, one multiplexed
  link per node);
- ``coredis``: coredis ``RedisCluster`` (when installed: ``pip install coredis``);
- ``redis-py``: ``redis.asyncio.RedisCluster``, the library turnbus is built on.

Prints turns/s and the client process's CPU per turn (µs) for each, and saves them
to benchmarks/results/bench_cluster_client.json (with ``python_loop_2m_s``). Skipped
when ``redis-server`` >= 7 or ``redis-cli`` is not on the PATH.

    .venv/bin/python -m benchmarks.bench_cluster_client [--turns 20000] [--rounds 3]
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from benchmarks.benchlib import arguments, python_speed_s, write_results
from harness.local_cluster import cluster_binaries, local_cluster
from turnbus.shared.connect import connect
from turnbus.shared.settings import Settings

_SCRIPT = """
redis.call('HINCRBY', KEYS[1], 'turns', 1)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', 1000, '*', 'data', ARGV[1])
return 1
"""
_EVENT = b'{"type":"text.delta","turnId":"t","round":1,"text":"hello there"}'

Turn = Callable[[int, int], Awaitable[None]]


async def _run(turn: Turn, sessions: int, turns: int) -> tuple[float, float]:
    """Wall seconds and process CPU seconds for ``turns`` turns over ``sessions``."""
    per = turns // sessions

    async def session(s: int) -> None:
        for n in range(per):
            await turn(s, n)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(session(s) for s in range(sessions)))
    return time.perf_counter() - wall, time.process_time() - cpu


def _keys(s: int, n: int) -> tuple[str, str, str]:
    tag = f"bench:{{u:s{s}}}"
    return f"{tag}:env", f"{tag}:log", f"{tag}:turn:{n % 4}:events"


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


async def mux_client(url: str) -> tuple[Turn, Callable[[], Awaitable[None]]]:
    client = connect(Settings(redis_url=url, redis_cluster=True), "status")
    return _redis_py_turn(client, await client.script_load(_SCRIPT)), client.aclose


async def redispy_client(url: str) -> tuple[Turn, Callable[[], Awaitable[None]]]:
    client = aioredis.RedisCluster.from_url(url, decode_responses=True)
    return _redis_py_turn(client, await client.script_load(_SCRIPT)), client.aclose  # type: ignore[arg-type]


async def coredis_client(url: str) -> tuple[Turn, Callable[[], Awaitable[None]]]:
    import coredis
    from coredis.tokens import PureToken

    host, port = url.removeprefix("redis://").split("/")[0].split(":")
    client: Any = coredis.RedisCluster(host, int(port), decode_responses=True)
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

    async def close() -> None:
        await client.__aexit__(None, None, None)

    return turn, close


CANDIDATES: dict[str, Callable[[str], Awaitable[tuple[Turn, Callable[[], Awaitable[None]]]]]] = {
    "mux": mux_client,
    "coredis": coredis_client,
    "redis-py": redispy_client,
}


async def measure(
    url: str, names: list[str], turns: int, sessions: int, rounds: int
) -> dict[str, Any]:
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            turn, close = await CANDIDATES[name](url)
            try:
                await _run(turn, sessions, sessions * 2)  # connections made, scripts loaded
                samples[name].append(await _run(turn, sessions, turns))
            finally:
                await close()
    figures: dict[str, Any] = {}
    for name, runs in samples.items():
        rates = [turns / wall for wall, _ in runs]
        cpu_us = [cpu / turns * 1e6 for _, cpu in runs]
        figures[name] = {
            "turns_per_s": round(statistics.median(rates)),
            "turns_per_s_runs": [round(x) for x in rates],
            "client_cpu_us_per_turn": round(statistics.median(cpu_us), 1),
        }
    return figures


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    names = ["mux", "redis-py"]
    try:
        import coredis  # noqa: F401

        names.insert(1, "coredis")
    except ImportError:
        print("coredis is not installed: measuring mux and redis-py only")
    if cluster_binaries() is None:
        print("skipped: a local Redis Cluster needs redis-server >= 7 and redis-cli on the PATH")
        return
    speed = python_speed_s()
    with local_cluster() as cluster:
        figures = asyncio.run(
            measure(cluster.url, names, args.turns, args.concurrency, args.rounds)
        )
    result = {
        "turns": args.turns,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "clients": figures,
    }
    for name, row in figures.items():
        print(
            f"{name:<9} {row['turns_per_s']:>7} turns/s  "
            f"{row['client_cpu_us_per_turn']:>7} µs client CPU per turn  runs {row['turns_per_s_runs']}"
        )
    print(f"python_loop_2m_s {speed}")
    write_results("bench_cluster_client", result, args.results_dir)


if __name__ == "__main__":
    main()

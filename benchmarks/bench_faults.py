"""Redis faults under load: a connection reset with replies in flight, and a cluster master SIGKILLed.

The load is bench_load's realistic turn ("remember <about 25 words>": two model rounds,
the scripted model paced like an LLM, TTFT 500 ms and 50 tokens/s) sent by N sessions
(--sessions, default 600), each sending its next turn as soon as its last one ended (one
POST with an Idempotency-Key, retried with the same key on 429, 503 or a lost answer,
following Retry-After; then GET its events to the end). A fault comes once the load
runs (--warm-s); the sessions keep sending for --after-s more, then every accepted turn
is waited for. What each turn became is read from Redis afterwards: its events stream
and its record.

Scenarios (--scenario, default both):
  reset     its own Redis; the gateway reaches it directly, three `turnbus worker`
            processes (as a deployment runs them: nothing restarts one that dies)
            through a fault proxy (harness/fault_proxy.py, a process of its own). The
            proxy holds every reply 300 ms for 2 s, then resets every connection
            (the replies it held are lost). Figures: the time from the reset to the end
            of the last turn that was in flight at it (target 10 s), the workers still
            alive at the end, the workers' log lines about retries and give-ups.
  failover  a local Redis Cluster (harness.local_cluster: 3 masters, a replica each)
            with TURNBUS_SHARDS=3, under `turnbus up` with 3 workers, at
            TURNBUS_WAIT_REPLICAS 0 and 1 (--wait-replicas), each on a fresh cluster:
            the master holding work stream 0 is SIGKILLed; once its replica has taken
            over, the killed node is started again (it rejoins as a replica, as a
            supervisor would bring it back). Figures: 202 → turn.started (the first
            attempt's stamp) of every accepted turn, p50/p99/max (target max 10 s), the
            same for the turns answered after the kill, the takeover time, and the
            workers' log lines about the cancel subscription (target: a handful).
Both count the turns lost (accepted, with no terminal event once every turn was waited
for) and doubled (more than one terminal event, or one event written twice), and the
turns that needed a second attempt.

--quick: 20 sessions, the model ten times as fast, shorter phases (a smoke run; its
figures go to bench_faults_quick.json, not kept). A run of one scenario writes
bench_faults_<scenario>.json, so it never replaces the full record with a part of it.
Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_faults.py [--quick] [--scenario S]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from benchmarks import bench_load
from benchmarks.bench_load import REALISTIC, Tally, create_session, follow, run_client
from benchmarks.benchlib import (
    CLUSTER_SHARDS,
    Stack,
    arguments,
    starting,
    summary_ms,
    turnbus_command,
    write_results,
)
from harness.fault_proxy import FaultProxyProcess
from harness.local_cluster import LocalCluster, cluster_binaries, local_cluster
from turnbus.redis_local import PrivateRedis
from turnbus.shared.connect import connect
from turnbus.shared.events import TurnStarted, decode_event, is_terminal
from turnbus.shared.keys import Keys
from turnbus.shared.muxclient import mux_client
from turnbus.shared.runtime import tune_gc
from turnbus.shared.settings import Settings

USER = "bench"  # the subject of the bench token (benchlib)
WORKERS = 3
HOLD_MS = 300
HOLD_S = 2.0
TARGET_S = 10.0
# How long a submit is retried (503 while a shard has no master, or no replica to wait
# for) and a turn followed, before the client gives up on it.
SUBMIT_WITHIN_S = 120.0
FOLLOW_WITHIN_S = 120.0
# After the load stops: every accepted turn is waited for this long at most.
DRAIN_S = 120.0


def _wall_ms() -> int:
    """Now, in the ms of the clock the worker stamps events with (this host's)."""
    return time.time_ns() // 1_000_000


@dataclasses.dataclass
class Accepted:
    session: str
    turn: str
    answered_ms: int  # when its 202 came
    tries: int  # POSTs it took (the ones before were answered 429 or 503, or not at all)


@dataclasses.dataclass
class Load:
    """Sessions sending turns back to back until :attr:`stop`."""

    tally: Tally = dataclasses.field(default_factory=Tally)
    turns: list[Accepted] = dataclasses.field(default_factory=list)
    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    gave_up: int = 0  # submits never answered 202 within SUBMIT_WITHIN_S


async def submit_turn(
    http: aiohttp.ClientSession, sid: str, message: str, load: Load
) -> Accepted | None:
    """One turn, retried with its Idempotency-Key while the answer is 429 or 503 or lost,
    as a client following Retry-After does."""
    key = uuid.uuid4().hex
    deadline = time.monotonic() + SUBMIT_WITHIN_S
    tries = 0
    while time.monotonic() < deadline:
        retry = 0.5
        tries += 1
        try:
            async with http.post(
                f"/v1/sessions/{sid}/turns",
                json={"message": message, "multitask": "enqueue"},
                headers={"Idempotency-Key": key},
            ) as resp:
                load.tally.http(resp.status)
                if resp.status == 202:
                    body = await resp.json()
                    return Accepted(sid, str(body["turnId"]), _wall_ms(), tries)
                if resp.status not in (429, 503):
                    load.tally.error(f"POST turns {resp.status}")
                    return None
                retry = float(resp.headers.get("Retry-After", "1") or 1)
        except (TimeoutError, aiohttp.ClientError) as exc:
            load.tally.error(f"POST turns {type(exc).__name__}")
        await asyncio.sleep(retry)
    load.gave_up += 1
    return None


async def session_loop(http: aiohttp.ClientSession, sid: str, i: int, load: Load) -> None:
    n = 0
    while not load.stop.is_set():
        turn = await submit_turn(
            http, sid, f"remember {bench_load.ITEM.format(i=f'{i}.{n}')}", load
        )
        n += 1
        if turn is None:
            continue
        load.turns.append(turn)
        url = f"/v1/sessions/{sid}/turns/{turn.turn}/events"
        try:
            kind, _ = await asyncio.wait_for(follow(http, url, load.tally), FOLLOW_WITHIN_S)
        except (TimeoutError, aiohttp.ClientError) as exc:
            load.tally.error(f"GET events {type(exc).__name__}")
            kind = "stream_error"
        load.tally.outcome(kind)


@contextlib.asynccontextmanager
async def loaded(stack: Stack, sessions: int) -> AsyncIterator[Load]:
    """``sessions`` sessions sending turns back to back while the block runs; on exit
    they stop sending and their last turns are followed to the end."""
    load = Load()
    async with stack.http() as http:
        sids = await asyncio.gather(*(create_session(http, load.tally) for _ in range(sessions)))
        users = [
            asyncio.create_task(session_loop(http, sid, i, load))
            for i, sid in enumerate(sids)
            if sid is not None
        ]
        try:
            yield load
        finally:
            load.stop.set()
            await asyncio.gather(*users)


@dataclasses.dataclass
class TurnFacts:
    """What one accepted turn became, read from Redis."""

    status: str
    ended_ms: int | None
    started_ms: int | None  # its first turn.started's stamp
    attempts: int
    terminals: int
    repeated_events: int  # entries whose data another entry of the stream holds too


async def read_facts(redis: aioredis.Redis, keys: Keys, turn: Accepted) -> TurnFacts:
    record = await redis.hmget(keys.turn(USER, turn.session, turn.turn), "status", "endedAt")
    entries = await redis.xrange(keys.turn_events(USER, turn.session, turn.turn))
    data = [fields["data"] for _id, fields in entries]
    events = [decode_event(d) for d in data]
    starts = [e for e in events if isinstance(e, TurnStarted)]
    return TurnFacts(
        status=str(record[0] or "missing"),
        ended_ms=int(record[1]) if record[1] else None,
        started_ms=starts[0].at if starts else None,
        attempts=len(starts),
        terminals=sum(1 for e in events if is_terminal(e)),
        repeated_events=len(data) - len(set(data)),
    )


async def drained_facts(redis_url: str, cluster: bool, turns: list[Accepted]) -> list[TurnFacts]:
    """Every accepted turn's facts, once each has ended (or DRAIN_S has passed)."""
    redis = connect(Settings(redis_url=redis_url, redis_cluster=cluster), "status")
    keys = Keys(Settings().prefix)
    gate = asyncio.Semaphore(64)

    async def one(turn: Accepted) -> TurnFacts:
        async with gate:
            return await read_facts(redis, keys, turn)

    try:
        deadline = time.monotonic() + DRAIN_S
        while True:
            facts = list(await asyncio.gather(*(one(t) for t in turns)))
            if all(f.terminals for f in facts) or time.monotonic() > deadline:
                return facts
            await asyncio.sleep(1.0)
    finally:
        await redis.aclose()


def fate_figures(facts: list[TurnFacts]) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    for f in facts:
        statuses[f.status] = statuses.get(f.status, 0) + 1
    return {
        "turns_accepted": len(facts),
        "statuses": dict(sorted(statuses.items())),
        "lost": sum(1 for f in facts if not f.terminals),
        "doubled": sum(1 for f in facts if f.terminals > 1 or f.repeated_events),
        "second_attempts": sum(1 for f in facts if f.attempts > 1),
    }


def log_lines(logs: list[Path], needles: Mapping[str, str]) -> dict[str, int]:
    """Lines of ``logs`` that contain each needle, by name."""
    counts = dict.fromkeys(needles, 0)
    for path in logs:
        with path.open(errors="replace") as f:
            for line in f:
                for name, needle in needles.items():
                    counts[name] += needle in line
    return counts


# --- reset -----------------------------------------------------------------------------


@contextlib.contextmanager
def worker_processes(
    env: Mapping[str, str], logs: Path, n: int
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` `turnbus worker` processes (log level info), each logging to
    ``logs/worker-<i>.log``; stopped at exit."""
    logs.mkdir(parents=True, exist_ok=True)
    child_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TURNBUS_") and k not in ("REDIS_URL", "ANTHROPIC_API_KEY")
    }
    child_env.update(TURNBUS_MODEL="scripted", TURNBUS_SHUTDOWN_GRACE_MS="3000", **env)
    procs = []
    try:
        for i in range(1, n + 1):
            with (logs / f"worker-{i}.log").open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        [*turnbus_command(), "worker", "--log-level", "info"],
                        env=child_env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def reset_under_load(
    stack: Stack,
    redis_url: str,
    proxy: FaultProxyProcess,
    workers: list[subprocess.Popen[bytes]],
    sessions: int,
    warm_s: float,
    after_s: float,
) -> dict[str, Any]:
    async with loaded(stack, sessions) as load:
        await asyncio.sleep(warm_s)
        await asyncio.to_thread(proxy.delay, HOLD_MS / 1000, replies_only=True)
        await asyncio.sleep(HOLD_S)
        await asyncio.to_thread(proxy.reset)
        reset_ms = _wall_ms()
        await asyncio.to_thread(proxy.delay, 0)
        await asyncio.sleep(after_s)
    facts = await drained_facts(redis_url, False, load.turns)
    in_flight = [
        f
        for t, f in zip(load.turns, facts, strict=True)
        if t.answered_ms <= reset_ms and (f.ended_ms is None or f.ended_ms > reset_ms)
    ]
    ends_s = [(f.ended_ms - reset_ms) / 1000 for f in in_flight if f.ended_ms is not None]
    return {
        "sessions": sessions,
        "fault": {
            "replies_held_ms": HOLD_MS,
            "held_for_s": HOLD_S,
            "then": "every worker connection reset",
        },
        **fate_figures(facts),
        "in_flight_at_reset": len(in_flight),
        "in_flight_not_ended": sum(1 for f in in_flight if f.ended_ms is None),
        "reset_to_in_flight_end": summary_ms(ends_s),
        "reset_to_last_in_flight_end_s": round(max(ends_s), 2) if ends_s else None,
        "target_s": TARGET_S,
        "workers_alive_at_end": sum(1 for w in workers if w.poll() is None),
        "submits_given_up": load.gave_up,
        **load.tally.figures(),
    }


def scenario_reset(sessions: int, warm_s: float, after_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="turnbus-bench-faults-") as tmp:
        redis = PrivateRedis(Path(tmp, "redis"), Path(tmp, "redis.log"))
        redis.start()
        try:
            with (
                FaultProxyProcess("127.0.0.1", redis.port) as proxy,
                starting({**REALISTIC, "TURNBUS_REDIS_URL": redis.url}, workers=0) as booting,
            ):
                env = {**REALISTIC, "TURNBUS_REDIS_URL": proxy.url}
                logs = Path(tmp, "logs")
                with worker_processes(env, logs, WORKERS) as workers:
                    stack = booting.ready()
                    print(f"reset: {sessions} sessions, {WORKERS} workers ...", flush=True)
                    run = run_client(
                        reset_under_load(
                            stack, redis.url, proxy, workers, sessions, warm_s, after_s
                        )
                    )
                run["worker_log_lines"] = log_lines(
                    sorted(logs.glob("worker-*.log")),
                    {
                        "retrying": "retrying",
                        "giving_up": "giving up",
                        "left_pending": "left pending",
                        "abandoned": "abandoned",
                        "tracebacks": "Traceback",
                    },
                )
                return run
        finally:
            redis.stop()


# --- failover --------------------------------------------------------------------------


def _wait_takeover(cluster: LocalCluster, masters: int, within_s: float = 60.0) -> None:
    """Until a replica has taken over: as many masters as before (the killed node is not
    asked)."""
    deadline = time.monotonic() + within_s
    while len(cluster.masters()) < masters:
        if time.monotonic() > deadline:
            raise SystemExit(f"no replica took over within {within_s:.0f} s")
        time.sleep(0.05)


async def failover_under_load(
    stack: Stack, cluster: LocalCluster, sessions: int, warm_s: float, after_s: float
) -> dict[str, Any]:
    probe = connect(Settings(redis_url=cluster.url, redis_cluster=True), "status")
    try:
        nodes = mux_client(probe)
        await nodes.masters()
        victim = nodes.address_for_key(Keys(Settings().prefix).work(0))
        assert victim is not None
    finally:
        await probe.aclose()
    async with loaded(stack, sessions) as load:
        await asyncio.sleep(warm_s)
        masters = len(await asyncio.to_thread(cluster.masters))
        await asyncio.to_thread(cluster.kill, victim[1])
        kill_ms = _wall_ms()
        await asyncio.to_thread(_wait_takeover, cluster, masters)
        takeover_ms = _wall_ms()
        await asyncio.to_thread(cluster.start_node, victim[1])
        await asyncio.sleep(after_s)
    facts = await drained_facts(cluster.url, True, load.turns)
    waits = [
        ((f.started_ms - t.answered_ms) / 1000, t.answered_ms > kill_ms)
        for t, f in zip(load.turns, facts, strict=True)
        if f.started_ms is not None
    ]
    # The turns that waited longest for their start: when they were answered (from the
    # kill) and after how many POSTs.
    slowest = sorted(
        (
            {
                "turn": t.turn,
                "started_after_202_ms": f.started_ms - t.answered_ms,
                "answered_after_kill_ms": t.answered_ms - kill_ms,
                "posts": t.tries,
            }
            for t, f in zip(load.turns, facts, strict=True)
            if f.started_ms is not None
        ),
        key=lambda row: -int(row["started_after_202_ms"]),
    )[:5]
    return {
        "sessions": sessions,
        "kill_to_takeover_ms": takeover_ms - kill_ms,
        **fate_figures(facts),
        "never_started": sum(1 for f in facts if f.started_ms is None),
        "accepted_to_started": summary_ms([w for w, _ in waits]),
        "accepted_after_kill_to_started": summary_ms([w for w, after in waits if after]),
        "accepted_to_started_over_target": sum(1 for w, _ in waits if w > TARGET_S),
        "slowest_to_start": slowest,
        "target_max_s": TARGET_S,
        "submits_given_up": load.gave_up,
        **load.tally.figures(),
    }


def scenario_failover(
    wait_replicas: int, sessions: int, warm_s: float, after_s: float
) -> dict[str, Any]:
    with local_cluster() as cluster:
        env = {
            **REALISTIC,
            "TURNBUS_REDIS_URL": cluster.url,
            "TURNBUS_REDIS_CLUSTER": "1",
            "TURNBUS_SHARDS": str(CLUSTER_SHARDS),
            "TURNBUS_WAIT_REPLICAS": str(wait_replicas),
        }
        with starting(env, WORKERS, log_level="info") as booting:
            stack = booting.ready()
            print(f"failover at TURNBUS_WAIT_REPLICAS={wait_replicas}: {sessions} sessions ...")
            run = run_client(failover_under_load(stack, cluster, sessions, warm_s, after_s))
            logs = sorted((stack.data_dir / "logs").glob("worker*.log"))
            run["worker_log_lines"] = log_lines(
                logs,
                {
                    "cancel_subscription": "cancel subscription",
                    "missed_cancels": "missed cancels",
                    "tracebacks": "Traceback",
                },
            )
            run["cancel_subscription_target"] = "a handful"
            return run


# --- main ------------------------------------------------------------------------------


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--scenario", choices=["all", "reset", "failover"], default="all")
    parser.add_argument("--quick", action="store_true", help="a small, fast smoke run")
    parser.add_argument("--sessions", type=int, default=None, help="default 600 (--quick: 20)")
    parser.add_argument(
        "--warm-s", type=float, default=None, help="load before the fault (default 5; --quick 1)"
    )
    parser.add_argument(
        "--after-s",
        type=float,
        default=None,
        help="load after the fault (the takeover, for failover) (default 10; --quick 2)",
    )
    parser.add_argument(
        "--wait-replicas",
        default="0,1",
        help="failover: the TURNBUS_WAIT_REPLICAS values, comma-separated (default 0,1)",
    )
    args = parser.parse_args()
    tune_gc()
    quick = args.quick
    if quick:
        # The same turns, rounds and events, ten times as fast.
        bench_load.TTFT_MS, bench_load.TOKENS_PER_S = 50, 500
        REALISTIC["TURNBUS_SCRIPTED_TTFT_MS"] = "50"
        REALISTIC["TURNBUS_SCRIPTED_TOKENS_PER_S"] = "500"
    sessions = args.sessions or (20 if quick else 600)
    warm_s = args.warm_s if args.warm_s is not None else (1.0 if quick else 5.0)
    after_s = args.after_s if args.after_s is not None else (2.0 if quick else 10.0)
    wanted = {"reset", "failover"} if args.scenario == "all" else {args.scenario}
    figures: dict[str, Any] = {
        "profile": {
            "ttft_ms": bench_load.TTFT_MS,
            "tokens_per_s": bench_load.TOKENS_PER_S,
            "rounds": 2,
        },
        "workers": WORKERS,
        "warm_s": warm_s,
        "after_s": after_s,
        "scenarios": {},
    }
    results = figures["scenarios"]
    if "reset" in wanted:
        results["reset"] = scenario_reset(sessions, warm_s, after_s)
        print(json.dumps(results["reset"], indent=1), flush=True)
    if "failover" in wanted:
        if cluster_binaries() is None:
            print("failover skipped: it needs redis-server >= 7 and redis-cli on the PATH")
        else:
            for n in (int(v) for v in args.wait_replicas.split(",")):
                run = scenario_failover(n, sessions, warm_s, after_s)
                results[f"failover_wait_replicas_{n}"] = run
                print(json.dumps(run, indent=1), flush=True)
    name = "bench_faults" if args.scenario == "all" else f"bench_faults_{args.scenario}"
    name = f"{name}_quick" if quick else name
    print(f"wrote {write_results(name, figures, args.results_dir)}")


if __name__ == "__main__":
    main()

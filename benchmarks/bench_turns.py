"""End-to-end turn figures through the real stack (`turnbus up`: private Redis,
gateway, two workers, the scripted model), over HTTP and SSE with aiohttp.

Prints:
  1. throughput and submit→turn.completed latency for many turns over many sessions;
  2. cancel latency: POST …/cancel while the model streams → turn.cancelled seen
     by an SSE follower (the design target is 250 ms);
  3. SSE fan-out: many followers of one turn, time until all of them saw its end.

Run: `make bench` or `PYTHONPATH=. .venv/bin/python benchmarks/bench_turns.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
from gateway.auth import mint_token
from turnbus.procs import free_port
from turnbus.sse import SseParser
from turnbus.stackfile import read_secret


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(label: str, values_ms: list[float]) -> None:
    print(
        f"{label:<34} n={len(values_ms):<5} p50={pct(values_ms, 0.5):7.1f} ms  "
        f"p95={pct(values_ms, 0.95):7.1f} ms  max={max(values_ms):7.1f} ms"
    )


async def follow(
    http: aiohttp.ClientSession,
    url: str,
    until: set[str],
    on: dict[str, asyncio.Event] | None = None,
) -> str:
    """Read an SSE stream until an event whose type is in ``until``; returns that type."""
    async with http.get(url) as resp:
        resp.raise_for_status()
        parser = SseParser()
        async for raw in resp.content:
            message = parser.feed_line(raw.decode())
            if message is None:
                continue
            kind = message.event
            if on and kind in on:
                on[kind].set()
            if kind in until:
                return kind
    raise RuntimeError(f"stream {url} ended without {until}")


TERMINAL = {"turn.completed", "turn.failed", "turn.cancelled", "turn.timed_out"}


class Client:
    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http = http

    async def new_session(self) -> str:
        async with self.http.post("/v1/sessions", json={}) as resp:
            return str((await resp.json())["sessionId"])

    async def submit(self, sid: str, message: str) -> dict[str, Any]:
        async with self.http.post(
            f"/v1/sessions/{sid}/turns", json={"message": message, "multitask": "enqueue"}
        ) as resp:
            resp.raise_for_status()
            return dict(await resp.json())


def session_for(base: str, token: str) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {token}"}
    return aiohttp.ClientSession(base, headers=headers, connector=aiohttp.TCPConnector(limit=0))


async def run_throughput(base: str, token: str, turns: int, sessions: int, followers: int) -> None:
    async with session_for(base, token) as http:
        c = Client(http)
        new_session, submit = c.new_session, c.submit

        # 1. Throughput and latency.
        sids = await asyncio.gather(*(new_session() for _ in range(sessions)))
        latencies: list[float] = []

        async def one_turn(i: int) -> None:
            started = time.perf_counter()
            accepted = await submit(sids[i % sessions], f"remember finding {i}")
            await follow(http, accepted["eventsUrl"], TERMINAL)
            latencies.append((time.perf_counter() - started) * 1000)

        started = time.perf_counter()
        await asyncio.gather(*(one_turn(i) for i in range(turns)))
        elapsed = time.perf_counter() - started
        print(
            f"{turns} turns over {sessions} sessions: {turns / elapsed:,.0f} turns/s ({elapsed:.2f} s)"
        )
        report("submit → turn.completed", latencies)

        # 3. Fan-out: many followers of one turn.
        sid = await new_session()
        accepted = await submit(sid, "what did we conclude?")
        done_at: list[float] = []

        async def watcher() -> None:
            await follow(http, accepted["eventsUrl"], TERMINAL)
            done_at.append(time.perf_counter())

        started = time.perf_counter()
        await asyncio.gather(*(watcher() for _ in range(followers)))
        print(
            f"{followers} SSE followers of one turn: all saw its end "
            f"{(max(done_at) - started) * 1000:.0f} ms after they connected"
        )


async def run_cancel(base: str, token: str) -> None:
    async with session_for(base, token) as http:
        c = Client(http)
        new_session, submit = c.new_session, c.submit
        cancels: list[float] = []
        for _ in range(20):
            sid = await new_session()
            accepted = await submit(sid, "tell me a long story about the build")
            seen = {"text.delta": asyncio.Event()}
            follower = asyncio.create_task(
                follow(http, accepted["eventsUrl"], {"turn.cancelled", "turn.completed"}, seen)
            )
            await asyncio.wait_for(seen["text.delta"].wait(), 10)
            asked = time.perf_counter()
            async with http.post(f"/v1/sessions/{sid}/turns/{accepted['turnId']}/cancel") as resp:
                resp.raise_for_status()
            outcome = await asyncio.wait_for(follower, 10)
            if outcome == "turn.cancelled":
                cancels.append((time.perf_counter() - asked) * 1000)
        report("cancel → turn.cancelled (SSE)", cancels)


@contextlib.contextmanager
def stack(workers: int, delay_ms: int) -> Iterator[tuple[str, str]]:
    """`turnbus up` in a temp data dir; yields (base URL, token)."""
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        env = {
            k: v
            for k, v in os.environ.items()
            if k
            not in ("ANTHROPIC_API_KEY", "TURNBUS_REDIS_URL", "REDIS_URL", "TURNBUS_JWT_SECRET")
        }
        env.update(TURNBUS_SCRIPTED_DELAY_MS=str(delay_ms), TURNBUS_MODEL="scripted")
        argv = [sys.executable, "-m", "turnbus", "up", "--port", str(free_port())]
        argv += ["--data-dir", tmp, "--workers", str(workers), "--log-level", "warning"]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not (data_dir / "stack.json").exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the stack did not come up; see its logs")
                time.sleep(0.1)
            base = json.loads((data_dir / "stack.json").read_text())["url"]
            secret = read_secret(data_dir)
            assert secret is not None
            yield base, mint_token(secret, "bench")
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=400)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--followers", type=int, default=500)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(f"stack: {args.workers} workers, scripted model without delay")
    with stack(args.workers, 0) as (base, token):
        asyncio.run(run_throughput(base, token, args.turns, args.sessions, args.followers))
    print(f"stack: {args.workers} workers, scripted model with 100 ms per chunk")
    with stack(args.workers, 100) as (base, token):
        asyncio.run(run_cancel(base, token))


if __name__ == "__main__":
    main()

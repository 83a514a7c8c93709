"""End-to-end turn figures through the real stack (`turnbus up`: private Redis,
gateway, two workers, the scripted model), over HTTP and SSE with aiohttp.

Prints, and writes to benchmarks/results/bench_turns.json:
  1. throughput and submit→turn.completed latency for many turns over many sessions,
     all submitted at once (a session's turns queue behind each other);
  2. cancel latency: POST …/cancel while the model streams → turn.cancelled seen
     by an SSE follower (the design target is 250 ms);
  3. SSE fan-out: many followers of one turn, time until all of them saw its end.

Run: `make bench` or `PYTHONPATH=. .venv/bin/python benchmarks/bench_turns.py`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from benchmarks.benchlib import TERMINAL, arguments, summary_ms, up, write_results
from turnbus.shared.runtime import tune_gc
from turnbus.sse import SseParser


def report(label: str, values_s: list[float]) -> dict[str, Any]:
    figures = summary_ms(values_s)
    print(
        f"{label:<34} n={figures['n']:<5} p50={figures['p50_ms']} ms  "
        f"p99={figures['p99_ms']} ms  max={figures['max_ms']} ms"
    )
    return figures


async def follow(
    http: aiohttp.ClientSession,
    url: str,
    until: frozenset[str] | set[str],
    on: dict[str, asyncio.Event] | None = None,
) -> str:
    """Read an SSE stream until an event whose type is in ``until``; returns that type."""
    async with http.get(url) as resp:
        resp.raise_for_status()
        parser = SseParser()
        async for raw in resp.content.iter_any():
            for message in parser.feed(raw):
                kind = message.event
                if on and kind in on:
                    on[kind].set()
                if kind in until:
                    return kind
    raise RuntimeError(f"stream {url} ended without {until}")


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


async def run_throughput(
    http: aiohttp.ClientSession, turns: int, sessions: int, followers: int
) -> dict[str, Any]:
    c = Client(http)
    new_session, submit = c.new_session, c.submit

    # 1. Throughput and latency.
    sids = await asyncio.gather(*(new_session() for _ in range(sessions)))
    latencies: list[float] = []

    async def one_turn(i: int) -> None:
        started = time.perf_counter()
        accepted = await submit(sids[i % sessions], f"remember finding {i}")
        await follow(http, accepted["eventsUrl"], TERMINAL)
        latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(one_turn(i) for i in range(turns)))
    elapsed = time.perf_counter() - started
    print(
        f"{turns} turns over {sessions} sessions: {turns / elapsed:,.0f} turns/s ({elapsed:.2f} s)"
    )
    figures: dict[str, Any] = {
        "turns": turns,
        "sessions": sessions,
        "turns_per_s": round(turns / elapsed, 1),
        "submit_to_completed": report("submit → turn.completed", latencies),
    }

    # 3. Fan-out: many followers of one turn.
    sid = await new_session()
    accepted = await submit(sid, "what did we conclude?")
    done_at: list[float] = []

    async def watcher() -> None:
        await follow(http, accepted["eventsUrl"], TERMINAL)
        done_at.append(time.perf_counter())

    started = time.perf_counter()
    await asyncio.gather(*(watcher() for _ in range(followers)))
    all_saw_ms = round((max(done_at) - started) * 1000)
    print(
        f"{followers} SSE followers of one turn: all saw its end {all_saw_ms} ms after connecting"
    )
    figures["fan_out"] = {"followers": followers, "all_saw_the_end_ms": all_saw_ms}
    return figures


async def run_cancel(http: aiohttp.ClientSession) -> dict[str, Any]:
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
            cancels.append(time.perf_counter() - asked)
    return {"cancel_to_cancelled": report("cancel → turn.cancelled (SSE)", cancels)}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--turns", type=int, default=400)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--followers", type=int, default=500)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    # The load generator is not what is measured: it collects garbage as the services do.
    tune_gc()
    figures: dict[str, Any] = {"workers": args.workers}
    print(f"stack: {args.workers} workers, scripted model without delay")
    with up({"TURNBUS_SCRIPTED_DELAY_MS": "0"}, args.workers) as stack:

        async def throughput() -> dict[str, Any]:
            async with stack.http() as http:
                return await run_throughput(http, args.turns, args.sessions, args.followers)

        figures["throughput"] = asyncio.run(throughput())
    print(f"stack: {args.workers} workers, scripted model with 100 ms per chunk")
    with up({"TURNBUS_SCRIPTED_DELAY_MS": "100"}, args.workers) as stack:

        async def cancel() -> dict[str, Any]:
            async with stack.http() as http:
                return await run_cancel(http)

        figures["cancel"] = asyncio.run(cancel())
    print(f"wrote {write_results('bench_turns', figures, args.results_dir)}")


if __name__ == "__main__":
    main()

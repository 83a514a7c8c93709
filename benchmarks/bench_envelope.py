"""Envelope write and read throughput against a private redis-server.

Prints writes/s for worker overlays and host replaces (each one Lua call that
also appends to the session log) and reads/s, over many sessions and concurrent
writers, and writes them to benchmarks/results/bench_envelope.json.
Run: `make bench` or `PYTHONPATH=. .venv/bin/python benchmarks/bench_envelope.py`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.benchlib import arguments, write_results
from harness.redis_server import private_redis_server
from turnbus.shared.connect import connect
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import Keys
from turnbus.shared.meta import Meta
from turnbus.shared.settings import Settings


async def run(url: str, sessions: int, ops: int, concurrency: int) -> dict[str, Any]:
    # The services' client (shared.connect): commands multiplexed on one connection.
    client = connect(Settings(redis_url=url), "status")
    store = EnvelopeStore(client, Keys("bench"))
    figures: dict[str, Any] = {"sessions": sessions, "ops": ops, "concurrency": concurrency}
    try:
        for i in range(sessions):
            await store.create("u", f"s{i}", Meta(title=f"session {i}"))
        sem = asyncio.Semaphore(concurrency)

        async def timed(label: str, make: object) -> None:
            async def one(i: int) -> None:
                async with sem:
                    await make(i)  # type: ignore[operator]

            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(ops)))
            elapsed = time.perf_counter() - start
            print(f"{label:<28} {ops / elapsed:>10,.0f} ops/s  ({ops} ops, {elapsed:.2f} s)")
            figures[label] = {"ops_per_s": round(ops / elapsed), "seconds": round(elapsed, 2)}

        notes = "- a finding worth keeping\n" * 40  # ~1 KiB of notes

        async def overlay(i: int) -> None:
            await store.worker_overlay("u", f"s{i % sessions}", {"workingNotes": f"{notes}{i}"})

        # An hour ahead: past the overlays' clocks, within the host clock's window.
        host_clock = time.time_ns() // 1_000_000 + 3_600_000

        async def replace(i: int) -> None:
            await store.host_replace("u", f"s{i % sessions}", host_clock + i, Meta(title=f"t{i}"))

        async def read(i: int) -> None:
            await store.read("u", f"s{i % sessions}")

        await timed("worker_overlay (1 KiB notes)", overlay)
        await timed("host_replace", replace)
        await timed("read", read)
    finally:
        await client.aclose()
    return figures


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--ops", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=50)
    args = parser.parse_args()
    with private_redis_server() as url:
        figures = asyncio.run(run(url, args.sessions, args.ops, args.concurrency))
    print(f"wrote {write_results('bench_envelope', figures, args.results_dir)}")


if __name__ == "__main__":
    main()

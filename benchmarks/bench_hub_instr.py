"""What the SSE hub's reads cost Redis, in instructions counted under valgrind.

The hub follows F streams (``--streams``, default 1,000), one follower each. A writer
appends one event to each of A streams picked at random (``--active``, default 50: the
turns streaming at that moment), in one pipelined send, waits until every follower
has its event, and does that W times (``--waves``, default 40). With each event the
writer also sets a field of a hash of the same session (a turn writes about as many
other keys as events: records, envelopes, logs). Redis runs under callgrind, so the
figures are instructions (user space; the kernel's socket work is not counted) and do
not move with the machine's load. Four runs, each on a fresh Redis: no hub (the
writes alone), the hub with client tracking (its default mode: the keys read), the
hub with tracking in broadcast mode (``BCAST PREFIX``: every key written under the
prefix), and the hub with blocking reads (what it falls back to when Redis refuses
``CLIENT TRACKING``). What the hub costs is a run's count less the writes-alone run's.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_hub_instr.py [--streams F]`
(needs `valgrind` and `redis-server` on PATH; without them it says so and writes nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_redis_instr import (
    _control,
    _instructions,
    callgrind_ready,
    dumps_of,
    redis_under_callgrind,
)
from benchmarks.benchlib import arguments, write_results
from turnbus.gateway.hub import CAUGHT_UP, SseHub, StreamEntry
from turnbus.shared.connect import connect
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings

_EVENT = '{"type":"text.delta","turnId":"t","round":1,"text":"word "}'


async def _waves(url: str, mode: str, args: argparse.Namespace, control: list[str]) -> Any:
    client = connect(Settings(redis_url=url), "status")
    keys = Keys("bench")
    streams = [f"bench:{{u{i}:s}}:turn:t{i}:events" for i in range(args.streams)]
    for key in streams:
        await client.xadd(key, {"data": _EVENT})
    hub: SseHub | None = None
    if mode != "none":
        tracking = mode in ("tracking", "broadcast")
        hub = SseHub(
            Settings(redis_url=url), client, keys, tracking=tracking, broadcast=mode == "broadcast"
        )
        await hub.start()
    got = [0] * args.streams
    arrived = asyncio.Event()

    async def follow(n: int) -> None:
        assert hub is not None
        async for item in hub.stream(streams[n], None, lambda e: True):
            if isinstance(item, StreamEntry) or item is CAUGHT_UP:
                got[n] += 1
                arrived.set()

    followers = [asyncio.ensure_future(follow(n)) for n in range(args.streams)] if hub else []

    async def until(expected: list[int]) -> None:
        deadline = time.monotonic() + 120
        while hub is not None and any(g < e for g, e in zip(got, expected, strict=True)):
            arrived.clear()
            async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                await arrived.wait()

    expected = [2] * args.streams  # the entry written above, then CAUGHT_UP
    await until(expected)
    rng = random.Random(17)
    await _control(control, "-z")
    before = await client.info("commandstats")
    reads_before = (await client.info("stats"))["total_reads_processed"]
    for _ in range(args.waves):
        picked = rng.sample(range(args.streams), args.active)
        async with client.pipeline(transaction=False) as pipe:
            for n in picked:
                pipe.xadd(streams[n], {"data": _EVENT})
                pipe.hset(f"bench:{{u{n}:s}}:turn:t{n}", "seq", str(expected[n]))
                expected[n] += 1
            await pipe.execute()
        await until(expected)
    reads = (await client.info("stats"))["total_reads_processed"] - reads_before
    after = await client.info("commandstats")
    await _control(control, "-d")
    for task in followers:
        task.cancel()
    await asyncio.gather(*followers, return_exceptions=True)
    if hub is not None:
        await hub.close()
    await client.aclose()
    events = args.waves * args.active
    xread = after.get("cmdstat_xread", {}).get("calls", 0) - before.get("cmdstat_xread", {}).get(
        "calls", 0
    )
    return {"xread_per_event": round(xread / events, 3), "round_trips": reads, "events": events}


def _run(mode: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    with redis_under_callgrind(out, []) as (url, pid):
        figures: dict[str, Any] = asyncio.run(
            _waves(url, mode, args, ["callgrind_control", str(pid)])
        )
    dumps = dumps_of(out, pid)
    figures["instructions"] = _instructions(dumps[0])[0] if dumps else 0
    return figures


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--active", type=int, default=50)
    parser.add_argument("--waves", type=int, default=40)
    args = parser.parse_args()
    if not callgrind_ready("bench_hub_instr"):
        return 0
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="turnbus-hub-instr-") as tmp:
        for mode in ("none", "tracking", "broadcast", "blocking"):
            out = Path(tmp, mode)
            out.mkdir()
            runs[mode] = _run(mode, args, out)
    events = args.waves * args.active
    base = runs["none"]["instructions"]
    for mode, figures in runs.items():
        figures["instructions_per_event"] = figures["instructions"] // events
        figures["hub_instructions_per_event"] = (figures["instructions"] - base) // events
        print(
            f"{mode:9} Redis instructions/event {figures['instructions_per_event']:>9,}"
            f"  the hub's {figures['hub_instructions_per_event']:>9,}"
            f"  XREAD/event {figures['xread_per_event']:.3f}"
            f"  round trips {figures['round_trips']}"
        )
    write_results(
        "bench_hub_instr",
        {
            "streams_followed": args.streams,
            "active_per_wave": args.active,
            "waves": args.waves,
            "runs": runs,
        },
        args.results_dir,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

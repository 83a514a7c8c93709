"""A burst of concurrent clients against a running stack: how many get errors or 503s.

Each client signs in as its own user, creates a session, submits a turn and (with
``--follow``) reads the turn's SSE stream to its terminal event, all at once.
Start a stack first, e.g. ``TURNBUS_SCRIPTED_DELAY_MS=200 turnbus up --data-dir D``,
then: ``PYTHONPATH=. .venv/bin/python benchmarks/gateway_burst.py --data-dir D -n 2000 --follow``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
from pathlib import Path

import aiohttp
from gateway.auth import mint_token
from worker.up import read_secret

TERMINAL = {"turn.completed", "turn.failed", "turn.cancelled", "turn.timed_out"}


async def one_client(
    http: aiohttp.ClientSession,
    secret: str,
    i: int,
    follow: bool,
    counts: collections.Counter[str],
    start: asyncio.Event,
) -> float | None:
    headers = {"Authorization": f"Bearer {mint_token(secret, f'burst{i}')}"}
    await start.wait()
    began = time.perf_counter()
    try:
        async with http.post("/v1/sessions", json={}, headers=headers) as r:
            counts[f"create {r.status}"] += 1
            if r.status != 201:
                return None
            sid = (await r.json())["sessionId"]
        async with http.post(
            f"/v1/sessions/{sid}/turns", json={"message": f"hello {i}"}, headers=headers
        ) as r:
            counts[f"submit {r.status}"] += 1
            if r.status != 202:
                return None
            url = (await r.json())["eventsUrl"]
        if follow:
            async with http.get(url, headers=headers) as r:
                counts[f"events {r.status}"] += 1
                kind = ""
                async for raw in r.content:
                    line = raw.decode().rstrip("\r\n")
                    if line.startswith("event:"):
                        kind = line[6:].strip()
                        if kind in TERMINAL or kind == "stream.dropped":
                            break
                counts[f"end {kind}"] += 1
        return time.perf_counter() - began
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        counts[f"error {type(exc).__name__}"] += 1
        return None


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--data-dir", type=Path, default=Path(".turnbus"))
    parser.add_argument("-n", type=int, default=2000, help="concurrent clients")
    parser.add_argument("--follow", action="store_true", help="read each turn's SSE stream")
    args = parser.parse_args()
    secret = read_secret(args.data_dir)
    if secret is None:
        raise SystemExit(f"no JWT secret in {args.data_dir}: is a stack running there?")
    counts: collections.Counter[str] = collections.Counter()
    start = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(args.url, connector=connector, timeout=timeout) as http:
        tasks = [
            asyncio.create_task(one_client(http, secret, i, args.follow, counts, start))
            for i in range(args.n)
        ]
        await asyncio.sleep(0.5)  # every token minted, every task at the gate
        began = time.perf_counter()
        start.set()
        times = sorted(t for t in await asyncio.gather(*tasks) if t is not None)
        elapsed = time.perf_counter() - began
    print(f"{args.n} clients, {elapsed:.1f} s")
    for key in sorted(counts):
        print(f"  {key:<28} {counts[key]}")
    if times:
        p50, p99 = times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]
        print(f"  client time p50 {p50:.2f} s  p99 {p99:.2f} s  (ok: {len(times)})")


if __name__ == "__main__":
    asyncio.run(main())

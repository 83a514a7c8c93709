"""arq's no-op jobs/s, for the side-by-side in bench_load.py's noop scenario.

Runs in benchmarks/.arq-venv (arq pins its own redis client), against the Redis of the
stack under test. Enqueues ``--jobs`` no-op jobs on a queue of its own, then runs
``--workers`` arq worker processes in burst mode, tuned for throughput (500 jobs at
once per worker, 10 ms poll, no results kept). jobs/s counts from the first job's
start to the last job's end. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from typing import Any

from arq import create_pool
from arq.connections import RedisSettings
from arq.worker import Worker

QUEUE = "bench:arq:queue"
STATS: dict[str, Any] = {"first": None, "last": None, "count": 0}


async def noop(ctx: dict[str, Any]) -> None:
    now = time.time()
    if STATS["first"] is None:
        STATS["first"] = now
    STATS["count"] += 1
    STATS["last"] = now


async def enqueue(url: str, jobs: int) -> None:
    pool = await create_pool(RedisSettings.from_dsn(url))
    await pool.delete(QUEUE)
    for _ in range(jobs):
        await pool.enqueue_job("noop", _queue_name=QUEUE)
    await pool.aclose()


async def work(url: str) -> None:
    worker = Worker(
        functions=[noop],
        redis_settings=RedisSettings.from_dsn(url),
        queue_name=QUEUE,
        burst=True,
        max_jobs=500,
        poll_delay=0.01,
        keep_result=0,
        handle_signals=False,
    )
    await worker.main()
    await worker.close()
    print(json.dumps(STATS), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work", action="store_true", help="(internal) be one worker")
    args = parser.parse_args()
    if args.work:
        asyncio.run(work(args.redis_url))
        return
    asyncio.run(enqueue(args.redis_url, args.jobs))
    argv = [sys.executable, __file__, "--redis-url", args.redis_url, "--work"]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(args.workers)]
    stats = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    ran = [s for s in stats if s["count"]]
    count = sum(s["count"] for s in ran)
    span = max(s["last"] for s in ran) - min(s["first"] for s in ran)
    import arq

    print(
        json.dumps(
            {
                "arq_version": getattr(arq, "VERSION", "?"),
                "jobs": count,
                "workers": args.workers,
                "max_jobs_per_worker": 500,
                "seconds": round(span, 3),
                "jobs_per_s": round(count / span, 1),
            }
        )
    )


if __name__ == "__main__":
    main()

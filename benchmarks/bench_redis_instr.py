"""Redis's instructions per turn, counted under valgrind: a figure the machine's load does not move.

Redis CPU per turn measured by time (``bench_load.py``) moves by ±15 % between runs on
a shared machine, more than most changes to a script. This script counts instead: it
runs the PATH ``redis-server`` under valgrind's callgrind, one worker in this process
(the scripted model, no model delay) and N "remember" turns (2 model rounds, a notes
write), and reports the user-space instructions Redis executed per turn (every command,
the scripts' included; the kernel's socket work is not counted) and, in a second run,
the median per call of each script. No SSE hub runs: its reads are not in the figures.
Valgrind runs Redis ~50x slower, so the worker's timers are stretched to keep them out.

``--pause``: N turns that call a client tool and pause instead; once every one waits,
each is answered (``TurnStore.submit_actions``: the answer script and the work entry,
as the gateway does it) and the counts cover the answer window only: the answer, the
resumed start, the round after and the turn's end, per answered turn.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_redis_instr.py [--turns N] [--pause]`
(needs `valgrind` on PATH; without it the script says so and writes nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from benchmarks.benchlib import arguments, free_port, write_results
from harness.inline_worker import running_worker
from harness.waits import wait_until
from turnbus.shared.connect import connect, connect_sync
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import Keys
from turnbus.shared.records import ClientTool
from turnbus.shared.settings import Settings
from turnbus.shared.turn_answers import ActionAnswer
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.scripted import ScriptedModel

# Which script a per-call dump is, by the commands it ran (each script's own mix).
_SCRIPT_BY_COMMANDS = (
    ("turn_finish", ("lremCommand",)),
    ("turn_submit", ("zrangeGenericCommand", "existsCommand")),
    ("turn_start", ("lrangeCommand",)),
    ("turn_round", ("rpushCommand",)),
    ("envelope_write (notes)", ("getCommand",)),  # fenced by the lease: the worker's
    ("envelope_write (create)", ("hsetCommand",)),  # the sessions made before the turns
)
# The scripts of a paused and answered turn (--pause; this run counts every call, the
# submit's and the pause's too): the answer is the one left that adds to the outbox.
_PAUSE_SCRIPTS = (
    ("turn_finish", ("lremCommand",)),
    ("turn_submit", ("zrangeGenericCommand", "existsCommand")),
    ("turn_pause", ("pexpireCommand",)),
    ("turn_actions", ("zaddCommand",)),
    ("turn_start (resumed)", ("xrevrangeCommand",)),
    ("turn_start (first)", ("lrangeCommand",)),
    ("turn_round", ("rpushCommand",)),
    ("envelope_write (create)", ("hsetCommand",)),
)
_PICK = ClientTool(name="pick_file", description="Ask the user to pick a file.")


async def _turns(url: str, n: int, control: list[str] | None, pause: bool) -> dict[str, Any]:
    """N remember turns through one worker; ``control`` (callgrind_control and the pid)
    zeroes the counts before the turns and dumps them after. ``pause``: N turns that
    pause for a client tool, the counts around their answers (see the docstring)."""
    settings = Settings(
        redis_url=url,
        prefix="bench",
        jwt_secret="bench-" + "x" * 32,
        heartbeat_ms=600_000,
        lease_ms=1_200_000,
        claim_idle_ms=6_000_000,
        # The outbox sweeper's pass (a ZCOUNT per slot, 16,384) would land in the counts.
        outbox_grace_ms=6_000_000,
        worker_max_pool_wait_ms=60_000,
        worker_max_loop_lag_ms=60_000,
    )
    client = connect(settings, "status")
    keys = Keys("bench")
    store, turns = EnvelopeStore(client, keys), TurnStore(client, keys, settings)
    try:
        for i in range(n + 1):
            await store.create(f"u{i}", "s")
        async with running_worker(settings, ScriptedModel(settings), concurrency=20) as w:
            await turns.submit_queued("u0", "s", "remember the warm-up")  # loads the scripts
            await wait_until(lambda: _true(w.turns_finished >= 1), 60)
            if pause:
                return await _answered_turns(client, turns, w, n, control)
            if control:
                await _control(control, "-z")
            before = await client.info("commandstats")
            gate = asyncio.Semaphore(20)

            async def submit(i: int) -> None:
                async with gate:
                    await turns.submit_queued(f"u{i}", "s", f"remember the thing {i}")

            await asyncio.gather(*(submit(i) for i in range(1, n + 1)))
            await wait_until(lambda: _true(w.turns_finished >= n + 1), 60 + n)
            after = await client.info("commandstats")
            if control:
                await _control(control, "-d")
    finally:
        await client.aclose()
    return _per_turn(before, after, n)


def _per_turn(before: dict[str, Any], after: dict[str, Any], n: int) -> dict[str, Any]:
    calls = {
        k.removeprefix("cmdstat_"): (v["calls"] - before.get(k, {}).get("calls", 0)) / n
        for k, v in after.items()
    }
    return {k: round(v, 2) for k, v in sorted(calls.items()) if v and k != "info"}


async def _answered_turns(
    client: Any, turns: TurnStore, worker: Any, n: int, control: list[str] | None
) -> dict[str, Any]:
    """N turns paused for a client tool, then answered; the counts cover the answers
    and what follows until every turn has ended."""
    gate = asyncio.Semaphore(20)
    tid_of: dict[str, str] = {}

    async def submit(i: int) -> None:
        async with gate:
            record, _, _ = await turns.submit_queued(
                f"u{i}", "s", f'call pick_file {{"i": {i}}}', client_tools=[_PICK]
            )
            tid_of[f"u{i}"] = record.turnId

    async def status(user: str) -> str:
        record = await turns.get(user, "s", tid_of[user])
        return record.status if record else ""

    async def all_in(statuses: set[str]) -> bool:
        return all([await status(user) in statuses for user in tid_of])

    await asyncio.gather(*(submit(i) for i in range(1, n + 1)))
    await wait_until(lambda: all_in({"requires_action"}), 60 + n)
    answers: dict[str, list[ActionAnswer]] = {}
    for user, tid in tid_of.items():
        record = await turns.get(user, "s", tid)
        assert record is not None and record.pendingCalls
        answers[user] = [ActionAnswer(callId=c.callId, output="a.txt") for c in record.pendingCalls]
    if control:
        await _control(control, "-z")
    before = await client.info("commandstats")

    async def answer(user: str) -> None:
        async with gate:
            await turns.submit_actions(user, "s", tid_of[user], answers[user])

    await asyncio.gather(*(answer(user) for user in tid_of))
    # The worker's count, not the records (their reads would land in the counts).
    await wait_until(lambda: _true(worker.turns_finished >= n + 1), 60 + n)
    after = await client.info("commandstats")
    if control:
        await _control(control, "-d")
    if not await all_in({"completed"}):
        raise RuntimeError("a turn answered did not complete")
    return _per_turn(before, after, n)


async def _control(control: list[str], flag: str) -> None:
    """``callgrind_control -z`` (zero the counts) or ``-d`` (dump them) on the server."""
    proc = await asyncio.create_subprocess_exec(
        control[0], flag, control[1], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    if await proc.wait():
        raise RuntimeError(f"callgrind_control {flag} failed")


async def _true(value: bool) -> bool:
    return value


@contextlib.contextmanager
def redis_under_callgrind(out: Path, extra: list[str]) -> Iterator[tuple[str, int]]:
    """The PATH ``redis-server`` under callgrind (its dumps in ``out``): its URL and pid.
    It is shut down on leaving, which writes the final dump."""
    port = free_port()
    server = subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out / 'cg.out'}",
            *extra,
            "redis-server",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=out,
    )
    url = f"redis://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                connect_sync(Settings(redis_url=url), "admin").ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield url, server.pid
        connect_sync(Settings(redis_url=url), "admin").shutdown(nosave=True)
    except redis.ConnectionError:
        pass  # the shutdown closes the connection
    finally:
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def callgrind_ready(script: str) -> bool:
    """Whether valgrind and redis-server are on PATH; when not, ``script`` says it is skipped."""
    if shutil.which("valgrind") and shutil.which("redis-server"):
        return True
    print(f"{script}: needs valgrind and redis-server on PATH; skipped")
    return False


def dumps_of(out: Path, pid: int) -> list[Path]:
    """The callgrind dumps asked for (``callgrind_control -d``), not the final one."""
    return sorted(p for p in out.glob("cg.out.*") if p.suffix != f".{pid}")


def _under_callgrind(
    n: int, out: Path, extra: list[str], pause: bool
) -> tuple[dict[str, Any], list[Path]]:
    with redis_under_callgrind(out, extra) as (url, pid):
        control = ["callgrind_control", str(pid)] if not extra else None
        calls = asyncio.run(_turns(url, n, control, pause))
    return calls, dumps_of(out, pid)


def _instructions(dump: Path) -> tuple[int, str]:
    text = dump.read_text()
    found = re.search(r"^(?:summary|totals): (\d+)", text, re.MULTILINE)
    return (int(found.group(1)) if found else 0), text


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--pause", action="store_true", help="the answer window (see above)")
    args = parser.parse_args()
    if not callgrind_ready("bench_redis_instr"):
        return 0
    n = args.turns
    with tempfile.TemporaryDirectory(prefix="turnbus-instr-") as tmp:
        whole, per = Path(tmp, "whole"), Path(tmp, "per")
        whole.mkdir()
        per.mkdir()
        calls, dumps = _under_callgrind(n, whole, [], args.pause)
        total = _instructions(dumps[0])[0] if dumps else 0
        # One dump per script call, counted inside the script only.
        _, dumps = _under_callgrind(
            n,
            per,
            [
                "--collect-atstart=no",
                "--toggle-collect=evalShaCommand",
                "--dump-after=evalShaCommand",
            ],
            args.pause,
        )
        kinds = _PAUSE_SCRIPTS if args.pause else _SCRIPT_BY_COMMANDS
        by_script: dict[str, list[int]] = {}
        for dump in dumps:
            count, text = _instructions(dump)
            if not count:
                continue
            name = "other"
            for script, marks in kinds:
                if any(re.search(r"[ )]" + mark + r"\b", text) for mark in marks):
                    name = script
                    break
            by_script.setdefault(name, []).append(count)
    scripts = {
        k: {"calls": len(v), "median_instructions": int(statistics.median(v))}
        for k, v in sorted(by_script.items(), key=lambda kv: -statistics.median(kv[1]))
        if k != "other"
    }
    figures = {
        "turns": n,
        "window": "answer" if args.pause else "turn",
        "redis_instructions_per_turn": total // n,
        "redis_commands_per_turn": round(sum(calls.values()), 1),
        "commands_per_turn": calls,
        "scripts": scripts,
    }
    what = "answered pauses" if args.pause else "remember turns"
    print(f"Redis instructions per turn: {total // n:,} ({n} {what})")
    print(f"Redis commands per turn: {figures['redis_commands_per_turn']}")
    for name, row in scripts.items():
        print(f"  {name:<24} median {row['median_instructions']:>9,} instructions a call")
    name = "bench_redis_instr_pause" if args.pause else "bench_redis_instr"
    print(f"wrote {write_results(name, figures, args.results_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

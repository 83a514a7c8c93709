"""Worker processes as they run in production: ``python -m turnbus worker`` subprocesses in
one consumer group, killed, stopped with SIGTERM, and reclaimed by another worker."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from harness.redis_server import free_port
from tests.worker_kit import (
    WorkerProcess,
    log_events,
    running_worker,
    turn_events,
    types_of,
    wait_terminal,
    wait_until,
)
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.events import EnvelopePatched, RoundStarted, TurnStarted, is_terminal
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.consumer import GROUP
from turnbus.worker.models.scripted import ScriptedModel

pytestmark = [pytest.mark.slow]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for proc in started:
        proc.stop()


async def _group_pending(redis: aioredis.Redis, keys: Keys) -> int:
    info = await redis.xpending(keys.work(0), GROUP)
    return int(info["pending"])


async def _alive(redis: aioredis.Redis, keys: Keys, name: str) -> bool:
    return bool(await redis.hexists(keys.workers(), name))


@pytest.mark.timeout(90)
async def test_two_worker_processes_run_200_turns_over_50_sessions(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    procs: list[WorkerProcess],
    tmp_path: Path,
) -> None:
    turns = TurnStore(redis, keys, settings)
    sessions = [f"s{i}" for i in range(50)]
    for session in sessions:
        await store.create("u1", session)
    for name in ("wA", "wB"):
        procs.append(
            WorkerProcess(settings, name, tmp_path / f"{name}.log", TURNBUS_HEARTBEAT_MS="100")
        )
    for name in ("wA", "wB"):
        await wait_until(lambda name=name: _alive(redis, keys, name), 30)
    submitted: dict[str, list[str]] = {s: [] for s in sessions}
    for round_no in range(4):
        for session in sessions:
            record, _, _ = await turns.submit_queued(
                "u1", session, f"hello {round_no}", multitask="enqueue"
            )
            submitted[session].append(record.turnId)

    async def all_ended() -> bool:
        for session in sessions:
            if await redis.llen(keys.active("u1", session)):
                return False
        return True

    await wait_until(all_ended, 75, interval=0.1)
    await wait_until(lambda: _zero(_group_pending(redis, keys)), 10)

    for session, ids in submitted.items():
        for tid in ids:
            events = await turn_events(redis, keys, "u1", session, tid)
            terminals = [e for e in events if is_terminal(e)]
            assert types_of(terminals) == ["turn.completed"], (session, tid, types_of(events))
        # The session log totally orders each turn's start and end: they never interleave.
        running: str | None = None
        order: list[str] = []
        for event in await log_events(redis, keys, "u1", session):
            if isinstance(event, EnvelopePatched) and "turnRunId" in event.set:
                assert running is None, f"{event.set['turnRunId']} started while {running} ran"
                running = event.set["turnRunId"]
                order.append(running)
            elif is_terminal(event):
                assert getattr(event, "turnId", None) == running
                running = None
        assert order == ids, "turns of a session ran out of submission order"
    workers = {
        (await turns.get("u1", s, tid)).worker  # type: ignore[union-attr]
        for s, ids in submitted.items()
        for tid in ids
    }
    assert workers == {"wA", "wB"}, "both processes should have taken turns"


async def _zero(value: object) -> bool:
    return await value == 0  # type: ignore[misc]


@pytest.mark.timeout(60)
@pytest.mark.cluster
async def test_a_worker_killed_mid_turn_is_reclaimed_and_the_turn_resumes(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    procs: list[WorkerProcess],
    tmp_path: Path,
) -> None:
    fast = {
        "TURNBUS_LEASE_MS": "1000",
        "TURNBUS_HEARTBEAT_MS": "200",
        "TURNBUS_CLAIM_IDLE_MS": "600",
        "TURNBUS_SCRIPTED_DELAY_MS": "40",
        "TURNBUS_SCRIPTED_ROUNDS": "8",
    }
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    victim = WorkerProcess(settings, "victim", tmp_path / "victim.log", **fast)
    procs.append(victim)
    record, _, _ = await turns.submit_queued("u1", "s1", "remember the build is green")
    tid = record.turnId

    async def in_round_4() -> bool:
        events = await turn_events(redis, keys, "u1", "s1", tid)
        return any(isinstance(e, RoundStarted) and e.round == 4 for e in events)

    await wait_until(in_round_4, 30)
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(timeout=10)

    rescuer_settings = dataclasses.replace(
        settings,
        lease_ms=1000,
        heartbeat_ms=200,
        claim_idle_ms=600,
        scripted_delay_ms=0,
        scripted_rounds=8,
    )
    async with running_worker(rescuer_settings, ScriptedModel(rescuer_settings), name="rescuer"):
        events = await wait_terminal(redis, keys, "u1", "s1", tid, within=20)
        await wait_until(lambda: _zero(_group_pending(redis, keys)), 10)

    assert [e for e in types_of(events) if e.startswith("turn.")] == [
        "turn.queued",
        "turn.started",
        "turn.started",
        "turn.completed",
    ]
    starts = [e for e in events if isinstance(e, TurnStarted)]
    assert [(s.attempt, s.worker) for s in starts] == [(1, "victim"), (2, "rescuer")]
    # Resumed from the last committed round: rounds 1-3 are not played again.
    after = events[events.index(starts[1]) :]
    resumed = [e.round for e in after if isinstance(e, RoundStarted)]
    assert resumed[0] in (3, 4, 5) and resumed == list(range(resumed[0], 10))
    rows = [json.loads(r) for r in await redis.lrange(keys.messages("u1", "s1"), 0, -1)]
    assistant_rounds = [r["round"] for r in rows if r["kind"] == "assistant"]
    assert assistant_rounds == list(range(1, 10)), "every round committed exactly once"
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes == "- the build is green"


@pytest.mark.timeout(60)
async def test_sigterm_finishes_in_flight_turns_and_leaves_the_rest_pending(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    procs: list[WorkerProcess],
    tmp_path: Path,
) -> None:
    for session in ("a", "b"):
        await store.create("u1", session)
    turns = TurnStore(redis, keys, settings)
    worker = WorkerProcess(
        settings,
        "graceful",
        tmp_path / "graceful.log",
        concurrency=2,
        TURNBUS_SCRIPTED_DELAY_MS="60",
        TURNBUS_SCRIPTED_ROUNDS="4",
        TURNBUS_SHUTDOWN_GRACE_MS="20000",
        TURNBUS_HEARTBEAT_MS="100",
    )
    procs.append(worker)
    await wait_until(lambda: _alive(redis, keys, "graceful"), 30)
    first, _, _ = await turns.submit_queued("u1", "a", "first")
    # Queued behind the first: read, and waiting for its session without a run slot.
    second, _, _ = await turns.submit_queued("u1", "a", "second", multitask="enqueue")

    async def first_running_second_read() -> bool:
        events = await turn_events(redis, keys, "u1", "a", first.turnId)
        info = await redis.xpending(keys.work(0), GROUP)
        return "round.started" in types_of(events) and int(info["pending"]) == 2

    await wait_until(first_running_second_read, 30)
    worker.proc.send_signal(signal.SIGTERM)
    assert await _exit_code(worker.proc) == 0, worker.output()

    events = await turn_events(redis, keys, "u1", "a", first.turnId)
    assert types_of(events)[-1] == "turn.completed", "the in-flight turn was finished"
    record = await turns.get("u1", "a", second.turnId)
    assert record is not None and record.status == "queued", "the waiting turn was not started"
    pending = await redis.xpending_range(keys.work(0), GROUP, "-", "+", 10)
    assert [p["consumer"] for p in pending] == ["graceful"], "left pending for another worker"
    assert not await _alive(redis, keys, "graceful")

    # Another worker picks the leftover up once it has been idle long enough.
    other = dataclasses.replace(settings, claim_idle_ms=300, heartbeat_ms=100)
    async with running_worker(other, ScriptedModel(other), name="other"):
        events = await wait_terminal(redis, keys, "u1", "a", second.turnId, within=20)
    assert types_of(events)[-1] == "turn.completed"


@pytest.mark.timeout(60)
async def test_sigterm_past_the_grace_period_hands_the_turn_over(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    procs: list[WorkerProcess],
    tmp_path: Path,
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    worker = WorkerProcess(
        settings,
        "impatient",
        tmp_path / "impatient.log",
        TURNBUS_SCRIPTED_DELAY_MS="100",
        TURNBUS_SCRIPTED_ROUNDS="20",
        TURNBUS_SHUTDOWN_GRACE_MS="200",
        TURNBUS_HEARTBEAT_MS="100",
    )
    procs.append(worker)
    record, _, _ = await turns.submit_queued("u1", "s1", "a long one")
    tid = record.turnId

    async def streaming() -> bool:
        return "text.delta" in types_of(await turn_events(redis, keys, "u1", "s1", tid))

    await wait_until(streaming, 30)
    worker.proc.send_signal(signal.SIGTERM)
    assert await _exit_code(worker.proc) == 0, worker.output()
    assert not any(is_terminal(e) for e in await turn_events(redis, keys, "u1", "s1", tid))
    assert not await redis.exists(keys.lease("u1", "s1")), "the lease was released on the way out"

    other = dataclasses.replace(settings, claim_idle_ms=300, heartbeat_ms=100, scripted_rounds=20)
    async with running_worker(other, ScriptedModel(other), name="other"):
        events = await wait_terminal(redis, keys, "u1", "s1", tid, within=20)
    assert types_of(events)[-1] == "turn.completed"
    starts = [e for e in events if isinstance(e, TurnStarted)]
    assert [s.worker for s in starts] == ["impatient", "other"]


async def _exit_code(proc: subprocess.Popen[bytes], within: float = 30.0) -> int | None:
    async def exited() -> bool:
        return proc.poll() is not None

    await wait_until(exited, within)
    return proc.returncode


def test_an_unreachable_redis_exits_1_with_a_clear_message(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNBUS_")}
    # It gives up once its first calls have been retried for TURNBUS_REDIS_RETRY_MS.
    env.update(
        TURNBUS_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0",
        TURNBUS_MODEL="scripted",
        TURNBUS_REDIS_RETRY_MS="1000",
    )
    done = subprocess.run(
        [sys.executable, "-m", "turnbus", "worker", "--name", "lonely"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1
    assert "Redis unavailable" in done.stderr

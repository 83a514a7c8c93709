"""A worker process SIGKILLed while a tool runs: a side-effecting call never runs twice
without the model being told, an idempotent one runs again with the same key, a stored
result is reused; a cancel or the turn's wall clock closes the open calls. The tools
block on a gate this test runs (tests/worker/sample_tools.py), so the kill lands while
the tool is in flight."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.worker.test_pipeline import SAMPLE_TOOLS, calls, sample_registry
from tests.worker_kit import (
    WorkerProcess,
    running_worker,
    turn_events,
    wait_terminal,
    wait_until,
)
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.events import (
    Event,
    RoundStarted,
    TextDelta,
    ToolResult,
    TurnCancelled,
    TurnCompleted,
    TurnTimedOut,
    UnknownEvent,
)
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.scripted import ScriptedModel
from turnbus.worker.pipeline import CANCELLED, OUTCOME_UNKNOWN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

FAST = {
    "TURNBUS_LEASE_MS": "1000",
    "TURNBUS_HEARTBEAT_MS": "200",
    "TURNBUS_CLAIM_IDLE_MS": "600",
}


@dataclasses.dataclass
class Gate:
    """The test's end of the gated tools: who arrived, and when each is let through."""

    address: str
    arrivals: list[dict[str, Any]]
    hold: set[str]  # tools whose calls wait for ``release``
    release: asyncio.Event

    def count(self, tool: str) -> int:
        return sum(1 for a in self.arrivals if a["tool"] == tool)


@contextlib.asynccontextmanager
async def gate_server(hold: set[str]) -> AsyncIterator[Gate]:
    release = asyncio.Event()
    arrivals: list[dict[str, Any]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            hello = json.loads(await reader.readline())
            arrivals.append(hello)
            if hello["tool"] in gate.hold:
                await release.wait()
            writer.write(f"ok {hello['callId']}\n".encode())
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    gate = Gate(f"127.0.0.1:{port}", arrivals, hold, release)
    try:
        yield gate
    finally:
        release.set()
        server.close()


def rescuer(settings: Settings) -> Settings:
    return dataclasses.replace(
        settings, lease_ms=1000, heartbeat_ms=200, claim_idle_ms=600, scripted_delay_ms=0
    )


def streamed_text(events: list[Event | UnknownEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def results_of(events: list[Event | UnknownEvent]) -> dict[str, ToolResult]:
    return {e.callId: e for e in events if isinstance(e, ToolResult)}


async def killed_mid_tool(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    tmp_path: Path,
    gate: Gate,
    message: str,
    ready: Any,
    monkeypatch: pytest.MonkeyPatch,
    **env: str,
) -> tuple[str, list[Event | UnknownEvent]]:
    """Run ``message`` on a worker process, SIGKILL it once ``ready()`` holds, let an
    in-process worker resume the turn; the turn id and its events."""
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    victim = WorkerProcess(
        settings,
        "victim",
        tmp_path / "victim.log",
        TURNBUS_TOOLS=SAMPLE_TOOLS,
        SAMPLE_TOOLS_GATE=gate.address,
        **FAST,
        **env,
    )
    try:
        record, _, _ = await turns.submit_queued("u1", "s1", message)
        await wait_until(ready, 30)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
    finally:
        victim.stop()
    monkeypatch.setenv("SAMPLE_TOOLS_GATE", gate.address)
    gate.release.set()  # the rescuer's calls go through
    resumed = rescuer(settings)
    async with running_worker(
        resumed, ScriptedModel(resumed), name="rescuer", tools=sample_registry()
    ):
        events = await wait_terminal(redis, keys, "u1", "s1", record.turnId, within=30)
    return record.turnId, events


Crash = Any  # (gate, message, ready, **env) -> (turn id, events)


@pytest.fixture
def crash(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Crash:
    async def run(
        gate: Gate, message: str, ready: Any, **env: str
    ) -> tuple[str, list[Event | UnknownEvent]]:
        return await killed_mid_tool(
            redis, keys, settings, store, tmp_path, gate, message, ready, monkeypatch, **env
        )

    return run


@pytest.mark.cluster
async def test_a_side_effecting_call_runs_once_and_the_model_hears_the_outcome_is_unknown(
    crash: Crash, redis: aioredis.Redis, keys: Keys
) -> None:
    async with gate_server(hold={"charge"}) as gate:
        _, events = await crash(
            gate,
            calls(("charge", {"n": 1})),
            lambda: _true(gate.count("charge") == 1),
        )
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert gate.count("charge") == 1, "the side effect happened exactly once"
    (result,) = results_of(events).values()
    assert result.isError and result.output == OUTCOME_UNKNOWN
    assert result.callId == gate.arrivals[0]["callId"]
    text = streamed_text(events)
    assert text.endswith(OUTCOME_UNKNOWN), "the model was told, with the same call"
    rows = [json.loads(r) for r in await redis.lrange(keys.messages("u1", "s1"), 0, -1)]
    uses = [b["id"] for r in rows for b in r["content"] if b.get("type") == "tool_use"]
    assert uses == [result.callId], "the model was not asked the round again"


async def test_an_idempotent_call_runs_again_with_the_same_key(
    crash: Crash, redis: aioredis.Redis, keys: Keys
) -> None:
    async with gate_server(hold={"fetch"}) as gate:
        _, events = await crash(
            gate,
            calls(("fetch", {"n": 7})),
            lambda: _true(gate.count("fetch") == 1),
        )
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert gate.count("fetch") == 2
    first, second = gate.arrivals
    assert first["callId"] == second["callId"], "the rerun carries the same idempotency key"
    (result,) = results_of(events).values()
    assert not result.isError and result.output == f"fetch 7: ok {first['callId']}"


async def test_a_stored_result_is_reused_when_the_worker_dies_during_the_rounds_other_call(
    crash: Crash, redis: aioredis.Redis, keys: Keys
) -> None:
    async with gate_server(hold={"fetch"}) as gate:

        async def charged_and_fetching() -> bool:
            if gate.count("fetch") < 1:
                return False
            events = await turn_events(redis, keys, "u1", "s1", gate.arrivals[0]["turnId"])
            return any(isinstance(e, ToolResult) and e.name == "charge" for e in events)

        _, events = await crash(
            gate,
            calls(("charge", {"n": 1}), ("fetch", {"n": 2})),
            charged_and_fetching,
        )
    assert isinstance(events[-1], TurnCompleted), events[-1]
    assert gate.count("charge") == 1, "the stored result was reused, not run again"
    assert gate.count("fetch") == 2
    charge = next(a for a in gate.arrivals if a["tool"] == "charge")
    text = streamed_text(events)
    assert text.endswith(
        f"charge 1: ok {charge['callId']}\nfetch 2: ok " + gate.arrivals[-1]["callId"]
    )


async def test_a_completed_call_is_not_run_again_after_a_crash_in_the_next_round(
    crash: Crash, redis: aioredis.Redis, keys: Keys
) -> None:
    async with gate_server(hold=set()) as gate:

        async def in_round_2() -> bool:
            if not gate.arrivals:
                return False
            events = await turn_events(redis, keys, "u1", "s1", gate.arrivals[0]["turnId"])
            return any(isinstance(e, RoundStarted) and e.round == 2 for e in events)

        _, events = await crash(
            gate,
            calls(("charge", {"n": 3})),
            in_round_2,
            TURNBUS_SCRIPTED_DELAY_MS="2000",  # round 2 streams slowly: the kill lands in it
        )
    assert isinstance(events[-1], TurnCompleted), events[-1]
    # The kill landed in round 2: a second attempt finished the turn.
    assert [e.round for e in events if isinstance(e, RoundStarted)][-2:] == [2, 2], events
    assert gate.count("charge") == 1
    text = streamed_text(events)
    assert text.endswith(f"charge 3: ok {gate.arrivals[0]['callId']}")


async def test_a_cancel_closes_the_open_calls_with_a_cancelled_result(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    async with gate_server(hold={"fetch"}) as gate:
        monkeypatch.setenv("SAMPLE_TOOLS_GATE", gate.address)
        async with running_worker(settings, ScriptedModel(settings), tools=sample_registry()):
            record, _, _ = await turns.submit_queued(
                "u1", "s1", calls(("lookup", {"term": "x"}), ("fetch", {"n": 1}))
            )
            await wait_until(lambda: _true(gate.count("fetch") == 1), 20)
            await turns.request_cancel("u1", "s1", record.turnId)
            events = await wait_terminal(redis, keys, "u1", "s1", record.turnId, within=20)
    assert isinstance(events[-1], TurnCancelled)
    rows = [json.loads(r) for r in await redis.lrange(keys.messages("u1", "s1"), 0, -1)]
    uses = [b["id"] for r in rows for b in r["content"] if b.get("type") == "tool_use"]
    answers = {
        b["tool_use_id"]: b for r in rows for b in r["content"] if b.get("type") == "tool_result"
    }
    assert len(uses) == 2 and set(answers) == set(uses), "no tool_use is left without a result"
    assert answers[uses[0]]["content"] == "x: found"
    assert answers[uses[1]]["content"] == CANCELLED and answers[uses[1]]["is_error"]
    cancelled = results_of(events)[uses[1]]
    assert cancelled.isError and cancelled.output == CANCELLED


async def test_the_wall_clock_closes_the_open_calls_and_times_the_turn_out(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # fetch is held at the gate past the wall clock; its own timeout (60 s) is far off.
    settings = dataclasses.replace(settings, turn_wall_clock_ms=2000)
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    async with gate_server(hold={"fetch"}) as gate:
        monkeypatch.setenv("SAMPLE_TOOLS_GATE", gate.address)
        async with running_worker(settings, ScriptedModel(settings), tools=sample_registry()):
            record, _, _ = await turns.submit_queued(
                "u1", "s1", calls(("lookup", {"term": "x"}), ("fetch", {"n": 1}))
            )
            events = await wait_terminal(redis, keys, "u1", "s1", record.turnId, within=20)
        assert gate.count("fetch") == 1, "the clock ran out while the call was in flight"
    assert isinstance(events[-1], TurnTimedOut), events[-1]
    stored = await turns.get("u1", "s1", record.turnId)
    assert stored is not None and (stored.status, stored.reason) == ("timed_out", "wall_clock")
    rows = [json.loads(r) for r in await redis.lrange(keys.messages("u1", "s1"), 0, -1)]
    uses = [b["id"] for r in rows for b in r["content"] if b.get("type") == "tool_use"]
    answers = {
        b["tool_use_id"]: b for r in rows for b in r["content"] if b.get("type") == "tool_result"
    }
    assert len(uses) == 2 and set(answers) == set(uses), "no tool_use is left without a result"
    assert answers[uses[0]]["content"] == "x: found"
    assert answers[uses[1]]["content"] == CANCELLED and answers[uses[1]]["is_error"]
    closed = results_of(events)[uses[1]]
    assert closed.isError and closed.output == CANCELLED


async def _true(value: bool) -> bool:
    return value

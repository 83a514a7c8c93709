"""Helpers for the worker's tests: a programmable in-test model, event readers, waits.

A worker in the test's event loop and ``wait_until`` come from the harness (the
benchmarks use them too); they are named here as well, where the tests look for them.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from harness.inline_worker import running_worker as running_worker
from harness.waits import wait_until as wait_until
from turnbus.shared.events import Event, UnknownEvent, decode_event, event_type, is_terminal
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.worker.models.base import (
    ModelClient,
    ModelRequest,
    RoundResult,
    TextChunk,
    ToolUse,
    UsageCounts,
)

Step = Callable[[ModelRequest, int], Awaitable[list[TextChunk | RoundResult]]]


def text_round(
    text: str, *, chunks: int = 1, stop: str = "end_turn"
) -> list[TextChunk | RoundResult]:
    size = max(len(text) // chunks, 1)
    parts = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    return [
        *(TextChunk(p) for p in parts),
        RoundResult(
            stop_reason=stop,
            content=[{"type": "text", "text": text}],
            tool_uses=[],
            usage=UsageCounts(input_tokens=10, output_tokens=5),
        ),
    ]


def tool_round(
    name: str, tool_input: dict[str, Any], *, call_id: str = "toolu_1"
) -> list[TextChunk | RoundResult]:
    use = ToolUse(call_id, name, tool_input)
    return [
        TextChunk("calling a tool"),
        RoundResult(
            stop_reason="tool_use",
            content=[
                {"type": "text", "text": "calling a tool"},
                {"type": "tool_use", "id": call_id, "name": name, "input": tool_input},
            ],
            tool_uses=[use],
            usage=UsageCounts(input_tokens=10, output_tokens=5, cache_read_tokens=3),
        ),
    ]


class ProgramModel:
    """A model whose every round is decided by ``program(request, index)``; it records
    the requests it saw. ``delay_s`` sleeps before each chunk (to test mid-stream cancel)."""

    name = "program"

    def __init__(self, program: Step, *, delay_s: float = 0.0) -> None:
        self.program = program
        self.delay_s = delay_s
        self.requests: list[ModelRequest] = []
        self.closed_streams = 0
        self.started = asyncio.Event()

    async def stream_round(self, request: ModelRequest) -> AsyncIterator[TextChunk | RoundResult]:
        self.requests.append(request)
        items = await self.program(request, len(self.requests) - 1)
        try:
            for item in items:
                if self.delay_s:
                    self.started.set()
                    await asyncio.sleep(self.delay_s)
                yield item
        finally:
            self.closed_streams += 1

    async def aclose(self) -> None:
        return None


def rounds(*scripted: list[TextChunk | RoundResult]) -> Step:
    """A program that plays the given rounds in order, then ends every later round."""

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        if index < len(scripted):
            return scripted[index]
        return text_round("done")

    return program


async def turn_events(
    redis: aioredis.Redis, keys: Keys, user: str, session: str, turn_id: str
) -> list[Event | UnknownEvent]:
    entries = await redis.xrange(keys.turn_events(user, session, turn_id))
    return [decode_event(fields["data"]) for _, fields in entries]


async def log_events(
    redis: aioredis.Redis, keys: Keys, user: str, session: str
) -> list[Event | UnknownEvent]:
    entries = await redis.xrange(keys.log(user, session))
    return [decode_event(fields["data"]) for _, fields in entries]


async def wait_terminal(
    redis: aioredis.Redis, keys: Keys, user: str, session: str, turn_id: str, within: float = 10.0
) -> list[Event | UnknownEvent]:
    """The turn's events once its terminal event is written."""
    events: list[Event | UnknownEvent] = []

    async def ended() -> bool:
        nonlocal events
        events = await turn_events(redis, keys, user, session, turn_id)
        return any(is_terminal(e) for e in events)

    await wait_until(ended, within)
    return events


async def no_pending(redis: aioredis.Redis, keys: Keys, shard: int = 0) -> bool:
    """Whether every entry delivered on the shard's work stream has been acked."""
    info = await redis.xpending(keys.work(shard), "workers")
    return int(info["pending"]) == 0


def types_of(events: list[Event | UnknownEvent]) -> list[str]:
    return [event_type(e) for e in events]


async def collect_round(model: ModelClient, request: ModelRequest) -> tuple[list[str], RoundResult]:
    """Stream one round; returns its text chunks and its one, last, RoundResult."""
    chunks: list[str] = []
    result: RoundResult | None = None
    async for item in model.stream_round(request):
        assert result is None, "nothing may follow the RoundResult"
        if isinstance(item, TextChunk):
            chunks.append(item.text)
        elif isinstance(item, RoundResult):
            result = item
    assert result is not None
    return chunks, result


class WorkerProcess:
    """``python -m turnbus worker`` with the test's Redis, prefix and knobs."""

    def __init__(
        self, settings: Settings, name: str, log: Path, concurrency: int = 8, **env: str
    ) -> None:
        self.name = name
        self.log = log
        full = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("TURNBUS_")
            and k not in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "OPENAI_BASE_URL", "REDIS_URL")
        }
        full.update(
            TURNBUS_REDIS_URL=settings.redis_url,
            TURNBUS_REDIS_CLUSTER=str(int(settings.redis_cluster)),
            TURNBUS_PREFIX=settings.prefix,
            TURNBUS_MODEL="scripted",
        )
        full.update(env)
        with log.open("wb") as sink:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "turnbus",
                    "worker",
                    "--concurrency",
                    str(concurrency),
                    "--name",
                    name,
                ],
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

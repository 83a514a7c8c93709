"""The turn engine on the OpenAI-compatible client: the real ``openai`` SDK against the
fake Chat Completions API in its own process (harness/fake_openai.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from harness.fake_anthropic import FakeAnthropicProcess
from harness.fake_openai import FakeOpenAI
from harness.waits import poll
from tests.worker_kit import WorkerProcess, running_worker, turn_events, wait_terminal
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.events import (
    RoundStarted,
    TextDelta,
    ToolCall,
    ToolResult,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnStarted,
    Usage,
)
from turnbus.shared.keys import Keys
from turnbus.shared.meta import Meta
from turnbus.shared.providers import Provider
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.openai import OpenAIModel
from turnbus.worker.models.ratelimit import RateGate
from turnbus.worker.models.router import ModelRouter


@pytest.fixture
def fake(fake_openai: FakeOpenAI) -> FakeOpenAI:
    return fake_openai


def provider_of(fake: FakeOpenAI) -> Provider:
    return Provider("openai", "openai", fake.api_key, fake.base_url, "gpt-fake")


def openai_settings(settings: Settings, fake: FakeOpenAI, **knobs: Any) -> Settings:
    providers = (Provider("scripted", "scripted"), provider_of(fake))
    return dataclasses.replace(settings, model="openai", providers=providers, **knobs)


def model_for(settings: Settings, fake: FakeOpenAI) -> OpenAIModel:
    return OpenAIModel(
        settings, provider=provider_of(fake), gate=RateGate(), base_delay_s=0.01, max_delay_s=0.05
    )


@dataclasses.dataclass
class Stack:
    redis: aioredis.Redis
    keys: Keys
    settings: Settings
    store: EnvelopeStore
    turns: TurnStore

    async def submit(self, message: str, session: str = "s1") -> str:
        record, _, _ = await self.turns.submit_queued("u1", session, message)
        return record.turnId

    async def run(self, message: str, session: str = "s1", within: float = 20) -> list[Any]:
        tid = await self.submit(message, session)
        return await wait_terminal(self.redis, self.keys, "u1", session, tid, within=within)

    async def run_alone(self, fake: FakeOpenAI, message: str) -> list[Any]:
        """One turn on a worker of its own, on the OpenAI client; its events."""
        model = model_for(self.settings, fake)
        try:
            async with running_worker(self.settings, model):
                return await self.run(message)
        finally:
            await model.aclose()

    async def notes(self, session: str = "s1") -> str | None:
        envelope = await self.store.read("u1", session)
        assert envelope is not None
        return envelope.meta.workingNotes


@pytest.fixture
async def stack(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore, fake: FakeOpenAI
) -> Stack:
    configured = openai_settings(settings, fake)
    await store.create("u1", "s1")
    return Stack(redis, keys, configured, store, TurnStore(redis, keys, configured))


def text_of(events: list[Any]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


async def test_remember_recall_and_forget_through_the_notes_tools(
    stack: Stack, fake: FakeOpenAI
) -> None:
    fake.configure(responder="remember")
    model = model_for(stack.settings, fake)
    async with running_worker(stack.settings, model):
        remembered = await stack.run("remember the build is green")
        assert isinstance(remembered[-1], TurnCompleted)
        assert await stack.notes() == "- the build is green"
        recalled = await stack.run("what did we conclude?")
        assert isinstance(recalled[-1], TurnCompleted)
        assert "We concluded: - the build is green" in text_of(recalled)
        forgotten = await stack.run("forget everything")
        assert isinstance(forgotten[-1], TurnCompleted)
        assert await stack.notes() is None
    await model.aclose()
    names = [e.name for e in remembered + recalled + forgotten if isinstance(e, ToolCall)]
    assert names == ["working_notes_update", "working_notes_get", "working_notes_clear"]


async def test_a_tool_round_with_two_parallel_calls(stack: Stack, fake: FakeOpenAI) -> None:
    fake.enqueue(
        "Looking twice.",
        tool_calls=[
            {"id": "call_1", "name": "working_notes_get", "arguments": {}},
            {"id": "call_2", "name": "working_notes_update", "arguments": {"notes": "- two"}},
        ],
    )
    fake.enqueue("Both done.")
    events = await stack.run_alone(fake, "look and save")
    assert isinstance(events[-1], TurnCompleted)
    assert [(e.callId, e.isError) for e in events if isinstance(e, ToolResult)] == [
        ("call_1", False),
        ("call_2", False),
    ]
    assert await stack.notes() == "- two"
    first, second = fake.requests()
    assert first["parallel_tool_calls"] is True
    messages = second["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_1", "call_2"]
    assert [m["tool_call_id"] for m in messages[3:]] == ["call_1", "call_2"]


async def test_invalid_arguments_give_the_model_an_error_result_and_the_turn_goes_on(
    stack: Stack, fake: FakeOpenAI
) -> None:
    fake.enqueue(
        tool_calls=[{"id": "call_x", "name": "working_notes_update", "arguments": "{notes"}]
    )
    fake.enqueue("Sorry, retrying later.")
    events = await stack.run_alone(fake, "save something")
    assert isinstance(events[-1], TurnCompleted)
    (result,) = [e for e in events if isinstance(e, ToolResult)]
    assert result.isError and "not valid JSON" in result.output
    assert await stack.notes() is None, "the tool did not run"
    tool_message = fake.requests()[1]["messages"][-1]
    assert tool_message["role"] == "tool" and "not valid JSON" in tool_message["content"]


async def test_cancel_mid_stream_closes_the_stream(stack: Stack, fake: FakeOpenAI) -> None:
    fake.enqueue("One two three four five six seven", chunk_size=3, hold=True)
    model = model_for(stack.settings, fake)
    async with running_worker(stack.settings, model):
        tid = await stack.submit("talk")
        await poll(lambda: _is(fake.stats()["requests"] == 1), within=10)
        await stack.turns.request_cancel("u1", "s1", tid)
        events = await wait_terminal(stack.redis, stack.keys, "u1", "s1", tid)
        await poll(lambda: _is(fake.stats()["aborted_streams"] == 1), within=10)
    await model.aclose()
    assert isinstance(events[-1], TurnCancelled)
    assert fake.stats()["finished_streams"] == 0


async def _is(value: bool) -> bool:
    return value


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_a_worker_killed_mid_round_resumes_from_the_last_round(
    stack: Stack, fake: FakeOpenAI, tmp_path: Path
) -> None:
    fake.enqueue(
        "Saving.",
        tool_calls=[
            {"id": "call_s", "name": "working_notes_update", "arguments": {"notes": "- k"}}
        ],
    )
    fake.enqueue("Half a reply that never ends", hold=True)
    # Short enough to reclaim quickly, long enough that a busy machine does not make the
    # victim lose its own lease before it is killed.
    fast = {
        "TURNBUS_LEASE_MS": "3000",
        "TURNBUS_HEARTBEAT_MS": "500",
        "TURNBUS_CLAIM_IDLE_MS": "1500",
    }
    victim = WorkerProcess(
        stack.settings,
        "victim",
        tmp_path / "victim.log",
        TURNBUS_MODEL="openai",
        OPENAI_API_KEY=fake.api_key,
        OPENAI_BASE_URL=fake.base_url,
        **fast,
    )
    try:
        tid = await stack.submit("remember k")
        await poll(lambda: _is(fake.stats()["requests"] == 2), within=30)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
    finally:
        victim.stop()
    fake.enqueue("Saved it.")
    rescuer = dataclasses.replace(
        stack.settings, lease_ms=3000, heartbeat_ms=500, claim_idle_ms=1500
    )
    model = model_for(rescuer, fake)
    async with running_worker(rescuer, model, name="rescuer"):
        events = await wait_terminal(stack.redis, stack.keys, "u1", "s1", tid, within=30)
    await model.aclose()
    assert isinstance(events[-1], TurnCompleted), victim.output()
    starts = [e for e in events if isinstance(e, TurnStarted)]
    assert [s.worker for s in starts] == ["victim", "rescuer"]
    after = events[events.index(starts[1]) :]
    assert next(e.round for e in after if isinstance(e, RoundStarted)) == 2
    # The rescuer resent the committed round 1 (its call and result), not the cut one.
    resent = fake.requests()[2]["messages"]
    assert [m["role"] for m in resent] == ["system", "user", "assistant", "tool"]
    rows = [json.loads(r) for r in await stack.redis.lrange(stack.keys.messages("u1", "s1"), 0, -1)]
    assert [r["round"] for r in rows if r["kind"] == "assistant"] == [1, 2]
    assert await stack.notes() == "- k"


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_429_for_3_s_holds_every_turn_behind_one_gate(stack: Stack, fake: FakeOpenAI) -> None:
    sessions = [f"s{i}" for i in range(1, 13)]
    for session in sessions[1:]:
        await stack.store.create("u1", session)
    fake.configure(responder="remember", limit_for_s=3, limit_retry_after=1)
    model = model_for(stack.settings, fake)
    async with running_worker(stack.settings, model):
        tids = [await stack.submit(f"hello number {i}", s) for i, s in enumerate(sessions)]
        ends = await asyncio.gather(
            *(
                wait_terminal(stack.redis, stack.keys, "u1", s, t, within=30)
                for s, t in zip(sessions, tids, strict=True)
            )
        )
    await model.aclose()
    assert all(isinstance(events[-1], TurnCompleted) for events in ends)
    stats = fake.stats()
    limited = [t for t in stats["request_times"] if t < 3.0]
    # One probe per Retry-After while the limit holds, not a request per turn per try.
    assert stats["statuses"]["429"] <= 5 and len(limited) <= 5
    assert stats["statuses"]["200"] == len(sessions)


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_500_on_30_percent_of_requests_every_turn_completes_its_text_once(
    stack: Stack, fake: FakeOpenAI
) -> None:
    sessions = [f"s{i}" for i in range(1, 21)]
    for session in sessions[1:]:
        await stack.store.create("u1", session)
    fake.configure(responder="remember", error_share=0.3, seed=7)
    settings = dataclasses.replace(stack.settings, model_max_retries=10)
    model = model_for(settings, fake)
    async with running_worker(settings, model):
        tids = [await stack.submit(f"hello number {i} here", s) for i, s in enumerate(sessions)]
        ends = await asyncio.gather(
            *(
                wait_terminal(stack.redis, stack.keys, "u1", s, t, within=30)
                for s, t in zip(sessions, tids, strict=True)
            )
        )
    await model.aclose()
    for events in ends:
        assert isinstance(events[-1], TurnCompleted)
        assert text_of(events) == "A reply to your message of 4 words."
    assert fake.stats()["statuses"].get("500", 0) > 0


async def test_two_sessions_on_one_worker_each_on_its_own_provider(
    stack: Stack, fake: FakeOpenAI
) -> None:
    with FakeAnthropicProcess(default_text="From Claude.") as claude:
        providers = (
            Provider("scripted", "scripted"),
            provider_of(fake),
            Provider("anthropic", "anthropic", claude.api_key, claude.url, "claude-fake"),
        )
        settings = dataclasses.replace(stack.settings, model="anthropic", providers=providers)
        fake.enqueue("From GPT.")
        await stack.store.create("u1", "s-gpt", Meta(selectedModel="openai:gpt-4.1-mini"))
        await stack.store.create("u1", "s-claude", Meta(selectedModel="claude-sonnet-4-5"))
        router = ModelRouter(settings)
        async with running_worker(settings, router):
            gpt = await stack.run("hello", "s-gpt")
            claude_events = await stack.run("hello", "s-claude")
        await router.aclose()
        claude_requests = claude.requests()
    assert text_of(gpt) == "From GPT." and text_of(claude_events) == "From Claude."
    assert [r["model"] for r in fake.requests()] == ["gpt-4.1-mini"]
    assert [r["model"] for r in claude_requests] == ["claude-sonnet-4-5"]


async def test_a_provider_the_worker_lacks_fails_the_turn_clearly(stack: Stack) -> None:
    await stack.store.create("u1", "s-x", Meta(selectedModel="mistral:large"))
    router = ModelRouter(stack.settings)
    async with running_worker(stack.settings, router):
        events = await stack.run("hello", "s-x")
    await router.aclose()
    last = events[-1]
    assert isinstance(last, TurnFailed) and last.reason == "bad_request"
    assert "'mistral'" in last.message


async def test_the_turn_streams_text_deltas(stack: Stack, fake: FakeOpenAI) -> None:
    fake.enqueue("Streaming in several pieces.", chunk_size=4)
    events = await stack.run_alone(fake, "hi")
    assert text_of(events) == "Streaming in several pieces."
    assert any(
        isinstance(e, TextDelta)
        for e in await turn_events(stack.redis, stack.keys, "u1", "s1", events[-1].turnId)
    )


async def test_cached_prompt_tokens_reach_the_turns_usage_as_cache_reads(
    stack: Stack, fake: FakeOpenAI
) -> None:
    """The fake counts OpenAI's prefix cache: the second turn of a session whose prompt
    passes 1,024 tokens reads the first's prefix, and its usage event, its turn record
    and the session's meta count ``cached_tokens`` as cache reads."""
    await stack.store.create("u1", "s-cache", Meta(personaSnapshot="Be terse. " * 500))
    fake.enqueue("First.")
    fake.enqueue("Second.")
    model = model_for(stack.settings, fake)
    try:
        async with running_worker(stack.settings, model):
            first = await stack.run("hello", "s-cache")
            cold = fake.stats()["usage"]
            second = await stack.run("and again", "s-cache")
    finally:
        await model.aclose()
    assert isinstance(first[-1], TurnCompleted) and isinstance(second[-1], TurnCompleted)
    counted = fake.stats()["usage"]
    cached = counted["cached_tokens"] - cold["cached_tokens"]
    prompt = counted["prompt_tokens"] - cold["prompt_tokens"]
    assert cold["cached_tokens"] == 0 and cached >= 1024
    (usage,) = [e for e in second if isinstance(e, Usage)]
    expected = {
        "inputTokens": prompt - cached,
        "outputTokens": usage.outputTokens,
        "cacheReadTokens": cached,
        "cacheWriteTokens": 0,
    }
    assert {k: getattr(usage, k) for k in expected} == expected
    record = await stack.turns.get("u1", "s-cache", usage.turnId)
    assert record is not None and msgspec.to_builtins(record.usage) == expected
    envelope = await stack.store.read("u1", "s-cache")
    assert envelope is not None and json.loads(envelope.meta.usage or "{}") == expected

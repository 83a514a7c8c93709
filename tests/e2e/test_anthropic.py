"""The turn engine with the Anthropic client: the real SDK against the local fake API."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from harness.fake_anthropic import FakeAnthropic, PromptCache
from tests.worker_kit import running_worker, wait_terminal
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.events import RoundWaiting, TurnCompleted, TurnFailed, Usage, WorkingNotes
from turnbus.shared.keys import Keys
from turnbus.shared.meta import Meta
from turnbus.shared.settings import Settings
from turnbus.shared.system import working_notes_block
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.anthropic import AnthropicModel
from turnbus.worker.models.ratelimit import RateGate


def vars_of(usage: Usage) -> dict[str, int]:
    return {
        "inputTokens": usage.inputTokens,
        "outputTokens": usage.outputTokens,
        "cacheReadTokens": usage.cacheReadTokens,
        "cacheWriteTokens": usage.cacheWriteTokens,
    }


async def run_turn(
    settings: Settings, fake: FakeAnthropic, redis: aioredis.Redis, keys: Keys, message: str
) -> list[object]:
    sdk = fake.client()
    model = AnthropicModel(
        settings, client=sdk, gate=RateGate(), base_delay_s=0.001, max_delay_s=0.01
    )
    try:
        async with running_worker(settings, model):
            record, _, _ = await TurnStore(redis, keys, settings).submit_queued("u1", "s1", message)
            return list(await wait_terminal(redis, keys, "u1", "s1", record.turnId))
    finally:
        await model.aclose()
        await sdk.close()


@dataclasses.dataclass
class Sdk:
    """A worker on the real ``AnthropicModel`` against the fake API, for session s1 of u1."""

    redis: aioredis.Redis
    keys: Keys
    settings: Settings
    store: EnvelopeStore
    fake: FakeAnthropic

    async def run(self, message: str, **settings: Any) -> list[object]:
        """Run one turn with a worker of its own; its events."""
        configured = dataclasses.replace(self.settings, **settings)
        return await run_turn(configured, self.fake, self.redis, self.keys, message)


@pytest.fixture
def sdk(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    fake: FakeAnthropic,
) -> Sdk:
    return Sdk(redis, keys, dataclasses.replace(settings, model="anthropic"), store, fake)


async def test_a_tool_round_trip_through_the_sdk(sdk: Sdk) -> None:
    redis, keys, settings, store, fake = sdk.redis, sdk.keys, sdk.settings, sdk.store, sdk.fake
    await store.create("u1", "s1", Meta(personaSnapshot="Be brief.", selectedModel="claude-x"))
    fake.enqueue_tool_use(
        "working_notes_update",
        {"notes": "- the build is green"},
        text="Saving.",
        usage={"input_tokens": 100, "output_tokens": 20, "cache_creation_input_tokens": 900},
    )
    fake.enqueue_text(
        "Saved it.",
        usage={"input_tokens": 30, "output_tokens": 5, "cache_read_input_tokens": 900},
    )
    events = await sdk.run("remember the build is green")
    assert isinstance(events[-1], TurnCompleted)
    # The usage of both rounds, cache reads and writes included, is recorded.
    totals = {
        "inputTokens": 130,
        "outputTokens": 25,
        "cacheReadTokens": 900,
        "cacheWriteTokens": 900,
    }
    assert [vars_of(e) for e in events if isinstance(e, Usage)][-1] == totals
    turn_id = events[-1].turnId
    record = await TurnStore(redis, keys, settings).get("u1", "s1", turn_id)
    assert record is not None and msgspec.to_builtins(record.usage) == totals
    envelope = await store.read("u1", "s1")
    assert envelope is not None and json.loads(envelope.meta.usage or "{}") == totals
    assert [(e.bytes, e.sha256) for e in events if isinstance(e, WorkingNotes)] == [
        (20, hashlib.sha256(b"- the build is green").hexdigest())
    ]

    first, second = fake.requests
    assert first["model"] == "claude-x"
    assert [t["name"] for t in first["tools"]] == [
        "working_notes_get",
        "working_notes_update",
        "working_notes_clear",
    ]
    # Round 2's system carries the note, as blocks with cache breakpoints: the fold
    # text (it holds the head) and the last block.
    blocks = second["system"]
    assert "cache_control" not in blocks[0]
    assert blocks[1]["cache_control"] == {"type": "ephemeral"}
    joined = "".join(b["text"] for b in blocks)
    assert joined.endswith(working_notes_block("- the build is green") or "")
    assert blocks[-1]["cache_control"] == {"type": "ephemeral"}
    # The history the SDK sent: the prompt, the tool_use, its tool_result; a breakpoint
    # on the prompt, the longest prefix the next turn resends unchanged.
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert second["messages"][0]["content"][-1]["cache_control"] == {"type": "ephemeral"}
    assert PromptCache.breakpoints(second) <= PromptCache.MAX_BREAKPOINTS
    result = second["messages"][2]["content"][0]
    assert result["type"] == "tool_result"
    assert result["content"].startswith("working notes updated (20 bytes)")


async def test_overload_past_the_wait_bound_fails_the_turn(sdk: Sdk) -> None:
    await sdk.store.create("u1", "s1")
    for _ in range(200):
        sdk.fake.enqueue_error(529, retry_after=0.02)
    events = await sdk.run("hello", model_wait_s=0.5)
    last = events[-1]
    assert isinstance(last, TurnFailed) and last.reason == "overloaded"
    assert "TURNBUS_MODEL_WAIT_S" in last.message
    # Followers were told why nothing streamed.
    waiting = [e for e in events if isinstance(e, RoundWaiting)]
    assert waiting and {(e.round, e.reason) for e in waiting} == {(1, "overloaded")}


async def test_the_turn_after_a_notes_write_reads_its_history_from_the_cache(sdk: Sdk) -> None:
    """The next turn resends the notes write with the notes as their digest (the stored
    history), not as sent; it still reads everything up to that turn's prompt from the
    cache (the fake counts it as the API does; any prefix cached here)."""
    fake = sdk.fake
    await sdk.store.create("u1", "s1", Meta(personaSnapshot="Be brief."))
    fake.configure(min_cache_tokens=1)
    fake.enqueue_tool_use("working_notes_update", {"notes": "- the build is green"}, text="Saving.")
    fake.enqueue_text("Saved it.")
    fake.enqueue_text("The build.")
    first = await sdk.run("remember the build is green")
    assert isinstance(first[-1], TurnCompleted)
    second = await sdk.run("what is green?")
    assert isinstance(second[-1], TurnCompleted)

    body = fake.requests[-1]
    assert "[working notes: " in json.dumps(body["messages"][1]), "the stored history"
    through_prompt = {**body, "messages": body["messages"][:1], "cache_control": None}
    tokens = sum(max(len(raw) // 4, 1) for raw, _ in PromptCache._blocks(through_prompt))
    (usage,) = [e for e in second if isinstance(e, Usage)]
    assert usage.cacheReadTokens == tokens
    # What it writes is the first turn's rounds and the new prompt, not the whole history.
    assert 0 < usage.cacheWriteTokens < tokens / 4

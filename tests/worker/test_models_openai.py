"""The OpenAI-compatible client: the real ``openai`` SDK against the fake Chat Completions
API in its own process (harness/fake_openai.py)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

import pytest

from harness.fake_openai import FakeOpenAI, PrefixCache
from tests.worker_kit import collect_round
from turnbus.shared.providers import Provider
from turnbus.shared.settings import Settings
from turnbus.shared.system import resolve_system, resolve_system_blocks
from turnbus.worker.models.anthropic import AnthropicModel
from turnbus.worker.models.base import (
    ModelClient,
    ModelError,
    ModelRequest,
    ModelWaiting,
    RoundResult,
    TextChunk,
    ToolSpec,
)
from turnbus.worker.models.openai import OpenAIModel
from turnbus.worker.models.ratelimit import RateGate
from turnbus.worker.tools import NOTES_TOOL_SPECS

SETTINGS = Settings(model_max_retries=2, model_wait_s=10)


@pytest.fixture
def fake(fake_openai: FakeOpenAI) -> FakeOpenAI:
    return fake_openai


@pytest.fixture
async def model(fake: FakeOpenAI) -> AsyncIterator[OpenAIModel]:
    provider = Provider("openai", "openai", fake.api_key, fake.base_url, "gpt-fake")
    client = OpenAIModel(
        SETTINGS, provider=provider, gate=RateGate(), base_delay_s=0.001, max_delay_s=0.01
    )
    try:
        yield client
    finally:
        await client.aclose()


def request(
    text: str = "hello", *, tools: list[ToolSpec] | None = None, **options: object
) -> ModelRequest:
    blocks = resolve_system_blocks(persona="Be brief.", notes="- a note", skills=None)
    return ModelRequest(
        system_blocks=blocks,
        system="".join(b["text"] for b in blocks),
        messages=[{"role": "user", "content": [{"type": "text", "text": text}]}],
        tools=list(NOTES_TOOL_SPECS) if tools is None else tools,
        **options,  # type: ignore[arg-type]
    )


async def test_a_text_round_streams_and_the_request_is_chat_completions(
    model: OpenAIModel, fake: FakeOpenAI
) -> None:
    fake.enqueue("Hello there, friend.", chunk_size=4)
    req = request(reasoning_effort="high", model="o4-mini")
    chunks, result = await collect_round(model, req)
    assert "".join(chunks) == "Hello there, friend." and len(chunks) > 1
    assert result.stop_reason == "end_turn"
    assert result.content == [{"type": "text", "text": "Hello there, friend."}]
    assert result.usage.output_tokens > 0 and result.usage.input_tokens > 0
    (body,) = fake.requests()
    assert body["model"] == "o4-mini"
    # The system prompt is the first message, its bytes unchanged.
    assert body["messages"][0] == {"role": "system", "content": req.system}
    assert body["messages"][1] == {"role": "user", "content": "hello"}
    assert [t["function"]["name"] for t in body["tools"]] == [s["name"] for s in NOTES_TOOL_SPECS]
    assert body["tools"][0]["type"] == "function"
    assert body["tools"][0]["function"]["parameters"] == NOTES_TOOL_SPECS[0]["input_schema"]
    assert body["parallel_tool_calls"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["reasoning_effort"] == "high"
    assert body["stream"] is True


async def test_the_default_model_and_no_effort_for_a_model_that_does_not_reason(
    model: OpenAIModel, fake: FakeOpenAI
) -> None:
    fake.enqueue("ok")
    await collect_round(model, request(reasoning_effort="high", tools=[]))
    (body,) = fake.requests()
    assert body["model"] == "gpt-fake"
    assert "reasoning_effort" not in body
    assert "tools" not in body and "parallel_tool_calls" not in body


async def test_two_parallel_calls_are_assembled_in_order(
    model: OpenAIModel, fake: FakeOpenAI
) -> None:
    fake.enqueue(
        "Checking.",
        tool_calls=[
            {"id": "call_a", "name": "working_notes_get", "arguments": {}},
            {"id": "call_b", "name": "working_notes_update", "arguments": {"notes": "- x"}},
        ],
    )
    _, result = await collect_round(model, request())
    assert result.stop_reason == "tool_use"
    assert [(u.id, u.name, u.input) for u in result.tool_uses] == [
        ("call_a", "working_notes_get", {}),
        ("call_b", "working_notes_update", {"notes": "- x"}),
    ]
    assert [b["type"] for b in result.content] == ["text", "tool_use", "tool_use"]


async def test_quirk_arguments_in_one_character_pieces(
    model: OpenAIModel, fake: FakeOpenAI
) -> None:
    notes = '- a "quoted" note, with ünïcode'
    fake.enqueue(
        tool_calls=[{"name": "working_notes_update", "arguments": {"notes": notes}}], arg_chunk=1
    )
    _, result = await collect_round(model, request())
    (use,) = result.tool_uses
    assert use.input == {"notes": notes} and use.input_error is None


async def test_quirk_two_calls_at_the_same_index_with_different_ids(
    model: OpenAIModel, fake: FakeOpenAI
) -> None:
    fake.enqueue(
        tool_calls=[
            {"index": 0, "id": "call_1", "name": "working_notes_get", "arguments": {}},
            {
                "index": 0,
                "id": "call_2",
                "name": "working_notes_update",
                "arguments": {"notes": "y"},
            },
        ]
    )
    _, result = await collect_round(model, request())
    assert [(u.id, u.name, u.input) for u in result.tool_uses] == [
        ("call_1", "working_notes_get", {}),
        ("call_2", "working_notes_update", {"notes": "y"}),
    ]


async def test_quirk_arguments_as_a_dict_and_missing_arguments(
    model: OpenAIModel, fake: FakeOpenAI
) -> None:
    fake.enqueue(
        tool_calls=[
            {"name": "working_notes_update", "arguments": {"notes": "z"}, "whole": True},
            {"name": "working_notes_get", "arguments": ""},
        ]
    )
    _, result = await collect_round(model, request())
    assert [u.input for u in result.tool_uses] == [{"notes": "z"}, {}]


async def test_quirk_missing_usage(model: OpenAIModel, fake: FakeOpenAI) -> None:
    fake.enqueue("no usage here", usage=False)
    _, result = await collect_round(model, request())
    assert result.stop_reason == "end_turn"
    assert (result.usage.input_tokens, result.usage.output_tokens) == (0, 0)


async def test_quirk_a_stream_cut_before_finish_reason_is_retried(
    model: OpenAIModel, fake: FakeOpenAI
) -> None:
    fake.enqueue(tool_calls=[{"name": "working_notes_get", "arguments": {}}], truncate=True)
    fake.enqueue("Whole this time.")
    chunks, result = await collect_round(model, request())
    assert chunks == ["Whole th", "is time."] and result.stop_reason == "end_turn"
    assert fake.stats()["statuses"] == {"200": 2}


async def test_a_stream_cut_after_its_text_fails_rather_than_repeat_it(
    model: OpenAIModel, fake: FakeOpenAI
) -> None:
    fake.enqueue("Half a reply", truncate=True)
    with pytest.raises(ModelError) as failed:
        await collect_round(model, request())
    assert failed.value.reason == "connection"
    assert "finish_reason" in failed.value.message
    assert len(fake.requests()) == 1


async def test_invalid_json_arguments_give_a_tool_use_with_the_problem(
    model: OpenAIModel, fake: FakeOpenAI
) -> None:
    fake.enqueue(
        tool_calls=[{"id": "call_bad", "name": "working_notes_update", "arguments": '{"notes": '}]
    )
    _, result = await collect_round(model, request())
    (use,) = result.tool_uses
    assert use.id == "call_bad" and use.input == {}
    assert use.input_error is not None and "not valid JSON" in use.input_error
    assert result.stop_reason == "tool_use"


async def test_calls_with_finish_reason_stop_are_a_tool_round(
    model: OpenAIModel, fake: FakeOpenAI
) -> None:
    fake.enqueue(tool_calls=[{"name": "working_notes_get", "arguments": {}}], finish_reason="stop")
    _, result = await collect_round(model, request())
    assert result.stop_reason == "tool_use" and len(result.tool_uses) == 1


@pytest.mark.parametrize(
    ("finish", "stop"),
    [("stop", "end_turn"), ("length", "max_tokens"), ("content_filter", "refusal")],
)
async def test_finish_reasons_map_to_the_engines_stop_reasons(
    model: OpenAIModel, fake: FakeOpenAI, finish: str, stop: str
) -> None:
    fake.enqueue("text", finish_reason=finish)
    _, result = await collect_round(model, request())
    assert result.stop_reason == stop


async def test_cached_prompt_tokens_count_as_cache_reads(
    model: OpenAIModel, fake: FakeOpenAI
) -> None:
    fake.enqueue(
        "a", usage={"prompt_tokens": 2000, "prompt_tokens_details": {"cached_tokens": 1536}}
    )
    _, result = await collect_round(model, request())
    assert result.usage.cache_read_tokens == 1536
    assert result.usage.input_tokens == 2000 - 1536


def shared_prefix_tokens(one: dict[str, object], other: dict[str, object]) -> int:
    """The tokens two request bodies share from their start, as the fake counts them."""
    a, b = PrefixCache.prompt_bytes(one), PrefixCache.prompt_bytes(other)
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    return same // PrefixCache.TOKEN_BYTES


async def test_the_fake_reports_prompt_cache_reads_as_the_api_does(
    model: OpenAIModel, fake: FakeOpenAI
) -> None:
    """OpenAI's automatic prompt cache as documented: a prompt of 1,024 tokens or more
    reads the longest prefix an earlier request sent, in 128-token steps from 1,024 up
    (1,024, 1,152, …); a shorter prompt, or a shorter shared prefix, reads nothing."""
    skills = "- skill: summarise\n" * 100

    def long_request(
        notes: str, turns: list[str], persona: str = "Be terse. " * 400
    ) -> ModelRequest:
        messages = [
            {"role": role, "content": [{"type": "text", "text": text}]}
            for role, text in zip(["user", "assistant"] * len(turns), turns, strict=False)
        ]
        return ModelRequest(
            system_blocks=resolve_system_blocks(persona, notes, skills),
            system=resolve_system(persona, notes, skills),
            messages=messages,
            tools=list(NOTES_TOOL_SPECS),
        )

    async def prompt_and_cached(req: ModelRequest) -> tuple[int, int]:
        fake.enqueue("ok")
        _, result = await collect_round(model, req)
        usage = result.usage
        return usage.input_tokens + usage.cache_read_tokens, usage.cache_read_tokens

    short = [await prompt_and_cached(request()) for _ in range(2)]
    assert short[0] == short[1] and short[0][0] < 1024 and short[0][1] == 0

    cold = await prompt_and_cached(long_request("- a", ["hi"]))
    again = await prompt_and_cached(long_request("- a", ["hi"]))
    grown = await prompt_and_cached(long_request("- a", ["hi", "ok", "go"]))
    changed = await prompt_and_cached(long_request("- b", ["hi"]))
    other = await prompt_and_cached(long_request("- a", ["hi"], persona="Be kind. " * 400))
    assert cold[0] >= 1024 and cold[1] == 0
    # The whole prompt again, less its last partial step of 128 tokens.
    assert again == (cold[0], cold[0] // 128 * 128)
    # A longer history reads the prompt it extends.
    assert grown[0] > cold[0] and grown[1] == again[1]
    bodies = fake.requests()[2:]
    # Other notes: what precedes them in the system message (the tools, the default
    # text, the persona, the notes' fold) is read, in whole steps.
    assert changed[1] == shared_prefix_tokens(bodies[0], bodies[3]) // 128 * 128
    assert 1024 <= changed[1] < again[1]
    # Another persona: the prompts share only the tools and the default text, under
    # 1,024 tokens, so nothing is read.
    assert 0 < shared_prefix_tokens(bodies[0], bodies[4]) < 1024
    assert other[0] >= 1024 and other[1] == 0


@pytest.mark.parametrize(
    ("status", "reason"), [(400, "bad_request"), (401, "auth"), (403, "auth"), (404, "bad_request")]
)
async def test_client_errors_are_not_retried(
    model: OpenAIModel, fake: FakeOpenAI, status: int, reason: str
) -> None:
    fake.enqueue_error(status, message="the provider says no")
    with pytest.raises(ModelError) as failed:
        await collect_round(model, request())
    assert failed.value.reason == reason
    assert "the provider says no" in failed.value.message
    assert len(fake.requests()) == 1


async def test_5xx_and_429_are_retried_and_the_key_is_never_logged(
    model: OpenAIModel, fake: FakeOpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    fake.enqueue_error(500)
    fake.enqueue_error(503)
    fake.enqueue_error(429, retry_after=0)
    fake.enqueue("made it")
    chunks, _ = await collect_round(model, request())
    assert "".join(chunks) == "made it"
    assert fake.stats()["statuses"] == {"200": 1, "429": 1, "500": 1, "503": 1}
    assert fake.authorizations()[0] == f"Bearer {fake.api_key}"
    assert fake.api_key not in caplog.text


async def test_a_server_that_echoes_the_key_does_not_put_it_in_the_error(
    model: OpenAIModel, fake: FakeOpenAI
) -> None:
    fake.enqueue_error(401, message=f"Incorrect API key provided: {fake.api_key}.")
    with pytest.raises(ModelError) as failed:
        await collect_round(model, request())
    assert failed.value.reason == "auth"
    assert fake.api_key not in str(failed.value) and "[key]" in failed.value.message


async def test_5xx_past_the_retries_fails_with_provider_error(
    model: OpenAIModel, fake: FakeOpenAI
) -> None:
    for _ in range(3):
        fake.enqueue_error(502, message="bad gateway")
    with pytest.raises(ModelError) as failed:
        await collect_round(model, request())
    assert failed.value.reason == "provider_error" and "bad gateway" in failed.value.message


async def test_a_connection_failure_is_connection(fake: FakeOpenAI) -> None:
    provider = Provider("openai", "openai", "k", "http://127.0.0.1:9/v1", "m")
    model = OpenAIModel(
        Settings(model_max_retries=0), provider=provider, gate=RateGate(), base_delay_s=0.001
    )
    try:
        with pytest.raises(ModelError) as failed:
            await collect_round(model, request())
    finally:
        await model.aclose()
    assert failed.value.reason == "connection"


async def first_item(model: ModelClient) -> TextChunk | ModelWaiting | RoundResult:
    """The first thing a round yields; the round is then closed."""
    stream = model.stream_round(request())
    try:
        return await anext(stream)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def test_clients_of_one_key_and_base_url_share_the_process_gate(fake: FakeOpenAI) -> None:
    """Without a gate given, a client takes the process's gate of its API, key and base
    URL: a 429 to one holds every client of the same three, and no other."""
    key = f"sk-gate-{uuid.uuid4().hex}"  # a key no other test's gate has seen
    settings = Settings(model_max_retries=0, model_wait_s=2)

    def openai_at(api_key: str, base_url: str) -> OpenAIModel:
        return OpenAIModel(settings, provider=Provider("openai", "openai", api_key, base_url))

    limited, same = openai_at(key, fake.base_url), openai_at(key, fake.base_url)
    # Another provider name for the same endpoint and key: the same gate.
    named = OpenAIModel(settings, provider=Provider("local", "openai", key, fake.base_url))
    other_key = openai_at(key + "-2", fake.base_url)
    other_url = openai_at(key, "http://127.0.0.1:9/v1")  # nothing listens there
    claude = AnthropicModel(
        settings, provider=Provider("anthropic", "anthropic", key, fake.base_url)
    )
    models: list[ModelClient] = [limited, same, named, other_key, other_url, claude]
    try:
        fake.enqueue_error(429, retry_after=30)
        # The 429 closes the gate for its Retry-After; the round waits behind it.
        assert isinstance(await first_item(limited), ModelWaiting)
        assert len(fake.requests()) == 1
        # Another client of the same key and URL waits too, without a request.
        waiting = await first_item(same)
        assert isinstance(waiting, ModelWaiting) and waiting.reason == "rate_limited"
        assert isinstance(await first_item(named), ModelWaiting)
        assert len(fake.requests()) == 1
        # Another key at the same URL goes at once.
        fake.enqueue("not held")
        chunks, _ = await collect_round(other_key, request())
        assert "".join(chunks) == "not held" and len(fake.requests()) == 2
        # The same key at another URL goes at once (and finds no server there).
        with pytest.raises(ModelError) as failed:
            await collect_round(other_url, request())
        assert failed.value.reason == "connection"
        # The Anthropic client with the same key and URL has a gate of its own: its
        # request goes out (to a path the fake does not serve).
        with pytest.raises(ModelError) as failed:
            await collect_round(claude, request())
        assert failed.value.reason == "bad_request" and "404" in failed.value.message
    finally:
        for model in models:
            await model.aclose()

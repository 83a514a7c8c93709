from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import httpx2
import msgspec
import pytest

from harness.fake_anthropic import FakeAnthropic, PromptCache
from harness.waits import poll
from tests.worker_kit import collect_round
from turnbus.shared.settings import Settings
from turnbus.shared.system import resolve_system, resolve_system_blocks
from turnbus.worker.models.anthropic import (
    AnthropicModel,
    SseSplitter,
    decode_stream_event,
    sdk_client,
    with_prompt_breakpoint,
)
from turnbus.worker.models.base import ModelError, ModelRequest, RoundResult, TextChunk, ToolSpec
from turnbus.worker.models.ratelimit import RateGate
from turnbus.worker.models.transport import AIOHTTP_RESPONSE, body_chunks

TOOLS: list[ToolSpec] = [
    {
        "name": "working_notes_update",
        "description": "Replace the notes. Never write secrets.",
        "input_schema": {
            "type": "object",
            "properties": {"notes": {"type": "string"}},
            "required": ["notes"],
        },
    }
]
SETTINGS = Settings(model_max_retries=2, anthropic_model="claude-test")


async def wait_for(condition: Callable[[], bool], within: float = 5.0) -> None:
    await poll(condition, within=within, interval=0.01)


def _request(messages: list[dict[str, Any]] | None = None, **extra: Any) -> ModelRequest:
    return ModelRequest(
        system_blocks=resolve_system_blocks("Be terse.", "- the build is green", None),
        system=resolve_system("Be terse.", "- the build is green", None),
        messages=messages or [{"role": "user", "content": "hi"}],
        tools=TOOLS,
        **extra,
    )


def _sent_key(headers: dict[str, str]) -> str | None:
    return headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ")


_round = collect_round


@pytest.fixture
async def client(fake: FakeAnthropic) -> AsyncIterator[anthropic.AsyncAnthropic]:
    sdk = fake.client()
    yield sdk
    await sdk.close()


@pytest.fixture
def model(client: anthropic.AsyncAnthropic) -> AnthropicModel:
    return AnthropicModel(
        SETTINGS, client=client, gate=RateGate(), base_delay_s=0.001, max_delay_s=0.01
    )


async def test_text_streams_in_chunks_with_the_request_built_from_the_round(
    fake: FakeAnthropic, model: AnthropicModel
) -> None:
    fake.enqueue_text("The build is green, as noted.", chunk_size=5)
    chunks, result = await _round(model, _request(max_tokens=1234))
    assert len(chunks) == 6
    assert "".join(chunks) == "The build is green, as noted."
    assert result.stop_reason == "end_turn"
    assert result.content == [{"type": "text", "text": "The build is green, as noted."}]
    assert result.tool_uses == []

    (body,) = fake.requests
    assert body["stream"] is True
    assert body["model"] == "claude-test"
    assert body["max_tokens"] == 1234
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["tools"] == TOOLS
    # The system goes as content blocks with their cache breakpoints, text unchanged.
    assert body["system"] == resolve_system_blocks("Be terse.", "- the build is green", None)
    mark = {"type": "ephemeral"}
    assert [b.get("cache_control") for b in body["system"]] == [None, mark, mark]
    assert "".join(b["text"] for b in body["system"]) == _request().system
    assert body["cache_control"] == {"type": "ephemeral"}
    assert _sent_key(fake.headers[0]) == fake.api_key


async def test_text_is_yielded_as_it_arrives_not_at_the_end(
    fake: FakeAnthropic, model: AnthropicModel
) -> None:
    gate = threading.Event()
    fake.enqueue_text("one two three four", chunk_size=4, gate=gate)
    stream = model.stream_round(_request())
    # The first chunk arrives while the server still holds the rest of the answer.
    assert await anext(stream) == TextChunk("one ")
    assert fake.finished_streams == 0
    gate.set()
    rest = [item async for item in stream]
    assert [c.text for c in rest if isinstance(c, TextChunk)] == ["two ", "thre", "e fo", "ur"]
    assert isinstance(rest[-1], RoundResult)
    assert fake.finished_streams == 1


async def test_request_model_and_effort_override_the_defaults(
    fake: FakeAnthropic, model: AnthropicModel
) -> None:
    fake.enqueue_text("ok")
    await _round(model, _request(model="claude-other", reasoning_effort="low"))
    fake.enqueue_text("ok")
    await _round(model, _request(reasoning_effort="bogus"))
    first, second = fake.requests
    assert (first["model"], first["output_config"]) == ("claude-other", {"effort": "low"})
    assert "output_config" not in second


async def test_tool_use_round_trip(fake: FakeAnthropic, model: AnthropicModel) -> None:
    notes = {"notes": "- the build is green\n- ship on Friday ✓"}
    tool_id = fake.enqueue_tool_use(
        "working_notes_update", notes, text="Saving that.", chunk_size=3
    )
    fake.enqueue_text("Saved.")

    chunks, first = await _round(model, _request())
    assert "".join(chunks) == "Saving that."
    assert first.stop_reason == "tool_use"
    assert [(t.id, t.name, t.input) for t in first.tool_uses] == [
        (tool_id, "working_notes_update", notes)
    ]
    assert first.content == [
        {"type": "text", "text": "Saving that."},
        {"type": "tool_use", "id": tool_id, "name": "working_notes_update", "input": notes},
    ]

    history: list[dict[str, Any]] = [
        {"role": "user", "content": "remember it"},
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": tool_id, "content": "updated (40 bytes)"}
            ],
        },
    ]
    _, second = await _round(model, _request(history))
    assert second.stop_reason == "end_turn"
    assert second.content == [{"type": "text", "text": "Saved."}]
    assert fake.requests[1]["messages"] == history


async def test_usage_includes_cache_reads_and_writes(
    fake: FakeAnthropic, model: AnthropicModel
) -> None:
    fake.enqueue_text(
        "ok",
        usage={
            "input_tokens": 12,
            "output_tokens": 34,
            "cache_read_input_tokens": 1500,
            "cache_creation_input_tokens": 200,
        },
    )
    _, result = await _round(model, _request())
    usage = result.usage
    assert (usage.input_tokens, usage.output_tokens) == (12, 34)
    assert (usage.cache_read_tokens, usage.cache_write_tokens) == (1500, 200)


@pytest.mark.parametrize(
    "stop_reason", ["end_turn", "max_tokens", "pause_turn", "refusal", "stop_sequence"]
)
async def test_every_stop_reason_is_surfaced(
    fake: FakeAnthropic, model: AnthropicModel, stop_reason: str
) -> None:
    fake.enqueue_text("partial answer", stop_reason=stop_reason)
    _, result = await _round(model, _request())
    assert result.stop_reason == stop_reason


async def test_a_tool_input_cut_off_by_max_tokens_is_dropped(
    fake: FakeAnthropic, model: AnthropicModel
) -> None:
    fake.enqueue_message(
        [
            {"type": "text", "text": "Saving."},
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "working_notes_update",
                "input": {},
                "partial_json": '{"notes": "- half a no',
            },
        ],
        stop_reason="max_tokens",
    )
    _, result = await _round(model, _request())
    assert result.stop_reason == "max_tokens"
    assert result.content == [{"type": "text", "text": "Saving."}]
    assert result.tool_uses == []


async def test_thinking_blocks_keep_their_signature_for_the_history(
    fake: FakeAnthropic, model: AnthropicModel
) -> None:
    fake.enqueue_message(
        [
            {"type": "thinking", "thinking": "Let me see.", "signature": "sig-123"},
            {"type": "text", "text": "Answer."},
        ]
    )
    chunks, result = await _round(model, _request())
    assert chunks == ["Answer."]
    assert result.content == [
        {"type": "thinking", "thinking": "Let me see.", "signature": "sig-123"},
        {"type": "text", "text": "Answer."},
    ]


async def test_429_then_success_honours_retry_after(
    fake: FakeAnthropic, client: anthropic.AsyncAnthropic, caplog: pytest.LogCaptureFixture
) -> None:
    fake.enqueue_error(429, retry_after=0.1)
    fake.enqueue_error(429, retry_after=3600)  # capped by max_retry_after_s below
    fake.enqueue_text("finally")
    # A base delay this long would time the test out: only retry-after makes it quick.
    model = AnthropicModel(SETTINGS, client=client, base_delay_s=60, max_retry_after_s=0.05)
    with caplog.at_level(logging.WARNING):
        chunks, result = await _round(model, _request())
    assert "".join(chunks) == "finally"
    assert result.stop_reason == "end_turn"
    assert len(fake.requests) == 3
    # The waits are the server's retry-after, capped — never the 60 s base backoff.
    assert caplog.text.count("rate_limited: the key's requests held 0.05s") == 2
    assert fake.api_key not in caplog.text
    assert fake.url not in caplog.text


async def test_529_past_the_wait_bound_is_overloaded(
    fake: FakeAnthropic, client: anthropic.AsyncAnthropic
) -> None:
    for _ in range(200):
        fake.enqueue_error(529, message="Overloaded", retry_after=0.02)
    fake.enqueue_text("never reached")
    # A 529 is waited out (not counted against the retries) until the round's bound.
    settings = dataclasses.replace(SETTINGS, model_wait_s=1.0)
    model = AnthropicModel(settings, client=client, gate=RateGate())
    with pytest.raises(ModelError) as caught:
        await _round(model, _request())
    assert caught.value.reason == "overloaded"
    assert "TURNBUS_MODEL_WAIT_S" in caught.value.message
    assert len(fake.requests) > SETTINGS.model_max_retries + 1
    assert fake.pending > 1


async def test_5xx_is_retried_then_provider_error(
    fake: FakeAnthropic, model: AnthropicModel
) -> None:
    fake.enqueue_error(503)
    fake.enqueue_text("recovered")
    chunks, _ = await _round(model, _request())
    assert "".join(chunks) == "recovered"
    for _ in range(SETTINGS.model_max_retries + 1):
        fake.enqueue_error(500)
    with pytest.raises(ModelError) as caught:
        await _round(model, _request())
    assert caught.value.reason == "provider_error"


@pytest.mark.parametrize(("status", "reason"), [(400, "bad_request"), (401, "auth"), (403, "auth")])
async def test_client_errors_are_not_retried(
    fake: FakeAnthropic, model: AnthropicModel, status: int, reason: str
) -> None:
    fake.enqueue_error(status, message="nope")
    fake.enqueue_text("never reached")
    with pytest.raises(ModelError) as caught:
        await _round(model, _request())
    assert caught.value.reason == reason
    assert len(fake.requests) == 1


async def test_a_failure_after_text_was_yielded_is_not_retried(
    fake: FakeAnthropic, model: AnthropicModel
) -> None:
    # A retry would find the queue empty and fail as bad_request.
    fake.enqueue_stream_error("Half an ans", error_type="overloaded_error")
    chunks: list[str] = []

    async def consume() -> None:
        async for item in model.stream_round(_request()):
            assert isinstance(item, TextChunk)
            chunks.append(item.text)

    with pytest.raises(ModelError) as caught:
        await consume()
    assert caught.value.reason == "overloaded"
    assert "".join(chunks) == "Half an ans"
    assert len(fake.requests) == 1

    fake.enqueue_truncated("Cut sho")
    with pytest.raises(ModelError) as caught:
        await _round(model, _request())
    assert caught.value.reason == "connection"


async def test_a_failure_before_any_text_is_retried(
    fake: FakeAnthropic, model: AnthropicModel
) -> None:
    fake.enqueue_truncated("")
    fake.enqueue_stream_error("", error_type="api_error")  # mid-stream, but no text yielded
    fake.enqueue_text("clean")
    chunks, result = await _round(model, _request())
    assert chunks == ["clean"]
    assert result.content == [{"type": "text", "text": "clean"}]
    assert len(fake.requests) == 3


async def test_connection_refused_is_connection_after_retries() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sdk = sdk_client(api_key="k", base_url=f"http://127.0.0.1:{port}")
    model = AnthropicModel(SETTINGS, client=sdk, base_delay_s=0.001)
    try:
        with pytest.raises(ModelError) as caught:
            await _round(model, _request())
    finally:
        await sdk.close()
    assert caught.value.reason == "connection"


async def test_the_fake_answers_default_text_when_its_queue_is_empty(
    fake: FakeAnthropic, model: AnthropicModel
) -> None:
    fake.default_text = "fallback"
    fake.enqueue_text("queued")
    for expected in ("queued", "fallback", "fallback"):
        chunks, _ = await _round(model, _request())
        assert "".join(chunks) == expected
    fake.reset()
    with pytest.raises(ModelError) as caught:
        await _round(model, _request())
    assert caught.value.reason == "bad_request"


async def test_closing_the_round_mid_stream_closes_the_model_stream(
    fake: FakeAnthropic, model: AnthropicModel
) -> None:
    gate = threading.Event()
    # ~3.5 s of answer after the gate: a server still writing notices a closed connection.
    fake.enqueue_text("a long answer " * 50, chunk_size=4, delay_s=0.02, gate=gate)
    stream = model.stream_round(_request())
    first = await anext(stream)
    assert first == TextChunk("a lo")
    await stream.aclose()  # type: ignore[attr-defined]
    gate.set()
    await wait_for(lambda: fake.aborted_streams == 1)
    assert fake.finished_streams == 0
    fake.enqueue_text("next")
    chunks, _ = await _round(model, _request())
    assert chunks == ["next"]


async def test_key_and_base_url_come_from_the_environment(
    fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", fake.api_key)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", fake.url)
    model = AnthropicModel(SETTINGS)
    fake.enqueue_text("from env")
    try:
        chunks, _ = await _round(model, _request())
    finally:
        await model.aclose()
    assert chunks == ["from env"]
    assert _sent_key(fake.headers[0]) == fake.api_key


async def test_missing_credentials_fail_the_round_as_auth(
    fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in list(os.environ):
        if name.startswith("ANTHROPIC_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ANTHROPIC_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("ANTHROPIC_BASE_URL", fake.url)
    model = AnthropicModel(SETTINGS)  # building the model never fails: the round does
    try:
        with pytest.raises(ModelError) as caught:
            await _round(model, _request())
    finally:
        await model.aclose()
    assert caught.value.reason == "auth"
    assert fake.requests == []


async def test_the_fake_reports_prompt_cache_reads_and_writes_as_the_api_does(
    fake: FakeAnthropic, model: AnthropicModel
) -> None:
    fake.configure(min_cache_tokens=1)
    persona, skills = "Be terse. " * 200, "- skill: summarise\n" * 100

    def request(notes: str, messages: list[dict[str, Any]]) -> ModelRequest:
        return ModelRequest(
            system_blocks=resolve_system_blocks(persona, notes, skills),
            system=resolve_system(persona, notes, skills),
            messages=messages,
            tools=TOOLS,
        )

    first = [{"role": "user", "content": "hi"}]
    usages = []
    for notes, messages in [
        ("- a", first),  # cold: all written
        ("- a", first),  # the same request: all read
        (
            "- a",
            [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}],
        ),
        ("- b", first),  # notes changed: the head (tools, default text, persona) is read
    ]:
        fake.enqueue_text("ok")
        _, result = await _round(model, request(notes, messages))
        u = result.usage
        usages.append((u.input_tokens, u.cache_read_tokens, u.cache_write_tokens))
    (in1, read1, write1), (in2, read2, write2), (in3, read3, write3), (_, read4, write4) = usages
    assert (in1, read1) == (0, 0) and write1 > 0
    assert (in2, read2, write2) == (0, write1, 0)
    # A longer history reads the prefix it shares (found 20 blocks back), writes the rest.
    assert read3 == write1 and write3 > 0 and in3 == 0
    assert 0 < read4 < write1 and write4 > 0


async def test_the_streamed_body_is_read_straight_from_aiohttp(
    fake: FakeAnthropic, client: anthropic.AsyncAnthropic
) -> None:
    fake.enqueue_text("direct")
    response = await client.post(
        "/v1/messages",
        cast_to=httpx2.Response,
        body={"model": "m", "max_tokens": 8, "messages": [], "stream": True},
        stream=True,
    )
    try:
        assert isinstance(response.extensions[AIOHTTP_RESPONSE], aiohttp.ClientResponse)
        body = b"".join([chunk async for chunk in body_chunks(response)])
    finally:
        await response.aclose()
    assert b'"text_delta"' in body and body.rstrip().endswith(b'{"type": "message_stop"}')


async def test_the_round_sends_the_request_the_sdk_builds(
    fake: FakeAnthropic, client: anthropic.AsyncAnthropic
) -> None:
    # The round's POST is built by the SDK once and sent on aiohttp: the API sees the
    # headers the SDK's own post sends (auth, version, client), the body's length aside.
    model = AnthropicModel(SETTINGS, client=client, gate=RateGate())
    for _ in range(2):
        fake.enqueue_text("built once")
        chunks, _ = await _round(model, _request())
        assert "".join(chunks) == "built once"
    fake.enqueue_text("through the SDK")
    response = await client.post(
        "/v1/messages",
        cast_to=httpx2.Response,
        content=msgspec.json.encode(fake.requests[0]),
        stream=True,
    )
    await response.aclose()
    first, second, sdk = (
        {k.lower(): v for k, v in h.items() if k.lower() != "content-length"} for h in fake.headers
    )
    assert first == second == sdk
    assert _sent_key(first) == fake.api_key
    assert fake.requests[0] == fake.requests[2]


async def test_a_client_on_another_transport_goes_through_the_sdks_post(
    fake: FakeAnthropic,
) -> None:
    # The SDK's default httpx client: a request built once could not be sent on it.
    plain = anthropic.AsyncAnthropic(api_key=fake.api_key, base_url=fake.url, max_retries=0)
    model = AnthropicModel(SETTINGS, client=plain, gate=RateGate(), base_delay_s=0.001)
    notes = {"notes": "- plain"}
    fake.enqueue_error(503)
    tool_id = fake.enqueue_tool_use("working_notes_update", notes, text="Saving.", chunk_size=2)
    try:
        chunks, result = await _round(model, _request())
    finally:
        await plain.close()
    assert "".join(chunks) == "Saving."
    assert [(t.id, t.input) for t in result.tool_uses] == [(tool_id, notes)]
    assert len(fake.requests) == 2


def test_the_event_stream_is_split_and_decoded_however_it_is_cut() -> None:
    stream = (
        b": a comment\r\n\r\n"
        b'event: message_start\r\ndata: {"type": "message_start", "message": {"usage": '
        b'{"input_tokens": 3}}}\r\n\r\n'
        b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0,\n'
        b'data: "delta": {"type": "text_delta", "text": "h\xc3\xa9"}}\n\n'
        b'event: ping\ndata: {"type":"ping"}\n\n'
        b'event: content_block_stop\r\n: data: in a comment\r\ndata: {"type": "content_block_stop", '
        b'"index": 0}\r\n\r\n'
        b'event: future_event\ndata: {"type": "future_event", "x": 1}\n\n'
        b'data: {"type": "content_block_delta", "index": 0, "delta": {"type": "new_delta"}}\n\n'
        b'data: {"type": "message_stop"}\r\n\r\n'
    )
    for cut in range(1, len(stream)):
        splitter = SseSplitter()
        datas = splitter.feed(stream[:cut]) + splitter.feed(stream[cut:])
        events = [decode_stream_event(d) for d in datas]
        assert [type(e).__name__ for e in events] == [
            "_MessageStart",
            "_BlockDelta",
            "NoneType",  # a ping: nothing for the round, not decoded
            "NoneType",  # a block's stop: the same
            "NoneType",  # an event type this client does not know is skipped
            "NoneType",  # so is a delta type
            "_MessageStop",
        ], cut
    with pytest.raises(msgspec.DecodeError):  # a known event of the wrong shape: retried
        decode_stream_event(b'{"type": "content_block_delta", "index": "x"}')


async def test_a_round_stays_within_the_apis_four_cache_breakpoints(
    fake: FakeAnthropic, model: AnthropicModel
) -> None:
    # Persona, notes and skills, and a tool round after the prompt: the most
    # breakpoints the engine places (the fold, the last system block, the prompt, the end).
    blocks = resolve_system_blocks("Be terse.", "- the build is green", "* skill: deploy")
    prompt = {"type": "text", "text": "save it"}
    messages = [
        {"role": "user", "content": [prompt]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "x", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}],
        },
    ]
    fake.enqueue_text("ok")
    request = ModelRequest(
        system_blocks=blocks,
        system="".join(b["text"] for b in blocks),
        messages=messages,
        tools=TOOLS,
    )
    _, result = await _round(model, request)
    assert result.stop_reason == "end_turn"
    assert PromptCache.breakpoints(fake.requests[0]) == PromptCache.MAX_BREAKPOINTS
    # The breakpoint is on the turn's prompt, in the request only: the history's rows
    # (the request's messages) are left as they were.
    sent = fake.requests[0]["messages"]
    assert sent[0]["content"] == [{**prompt, "cache_control": {"type": "ephemeral"}}]
    assert "cache_control" not in prompt and sent[1:] == messages[1:]
    # One more is refused, as the API refuses it: a bad request, not retried.
    fake.enqueue_text("never reached")
    extra = list(blocks)
    extra.insert(1, {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}})
    with pytest.raises(ModelError) as caught:
        await _round(model, ModelRequest(extra, request.system, request.messages, TOOLS))
    assert caught.value.reason == "bad_request"


def test_the_prompt_breakpoint_only_once_a_tool_round_follows_it() -> None:
    prompt = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    # Round 1: the prompt is the last block, where the top-level breakpoint goes.
    assert with_prompt_breakpoint([prompt]) == [prompt]
    # A cancelled turn's tool results merged before the next prompt: the text is marked.
    use = {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "a", "name": "x", "input": {}}],
    }
    results = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "a", "content": ""}],
    }
    merged = {"role": "user", "content": [*results["content"], {"type": "text", "text": "go"}]}
    marked = with_prompt_breakpoint([merged, use, results])
    assert marked[0]["content"][-1] == {
        "type": "text",
        "text": "go",
        "cache_control": {"type": "ephemeral"},
    }
    assert marked[0]["content"][0] == results["content"][0] and marked[1:] == [use, results]

"""An OpenAI-compatible model client: Chat Completions, streamed, on the ``openai`` SDK.

One streamed ``POST {base_url}/chat/completions`` per round, to OpenAI or to any server
that speaks the same API (vLLM, Ollama, LiteLLM's proxy, hosted open-weight APIs): the
base URL is ``OPENAI_BASE_URL``, or a named endpoint's (:mod:`turnbus.shared.providers`).
The SDK builds the request once (auth, headers, timeouts) and turns an error status
into its exception; the streamed body is read lean, as the Anthropic client reads its
own: each chunk decoded by one msgspec decoder, no pydantic object per chunk (the SDK's
``AsyncStream`` of ``ChatCompletionChunk`` costs several times as much CPU per chunk;
docs/models.md has the numbers).

The history is translated once per round (:mod:`turnbus.worker.models.translate`);
tool calls are put together from ``delta.tool_calls`` defensively, since servers
differ (:class:`ToolCallAssembler`); usage comes from ``stream_options.include_usage``
with ``prompt_tokens_details.cached_tokens`` counted as cache reads. Errors and limits
follow the Anthropic client's gate and retry rules (:mod:`turnbus.worker.models.attempts`),
on a gate of their own per endpoint and key: 429 and 5xx with ``Retry-After`` honoured,
400 → ``bad_request``, 401/403 → ``auth``, no response → ``connection``; a stream that
ends before its ``finish_reason`` counts as a connection failure and is retried. The
key is never logged.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import msgspec
import openai

from turnbus.shared.contracts import FailureReason
from turnbus.shared.providers import Provider
from turnbus.shared.settings import Settings
from turnbus.worker.models.attempts import (
    AttemptFailed,
    RoundAttempts,
    SdkFailures,
    retry_after_s,
    stream_attempt,
)
from turnbus.worker.models.base import (
    ModelError,
    ModelRequest,
    ModelWaiting,
    RoundResult,
    TextChunk,
    ToolUse,
    UsageCounts,
)
from turnbus.worker.models.ratelimit import RateGate, gate_for
from turnbus.worker.models.translate import to_chat, tools_to_chat
from turnbus.worker.models.transport import AiohttpTransport, Post, post_for

__all__ = [
    "STOP_REASONS",
    "ChatRoundAssembler",
    "OpenAIModel",
    "ToolCallAssembler",
    "decode_chunk",
    "sdk_client",
]

# finish_reason → the engine's stop reasons.
STOP_REASONS = {
    "stop": "end_turn",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "length": "max_tokens",
    "content_filter": "refusal",
}
_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})
# The models that take reasoning_effort, by name: OpenAI's API refuses it for the
# others, and servers of open-weight models differ.
_REASONING_MODELS = re.compile(r"^(o\d|gpt-5|gpt-oss)")


# --- the streamed chunks, as the servers send them ----------------------------------------


class _Function(msgspec.Struct):
    name: str | None = None
    # A string in pieces (the API), or whole, or a JSON object (some servers).
    arguments: str | dict[str, Any] | None = None


class _ToolCallDelta(msgspec.Struct):
    index: int | None = None
    id: str | None = None
    function: _Function | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    tool_calls: list[_ToolCallDelta] | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    finish_reason: str | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _PromptDetails | None = None


class _ErrorBody(msgspec.Struct):
    message: str | None = None
    type: str | None = None
    code: str | int | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: _ErrorBody | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)
_json_decoder = msgspec.json.Decoder()
_body_encoder = msgspec.json.Encoder()


def decode_chunk(data: bytes) -> _Chunk | None:
    """One event's ``data``; None for the ``[DONE]`` sentinel."""
    if data.startswith(b"[DONE]"):
        return None
    return _chunk_decoder.decode(data)


class _Call:
    __slots__ = ("id", "name", "parts", "whole")

    def __init__(self, call_id: str | None) -> None:
        self.id = call_id
        self.name = ""
        self.parts: list[str] = []
        self.whole: dict[str, Any] | None = None


class ToolCallAssembler:
    """Tool calls from ``delta.tool_calls`` pieces, by index; defensive, as servers
    differ: a new ``id`` at an index already in use starts a new call (a server that
    sends every parallel call at index 0); ``arguments`` may come in pieces, whole, or
    as a JSON object; empty or missing arguments are ``{}``."""

    __slots__ = ("_by_index", "calls")

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self._by_index: dict[int, _Call] = {}

    def feed(self, delta: _ToolCallDelta) -> None:
        index = delta.index if delta.index is not None else -1
        call = self._by_index.get(index)
        if call is None or (delta.id is not None and call.id is not None and delta.id != call.id):
            call = self._by_index[index] = _Call(delta.id)
            self.calls.append(call)
        elif call.id is None:
            call.id = delta.id
        function = delta.function
        if function is None:
            return
        if function.name and function.name != call.name:
            call.name = function.name if not call.name else call.name + function.name
        arguments = function.arguments
        if isinstance(arguments, dict):
            call.whole = arguments
        elif arguments:
            call.parts.append(arguments)

    def tool_uses(self, stop_reason: str) -> tuple[list[dict[str, Any]], list[ToolUse]]:
        """The calls as tool_use blocks and ToolUses. Arguments that are not a JSON
        object give a ToolUse with ``input_error`` (the engine answers it with an error
        result naming the problem; the turn goes on); cut off by ``max_tokens``, the
        call is dropped, as the turn ends there anyway."""
        blocks: list[dict[str, Any]] = []
        uses: list[ToolUse] = []
        for call in self.calls:
            call_id = call.id or "call_" + uuid.uuid4().hex[:24]
            error: str | None = None
            tool_input: dict[str, Any] = {}
            if call.whole is not None:
                tool_input = call.whole
            else:
                raw = "".join(call.parts).strip() or "{}"
                try:
                    decoded = _json_decoder.decode(raw)
                except msgspec.DecodeError as exc:
                    if stop_reason == "max_tokens":
                        continue
                    error = f"the arguments are not valid JSON ({exc}): {raw[:200]}"
                else:
                    if isinstance(decoded, dict):
                        tool_input = decoded
                    else:
                        error = f"the arguments are not a JSON object: {raw[:200]}"
            blocks.append(
                {"type": "tool_use", "id": call_id, "name": call.name, "input": tool_input}
            )
            uses.append(ToolUse(call_id, call.name, tool_input, input_error=error))
        return blocks, uses


class ChatRoundAssembler:
    """Folds one response's chunks into a ``RoundResult``."""

    __slots__ = ("calls", "finish_reason", "texts", "usage")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.calls = ToolCallAssembler()
        self.finish_reason: str | None = None
        self.usage = UsageCounts()

    def feed(self, chunk: _Chunk | None) -> str | None:
        """Apply one chunk; return the text it adds to the reply, if any."""
        if chunk is None:
            return None
        if chunk.error is not None:
            raise _chunk_error(chunk.error)
        text: str | None = None
        for choice in chunk.choices or ():
            delta = choice.delta
            if delta is not None:
                if delta.content:
                    text = delta.content if text is None else text + delta.content
                    self.texts.append(delta.content)
                for call in delta.tool_calls or ():
                    self.calls.feed(call)
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        usage = chunk.usage
        if usage is not None:
            cached = 0
            if usage.prompt_tokens_details is not None:
                cached = usage.prompt_tokens_details.cached_tokens or 0
            # As Anthropic counts them: input tokens are those not read from the cache.
            self.usage.input_tokens = max((usage.prompt_tokens or 0) - cached, 0)
            self.usage.cache_read_tokens = cached
            self.usage.output_tokens = usage.completion_tokens or 0
        return text

    def feed_data(self, data: bytes) -> str | None:
        return self.feed(decode_chunk(data))

    def result(self) -> RoundResult:
        if self.finish_reason is None:
            raise AttemptFailed(ModelError("connection", "the stream ended before finish_reason"))
        stop_reason = STOP_REASONS.get(self.finish_reason, "end_turn")
        blocks, uses = self.calls.tool_uses(stop_reason)
        if uses and stop_reason == "end_turn":
            stop_reason = "tool_use"  # servers that say "stop" after calling tools
        content: list[dict[str, Any]] = []
        text = "".join(self.texts)
        if text:
            content.append({"type": "text", "text": text})
        content.extend(blocks)
        return RoundResult(
            stop_reason=stop_reason, content=content, tool_uses=uses, usage=self.usage
        )


# --- errors --------------------------------------------------------------------------------


def _status_error(exc: openai.APIStatusError) -> AttemptFailed:
    status = exc.status_code
    code = getattr(exc, "code", None)
    reason: FailureReason
    if status == 429 and code == "insufficient_quota":
        reason = "bad_request"  # no wait makes it pass
    elif status == 429:
        reason = "rate_limited"
    elif status >= 500:
        reason = "provider_error"
    elif status in (401, 403):
        reason = "auth"
    else:
        reason = "bad_request"
    message = f"HTTP {status}: {exc.message or 'no detail'}"
    return AttemptFailed(ModelError(reason, message), retry_after_s(exc.response.headers))


def _chunk_error(error: _ErrorBody) -> AttemptFailed:
    """An ``error`` object inside a stream that had started fine (vLLM, LiteLLM)."""
    code = str(error.code or error.type or "")
    reason: FailureReason
    if "rate" in code or code == "429":
        reason = "rate_limited"
    elif "invalid" in code or code == "400":
        reason = "bad_request"
    else:
        reason = "provider_error"
    detail = error.message or "no detail"
    return AttemptFailed(ModelError(reason, f"stream error {code or 'unknown'}: {detail}"))


_FAILURES = SdkFailures(
    openai.APIStatusError, openai.APITimeoutError, openai.APIConnectionError, _status_error
)


def sdk_client(**options: Any) -> openai.AsyncOpenAI:
    """The SDK client the worker uses: no SDK retries, on the aiohttp transport;
    ``options`` go to the SDK (``api_key``, ``base_url``; by default it reads
    ``OPENAI_API_KEY`` and ``OPENAI_BASE_URL``)."""
    http = httpx2.AsyncClient(transport=AiohttpTransport(), follow_redirects=True)
    return openai.AsyncOpenAI(max_retries=0, http_client=http, **options)


class OpenAIModel:
    """A :class:`~turnbus.worker.models.base.ModelClient` on Chat Completions."""

    name = "openai"

    def __init__(
        self,
        settings: Settings,
        *,
        provider: Provider | None = None,
        client: openai.AsyncOpenAI | None = None,
        gate: RateGate | None = None,
        base_delay_s: float = 0.5,
        max_delay_s: float = 8.0,
        max_retry_after_s: float = 30.0,
    ) -> None:
        self._settings = settings
        self._provider = provider
        self._default_model = (provider.model if provider else None) or settings.openai_model
        self._client = None if client is None else client.with_options(max_retries=0)
        self._owns_client = client is None
        self._gate = gate
        self._post: Post | None = None
        self._attempts = RoundAttempts(
            settings,
            base_delay_s=base_delay_s,
            max_delay_s=max_delay_s,
            max_retry_after_s=max_retry_after_s,
        )

    async def aclose(self) -> None:
        if self._owns_client and self._client is not None:
            await self._client.close()
            self._client = None
            self._post = None

    def _sdk(self) -> tuple[openai.AsyncOpenAI, RateGate]:
        if self._client is None:
            options: dict[str, Any] = {}
            provider = self._provider
            if provider is not None and provider.api_key is not None:
                options["api_key"] = provider.api_key
            if provider is not None and provider.base_url is not None:
                options["base_url"] = provider.base_url
            try:
                self._client = sdk_client(**options)
            except openai.OpenAIError as exc:
                raise ModelError("auth", f"OpenAI credentials unusable: {exc}") from None
        if self._gate is None:
            client = self._client
            self._gate = gate_for("openai", client.api_key, str(client.base_url))
        return self._client, self._gate

    def params(self, request: ModelRequest) -> dict[str, Any]:
        """The round's request body (before encoding)."""
        model = request.model or self._default_model
        params: dict[str, Any] = {
            "model": model,
            "messages": to_chat(request.system, request.messages),
            "max_completion_tokens": request.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.tools:
            params["tools"] = tools_to_chat(request.tools)
            # Sent explicitly: servers differ in what they assume.
            params["parallel_tool_calls"] = True
        effort = request.reasoning_effort
        if effort in _EFFORTS and _REASONING_MODELS.match(model):
            params["reasoning_effort"] = effort
        return params

    async def stream_round(
        self, request: ModelRequest
    ) -> AsyncIterator[TextChunk | ModelWaiting | RoundResult]:
        body = _body_encoder.encode(self.params(request))
        client, gate = self._sdk()
        post = self._post
        if post is None:
            try:
                post = self._post = await post_for(
                    client, "/chat/completions", security={"bearer_auth": True}
                )
            except (openai.OpenAIError, TypeError) as exc:
                raise ModelError("auth", f"OpenAI credentials unusable: {exc}") from None
        try:
            async for item in self._attempts.stream(
                gate,
                lambda admitted: stream_attempt(
                    post, body, admitted, ChatRoundAssembler(), _FAILURES
                ),
            ):
                yield item
        except ModelError as exc:
            key = client.api_key
            if key and key in exc.message:  # a server that echoes the key in its error
                raise ModelError(exc.reason, exc.message.replace(key, "[key]")) from None
            raise

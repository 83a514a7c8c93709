"""The Anthropic Messages API client, on the official ``anthropic`` SDK.

One streamed ``POST /v1/messages`` per round. The SDK sends the request (auth, base
URL, headers, timeouts) and turns an error status into its exception; the streamed
body is read raw (``messages.with_streaming_response``) and each server-sent event is
decoded by one module-level msgspec decoder into a tagged union, so no pydantic object
is built per event (the SDK's own stream cost ~10 times the rest of a worker's turn).

The system prompt goes as content blocks with their ``cache_control`` breakpoints
(prompt caching); text deltas are yielded as they arrive; tool_use inputs are assembled
from ``input_json_delta`` fragments; the round's ``stop_reason`` is returned as-is for
the turn engine to act on.

Retries are ours, not the SDK's (it is built with ``max_retries=0``). A 429 or 529 (or
an ``error`` event saying the same before any text) closes the key's rate-limit gate
(:mod:`turnbus.worker.models.ratelimit`) for every turn of the process, and the round waits for
it, up to ``settings.model_wait_s``. Other 5xx and connection failures are retried with
exponential backoff and full jitter, up to ``settings.model_max_retries`` times. Either
only while nothing of the round was yielded yet, so a retry never duplicates text. The
API key and base URL come from ``ANTHROPIC_API_KEY`` / ``ANTHROPIC_BASE_URL`` (the SDK
reads them) and are never logged.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx2
import msgspec

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
from turnbus.worker.models.transport import AiohttpTransport, Post, SseSplitter, post_for

__all__ = [
    "AnthropicModel",
    "SseSplitter",
    "decode_stream_event",
    "sdk_client",
    "with_prompt_breakpoint",
]

log = logging.getLogger(__name__)

_EFFORTS = frozenset({"low", "medium", "high", "xhigh", "max"})
# Error types the API puts in an SSE ``error`` event (the HTTP status there is 200).
_STREAM_ERROR_REASONS: dict[str, FailureReason] = {
    "overloaded_error": "overloaded",
    "rate_limit_error": "rate_limited",
    "api_error": "provider_error",
    "timeout_error": "provider_error",
    "invalid_request_error": "bad_request",
    "authentication_error": "auth",
    "permission_error": "auth",
}
_LIMITS = frozenset({"rate_limited", "overloaded"})
_RETRYABLE = frozenset({"provider_error", "connection"})


# --- the streamed events, as the API sends them -----------------------------------------


class _Usage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None


class _MessageHead(msgspec.Struct):
    usage: _Usage | None = None


class _Delta(msgspec.Struct, tag_field="type"):
    pass


class _TextDelta(_Delta, tag="text_delta"):
    text: str


class _JsonDelta(_Delta, tag="input_json_delta"):
    partial_json: str


class _ThinkingDelta(_Delta, tag="thinking_delta"):
    thinking: str


class _SignatureDelta(_Delta, tag="signature_delta"):
    signature: str


class _CitationsDelta(_Delta, tag="citations_delta"):
    citation: dict[str, Any]


class _StopInfo(msgspec.Struct):
    stop_reason: str | None = None


class _ErrorBody(msgspec.Struct):
    type: str = "api_error"
    message: str = ""


class _Event(msgspec.Struct, tag_field="type"):
    pass


class _MessageStart(_Event, tag="message_start"):
    message: _MessageHead


class _BlockStart(_Event, tag="content_block_start"):
    index: int
    content_block: dict[str, Any]


class _BlockDelta(_Event, tag="content_block_delta"):
    index: int
    delta: _TextDelta | _JsonDelta | _ThinkingDelta | _SignatureDelta | _CitationsDelta


class _BlockStop(_Event, tag="content_block_stop"):
    index: int = 0


class _MessageDelta(_Event, tag="message_delta"):
    delta: _StopInfo
    usage: _Usage | None = None


class _MessageStop(_Event, tag="message_stop"):
    pass


class _Ping(_Event, tag="ping"):
    pass


class _StreamError(_Event, tag="error"):
    error: _ErrorBody


_StreamEvent = (
    _MessageStart
    | _BlockStart
    | _BlockDelta
    | _BlockStop
    | _MessageDelta
    | _MessageStop
    | _Ping
    | _StreamError
)
_KNOWN_DELTAS = frozenset(
    {"text_delta", "input_json_delta", "thinking_delta", "signature_delta", "citations_delta"}
)


class _LooseDelta(msgspec.Struct):
    type: str = ""


class _Loose(msgspec.Struct):
    type: str = ""
    delta: _LooseDelta | None = None


_event_decoder = msgspec.json.Decoder(_StreamEvent)
_loose_decoder = msgspec.json.Decoder(_Loose)
_json_decoder = msgspec.json.Decoder()
_body_encoder = msgspec.json.Encoder()


def with_prompt_breakpoint(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with a cache breakpoint on the turn's prompt (the last user message
    that is not only tool results) when a tool round follows it; else as they are.

    The next turn resends this turn's rounds as the history stores them, which is not
    always as they were sent: a ``working_notes_update`` input and the notes a
    ``working_notes_get`` returned are stored as their digest, thinking blocks are
    dropped. The prefix that ends at the prompt is the longest the next turn can then
    read, and without this breakpoint no request of the turn would have cached it once
    the notes change (the system before it changed in the same turn). The messages and
    their blocks are the history's rows: copied, never changed."""
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        content = message.get("content")
        if message.get("role") != "user":
            continue
        if isinstance(content, str):
            return messages  # a string prompt (not the engine's): left as it was sent
        if not isinstance(content, list) or not any(
            isinstance(b, dict) and b.get("type") != "tool_result" for b in content
        ):
            continue  # tool results: a round of this turn
        if i == len(messages) - 1 or not isinstance(content[-1], dict):
            return messages  # round 1: the top-level breakpoint is on the prompt already
        blocks = [*content[:-1], {**content[-1], "cache_control": {"type": "ephemeral"}}]
        return [*messages[:i], {**message, "content": blocks}, *messages[i + 1 :]]
    return messages


# Events the round needs nothing from, known by their first bytes (the API writes
# ``type`` first, with or without a space): not decoded at all.
_SKIPPED = (
    b'{"type": "ping"',
    b'{"type":"ping"',
    b'{"type": "content_block_stop"',
    b'{"type":"content_block_stop"',
)


def decode_stream_event(data: bytes) -> _StreamEvent | None:
    """One event's ``data``, decoded; None for an event the round needs nothing from
    (``ping``, ``content_block_stop``) and for an event or delta type this client does
    not know (the API adds new ones; they must not fail a round)."""
    if data.startswith(_SKIPPED):
        return None
    try:
        return _event_decoder.decode(data)
    except msgspec.ValidationError:
        try:
            loose = _loose_decoder.decode(data)
        except msgspec.DecodeError:
            loose = _Loose()
        delta = loose.delta
        unknown_delta = (
            loose.type == "content_block_delta"
            and isinstance(delta, _LooseDelta)
            and delta.type not in _KNOWN_DELTAS
        )
        if unknown_delta or loose.type not in _KNOWN_EVENTS:
            return None
        raise
    # A msgspec.DecodeError (not JSON) propagates: the caller retries the round.


_KNOWN_EVENTS = frozenset(
    {
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
        "ping",
        "error",
    }
)


# --- errors ------------------------------------------------------------------------------


def _status_error(exc: anthropic.APIStatusError) -> AttemptFailed:
    status = exc.status_code
    detail = exc.api_message or exc.type or "no detail"
    kind = exc.type or ""
    reason: FailureReason
    if status == 429:
        reason = "rate_limited"
    elif status == 529:
        reason = "overloaded"
    elif status >= 500:
        reason = "provider_error"
    elif status in (401, 403):
        reason = "auth"
    else:
        reason = "bad_request"
    message = f"HTTP {status} {kind}: {detail}"
    return AttemptFailed(ModelError(reason, message), retry_after_s(exc.response.headers))


def _stream_error(error: _ErrorBody) -> AttemptFailed:
    """An ``error`` event inside a stream that had started fine."""
    reason = _STREAM_ERROR_REASONS.get(error.type, "provider_error")
    detail = error.message or "no detail"
    return AttemptFailed(ModelError(reason, f"stream {error.type}: {detail}"))


def _usage_of(usage: _Usage | None, into: UsageCounts) -> None:
    """Copy the (cumulative) counts present on a usage object into ``into``."""
    if usage is None:
        return
    if usage.input_tokens is not None:
        into.input_tokens = usage.input_tokens
    if usage.output_tokens is not None:
        into.output_tokens = usage.output_tokens
    if usage.cache_read_input_tokens is not None:
        into.cache_read_tokens = usage.cache_read_input_tokens
    if usage.cache_creation_input_tokens is not None:
        into.cache_write_tokens = usage.cache_creation_input_tokens


class _RoundAssembler:
    """Folds the decoded stream events of one message into a ``RoundResult``."""

    __slots__ = ("blocks", "parts", "stop_reason", "stopped", "usage")

    def __init__(self) -> None:
        self.blocks: dict[int, dict[str, Any]] = {}
        # Per block, per field (text, partial_json, thinking, signature): the pieces.
        self.parts: dict[int, dict[str, list[str]]] = {}
        self.usage = UsageCounts()
        self.stop_reason: str | None = None
        self.stopped = False

    def _append(self, index: int, name: str, piece: str) -> None:
        fields = self.parts.get(index)
        if fields is None:
            fields = self.parts[index] = {}
        pieces = fields.get(name)
        if pieces is None:
            fields[name] = [piece]
        else:
            pieces.append(piece)

    def feed(self, event: _StreamEvent | None) -> str | None:
        """Apply one event; return the text it adds to the reply, if any."""
        match event:
            case _BlockDelta(index=index, delta=delta):
                if index not in self.blocks:
                    return None
                match delta:
                    case _TextDelta(text=text):
                        self._append(index, "text", text)
                        return text
                    case _JsonDelta(partial_json=partial):
                        self._append(index, "partial_json", partial)
                    case _ThinkingDelta(thinking=thinking):
                        self._append(index, "thinking", thinking)
                    case _SignatureDelta(signature=signature):
                        self._append(index, "signature", signature)
                    case _CitationsDelta(citation=citation):
                        cited = {k: v for k, v in citation.items() if v is not None}
                        self.blocks[index].setdefault("citations", []).append(cited)
            case _BlockStart(index=index, content_block=block):
                block = {k: v for k, v in block.items() if v is not None}
                if block.get("type") in ("tool_use", "server_tool_use"):
                    self._append(index, "partial_json", "")
                self.blocks[index] = block
            case _MessageStart(message=message):
                _usage_of(message.usage, self.usage)
            case _MessageDelta(delta=delta, usage=usage):
                if delta.stop_reason is not None:
                    self.stop_reason = delta.stop_reason
                _usage_of(usage, self.usage)
            case _MessageStop():
                self.stopped = True
            case _StreamError(error=error):
                raise _stream_error(error)
        return None

    def feed_data(self, data: bytes) -> str | None:
        return self.feed(decode_stream_event(data))

    def result(self) -> RoundResult:
        if not self.stopped:
            raise AttemptFailed(ModelError("connection", "the stream ended before message_stop"))
        stop_reason = self.stop_reason or "end_turn"
        content: list[dict[str, Any]] = []
        tool_uses: list[ToolUse] = []
        for index in sorted(self.blocks):
            block = self.blocks[index]
            fields = self.parts.get(index, {})
            for name in ("text", "thinking", "signature"):
                if name in fields:
                    block[name] = str(block.get(name) or "") + "".join(fields[name])
            if "partial_json" in fields:
                raw = "".join(fields["partial_json"]).strip() or "{}"
                try:
                    block["input"] = _json_decoder.decode(raw)
                except msgspec.DecodeError:
                    if stop_reason == "max_tokens":
                        continue  # cut off mid-input: the engine ends the turn anyway
                    raise AttemptFailed(
                        ModelError(
                            "provider_error", f"unparsable input for tool {block.get('name')}"
                        )
                    ) from None
            if block.get("type") == "text" and not block.get("text"):
                continue  # the API refuses empty text blocks in a later request
            content.append(block)
            if block.get("type") == "tool_use":
                tool_input = block.get("input")
                tool_uses.append(
                    ToolUse(
                        id=str(block["id"]),
                        name=str(block["name"]),
                        input=tool_input if isinstance(tool_input, dict) else {},
                    )
                )
        return RoundResult(
            stop_reason=stop_reason, content=content, tool_uses=tool_uses, usage=self.usage
        )


_FAILURES = SdkFailures(
    anthropic.APIStatusError, anthropic.APITimeoutError, anthropic.APIConnectionError, _status_error
)


def sdk_client(**options: Any) -> anthropic.AsyncAnthropic:
    """The SDK client the worker uses: no SDK retries (ours are the only ones), on the
    aiohttp transport (:mod:`turnbus.worker.models.transport`); ``options`` go to the SDK
    (``api_key``, ``base_url``; by default it reads ``ANTHROPIC_API_KEY`` and
    ``ANTHROPIC_BASE_URL``)."""
    http = httpx2.AsyncClient(transport=AiohttpTransport(), follow_redirects=True)
    return anthropic.AsyncAnthropic(max_retries=0, http_client=http, **options)


class AnthropicModel:
    """A :class:`~turnbus.worker.models.base.ModelClient` on the Anthropic Messages API."""

    name = "anthropic"

    def __init__(
        self,
        settings: Settings,
        *,
        client: anthropic.AsyncAnthropic | None = None,
        gate: RateGate | None = None,
        base_delay_s: float = 0.5,
        max_delay_s: float = 8.0,
        max_retry_after_s: float = 30.0,
        provider: Provider | None = None,
    ) -> None:
        self._settings = settings
        # A named endpoint's key and base URL; without one the SDK reads its environment.
        self._options: dict[str, Any] = {}
        if provider is not None and provider.api_key is not None:
            self._options["api_key"] = provider.api_key
        if provider is not None and provider.base_url is not None:
            self._options["base_url"] = provider.base_url
        self._default_model = (provider.model if provider else None) or settings.anthropic_model
        # The SDK's own retries are off so ours are the only ones (and testable). Our own
        # client is built at the first round, so missing credentials fail that turn with
        # ``auth`` rather than the worker at start.
        self._client = None if client is None else client.with_options(max_retries=0)
        self._owns_client = client is None
        # Without one given, the process's gate of the client's key (made with the client).
        self._gate = gate
        self._post: Post | None = None  # the round's POST, built at the first round
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

    def _sdk(self) -> tuple[anthropic.AsyncAnthropic, RateGate]:
        if self._client is None:
            try:
                client = sdk_client(**self._options)
            except anthropic.AnthropicError as exc:
                raise ModelError("auth", f"Anthropic credentials unusable: {exc}") from None
            if client.api_key is None and client.auth_token is None and client.credentials is None:
                raise ModelError("auth", "no Anthropic credentials: set ANTHROPIC_API_KEY")
            self._client = client
        if self._gate is None:
            client = self._client
            self._gate = gate_for(
                "anthropic", client.api_key or client.auth_token, str(client.base_url)
            )
        return self._client, self._gate

    def _params(self, request: ModelRequest) -> dict[str, Any]:
        params: dict[str, Any] = {
            "model": request.model or self._default_model,
            "max_tokens": request.max_tokens,
            "system": request.system_blocks,
            "messages": with_prompt_breakpoint(request.messages),
            # A breakpoint on the last cacheable block too (the API places it), so the
            # history a tool loop resends every round is read from the cache.
            "cache_control": {"type": "ephemeral"},
            "stream": True,
        }
        if request.tools:
            params["tools"] = request.tools
        if request.reasoning_effort in _EFFORTS:
            params["output_config"] = {"effort": request.reasoning_effort}
        return params

    async def stream_round(
        self, request: ModelRequest
    ) -> AsyncIterator[TextChunk | ModelWaiting | RoundResult]:
        body = _body_encoder.encode(self._params(request))
        client, gate = self._sdk()
        post = self._post
        if post is None:
            try:
                post = self._post = await post_for(client, "/v1/messages")
            except anthropic.AnthropicError as exc:  # e.g. no auth header to be had
                raise ModelError("auth", f"Anthropic credentials unusable: {exc}") from None
        async for item in self._attempts.stream(
            gate,
            lambda admitted: stream_attempt(post, body, admitted, _RoundAssembler(), _FAILURES),
        ):
            yield item

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

import asyncio
import email.utils
import logging
import random
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import anthropic
import httpx2
import msgspec

from turnbus.shared.settings import Settings
from turnbus.worker.models.base import (
    ModelError,
    ModelRequest,
    ModelWaiting,
    RoundResult,
    TextChunk,
    ToolUse,
    UsageCounts,
)
from turnbus.worker.models.ratelimit import GateTimeout, RateGate, gate_for
from turnbus.worker.models.transport import AiohttpTransport, Post, post_for

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
_STREAM_ERROR_REASONS = {
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


class SseSplitter:
    """The ``data`` of each server-sent event in a byte stream cut anywhere.

    Narrower than a browser's parser (the worker needs only the data: the API repeats
    the event's name as the JSON's ``type``): lines end in LF, CRLF or CR, a blank line
    ends an event, ``data`` lines join with LF, other fields and comments are ignored."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\r" in buffer:
            # A CR at the very end may be the first half of a CRLF: kept as it is.
            keep = b"\r" if buffer.endswith(b"\r") else b""
            body = buffer[: len(buffer) - len(keep)]
            buffer = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + keep
        *events, self._buffer = buffer.split(b"\n\n")
        out: list[bytes] = []
        for event in events:
            start = event.find(b"data:")
            if start < 0:
                continue  # a comment, or an event without data: nothing to dispatch
            if (start == 0 or event[start - 1] == 10) and event.find(b"\n", start) < 0:
                # The API's shape: one data line, the event's last: sliced, not split.
                out.append(
                    event[start + 6 :]
                    if event[start + 5 : start + 6] == b" "
                    else event[start + 5 :]
                )
                continue
            data = [
                line[6:] if line[5:6] == b" " else line[5:]
                for line in event.split(b"\n")
                if line.startswith(b"data:")
            ]
            if data:
                out.append(data[0] if len(data) == 1 else b"\n".join(data))
        return out


# --- errors ------------------------------------------------------------------------------


class _Retry(Exception):
    """A failed attempt: the error to raise if it is the last, and the server's wait hint."""

    def __init__(self, error: ModelError, retry_after_s: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.retry_after_s = retry_after_s


def _retry_after_s(headers: Mapping[str, str]) -> float | None:
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        try:
            return max(float(raw_ms) / 1000, 0.0)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        return max(float(raw), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def _status_error(exc: anthropic.APIStatusError) -> _Retry:
    status = exc.status_code
    detail = exc.api_message or exc.type or "no detail"
    kind = exc.type or ""
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
    return _Retry(ModelError(reason, message), _retry_after_s(exc.response.headers))


def _stream_error(error: _ErrorBody) -> _Retry:
    """An ``error`` event inside a stream that had started fine."""
    reason = _STREAM_ERROR_REASONS.get(error.type, "provider_error")
    detail = error.message or "no detail"
    return _Retry(ModelError(reason, f"stream {error.type}: {detail}"))


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

    def result(self) -> RoundResult:
        if not self.stopped:
            raise _Retry(ModelError("connection", "the stream ended before message_stop"))
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
                    raise _Retry(
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
    ) -> None:
        self._settings = settings
        # The SDK's own retries are off so ours are the only ones (and testable). Our own
        # client is built at the first round, so missing credentials fail that turn with
        # ``auth`` rather than the worker at start.
        self._client = None if client is None else client.with_options(max_retries=0)
        self._owns_client = client is None
        # Without one given, the process's gate of the client's key (made with the client).
        self._gate = gate
        self._post: Post | None = None  # the round's POST, built at the first round
        self._base_delay_s = base_delay_s
        self._max_delay_s = max_delay_s
        self._max_retry_after_s = max_retry_after_s

    async def aclose(self) -> None:
        if self._owns_client and self._client is not None:
            await self._client.close()
            self._client = None
            self._post = None

    def _sdk(self) -> tuple[anthropic.AsyncAnthropic, RateGate]:
        if self._client is None:
            try:
                client = sdk_client()
            except anthropic.AnthropicError as exc:
                raise ModelError("auth", f"Anthropic credentials unusable: {exc}") from None
            if client.api_key is None and client.auth_token is None and client.credentials is None:
                raise ModelError("auth", "no Anthropic credentials: set ANTHROPIC_API_KEY")
            self._client = client
        if self._gate is None:
            client = self._client
            self._gate = gate_for(client.api_key or client.auth_token, str(client.base_url))
        return self._client, self._gate

    def _params(self, request: ModelRequest) -> dict[str, Any]:
        params: dict[str, Any] = {
            "model": request.model or self._settings.anthropic_model,
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

    def _backoff_s(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(base · 2^attempt, max)]."""
        return random.uniform(0, min(self._base_delay_s * 2**attempt, self._max_delay_s))

    def _limit_wait_s(self, gate: RateGate, retry_after_s: float | None) -> float:
        """How long a 429/529 closes the gate: the server's word (capped), else a shared
        backoff that doubles with the limits in a row (half of it jittered)."""
        if retry_after_s is not None:
            return min(retry_after_s, self._max_retry_after_s)
        ceiling = min(self._base_delay_s * 2**gate.streak, self._max_delay_s)
        return random.uniform(ceiling / 2, ceiling)

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
        deadline = time.monotonic() + self._settings.model_wait_s
        failures = 0  # failures other than a rate limit, retried by count
        while True:
            announced = False
            while (probe := gate.try_admit()) is None:
                # Behind a limit, followers are told why nothing streams; behind the
                # first request of a fresh process (a probe, no limit seen) they are not.
                if not announced and gate.limiting():
                    announced = True
                    yield ModelWaiting(gate.reason, round(gate.closed_for_s(), 3))
                try:
                    await gate.wait(deadline)
                except GateTimeout as exc:
                    raise ModelError(
                        exc.reason,
                        f"the model's key stayed {exc.reason.replace('_', ' ')} for "
                        f"{self._settings.model_wait_s:g} s (TURNBUS_MODEL_WAIT_S)",
                    ) from None
            emitted = False
            try:
                assembler = _RoundAssembler()
                splitter = SseSplitter()
                # The SDK's request (auth, base URL, headers, timeouts, error statuses
                # as its exceptions), built once; the body encoded by msgspec; the
                # streamed response handed over unread.
                response = await post.send(body)
                try:
                    gate.passed(response.headers, probe, self._max_retry_after_s)
                    probe = False
                    async for chunk in response.chunks():
                        for data in splitter.feed(chunk):
                            text = assembler.feed(decode_stream_event(data))
                            if text:
                                emitted = True
                                yield TextChunk(text)
                finally:
                    await response.aclose()
                result = assembler.result()
            except _Retry as failed:
                retry = failed
            except anthropic.APIStatusError as exc:
                retry = _status_error(exc)
            except anthropic.APITimeoutError:
                retry = _Retry(ModelError("connection", "the request timed out"))
            except anthropic.APIConnectionError as exc:
                retry = _Retry(ModelError("connection", exc.message))
            except (httpx2.TransportError, aiohttp.ClientError) as exc:
                retry = _Retry(ModelError("connection", f"{type(exc).__name__} mid-stream"))
            except TimeoutError:
                retry = _Retry(ModelError("connection", "the stream timed out"))
            except msgspec.DecodeError as exc:
                retry = _Retry(ModelError("provider_error", f"an undecodable stream event: {exc}"))
            else:
                yield result
                return
            finally:
                if probe:  # no verdict on the limit (another error, a cancel): the next may try
                    gate.released(True)
                    probe = False
            error = retry.error
            if emitted:
                raise error
            if error.reason in _LIMITS:
                wait_s = self._limit_wait_s(gate, retry.retry_after_s)
                gate.limited(wait_s, error.reason, probe)
                log.warning("model round %s: the key's requests held %.2fs", error.reason, wait_s)
                continue
            if error.reason not in _RETRYABLE or failures >= self._settings.model_max_retries:
                raise error
            delay = self._backoff_s(failures)
            failures += 1
            log.warning(
                "model round failed (%s), retry %d/%d in %.2fs",
                error.reason,
                failures,
                self._settings.model_max_retries,
                delay,
            )
            await asyncio.sleep(delay)

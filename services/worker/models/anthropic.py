"""The Anthropic Messages API client, on the official ``anthropic`` SDK.

One streamed ``POST /v1/messages`` per round. The system prompt goes as content blocks
with their ``cache_control`` breakpoints (prompt caching); text deltas are yielded as
they arrive; tool_use inputs are assembled from ``input_json_delta`` fragments; the
round's ``stop_reason`` is returned as-is for the turn engine to act on.

Retries are ours, not the SDK's (it is built with ``max_retries=0``): 429, 529, other
5xx and connection failures are retried with exponential backoff and full jitter,
honouring ``retry-after`` (capped), up to ``settings.model_max_retries`` times, and only
while nothing of the round was yielded yet, so a retry never duplicates text. The API
key and base URL come from ``ANTHROPIC_API_KEY`` / ``ANTHROPIC_BASE_URL`` (the SDK reads
them) and are never logged.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx2

from shared.settings import Settings
from worker.models.base import (
    ModelError,
    ModelRequest,
    RoundResult,
    TextChunk,
    ToolUse,
    UsageCounts,
)

__all__ = ["AnthropicModel"]

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
_RETRYABLE = frozenset({"rate_limited", "overloaded", "provider_error", "connection"})


class _Retry(Exception):
    """A failed attempt: the error to raise if it is the last, and the server's wait hint."""

    def __init__(self, error: ModelError, retry_after_s: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.retry_after_s = retry_after_s


def _retry_after_s(headers: httpx2.Headers) -> float | None:
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
    elif status == 200 and kind:
        # An ``error`` event inside a stream that had started fine.
        reason = _STREAM_ERROR_REASONS.get(kind, "provider_error")
    else:
        reason = "bad_request"
    message = f"HTTP {status} {kind}: {detail}" if status != 200 else f"stream {kind}: {detail}"
    return _Retry(ModelError(reason, message), _retry_after_s(exc.response.headers))


def _usage_of(usage: Any, into: UsageCounts) -> None:
    """Copy the (cumulative) counts present on a usage object into ``into``."""
    if usage is None:
        return
    for source, target in (
        ("input_tokens", "input_tokens"),
        ("output_tokens", "output_tokens"),
        ("cache_read_input_tokens", "cache_read_tokens"),
        ("cache_creation_input_tokens", "cache_write_tokens"),
    ):
        value = getattr(usage, source, None)
        if isinstance(value, int):
            setattr(into, target, value)


class _RoundAssembler:
    """Folds the raw stream events of one message into a ``RoundResult``."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[str, Any]] = {}
        self.json_parts: dict[int, list[str]] = {}
        self.usage = UsageCounts()
        self.stop_reason: str | None = None
        self.stopped = False

    def feed(self, event: Any) -> str | None:
        """Apply one event; return the text it adds to the reply, if any."""
        kind = event.type
        if kind == "message_start":
            _usage_of(event.message.usage, self.usage)
        elif kind == "content_block_start":
            block = event.content_block.to_dict(mode="json", exclude_none=True)
            if block.get("type") in ("tool_use", "server_tool_use"):
                self.json_parts[event.index] = []
            self.blocks[event.index] = block
        elif kind == "content_block_delta":
            block = self.blocks.get(event.index)
            if block is None:
                return None
            delta = event.delta
            if delta.type == "text_delta":
                block["text"] = block.get("text", "") + delta.text
                return str(delta.text)
            if delta.type == "input_json_delta":
                self.json_parts.setdefault(event.index, []).append(delta.partial_json)
            elif delta.type == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta.thinking
            elif delta.type == "signature_delta":
                block["signature"] = block.get("signature", "") + delta.signature
            elif delta.type == "citations_delta":
                block.setdefault("citations", []).append(
                    delta.citation.to_dict(mode="json", exclude_none=True)
                )
        elif kind == "message_delta":
            if event.delta.stop_reason is not None:
                self.stop_reason = event.delta.stop_reason
            _usage_of(event.usage, self.usage)
        elif kind == "message_stop":
            self.stopped = True
        return None

    def result(self) -> RoundResult:
        if not self.stopped:
            raise _Retry(ModelError("connection", "the stream ended before message_stop"))
        stop_reason = self.stop_reason or "end_turn"
        content: list[dict[str, Any]] = []
        tool_uses: list[ToolUse] = []
        for index in sorted(self.blocks):
            block = self.blocks[index]
            if index in self.json_parts:
                raw = "".join(self.json_parts[index]).strip() or "{}"
                try:
                    block["input"] = json.loads(raw)
                except ValueError:
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


class AnthropicModel:
    """A :class:`~worker.models.base.ModelClient` on the Anthropic Messages API."""

    name = "anthropic"

    def __init__(
        self,
        settings: Settings,
        *,
        client: anthropic.AsyncAnthropic | None = None,
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
        self._base_delay_s = base_delay_s
        self._max_delay_s = max_delay_s
        self._max_retry_after_s = max_retry_after_s

    async def aclose(self) -> None:
        if self._owns_client and self._client is not None:
            await self._client.close()
            self._client = None

    def _sdk(self) -> anthropic.AsyncAnthropic:
        if self._client is None:
            try:
                client = anthropic.AsyncAnthropic(max_retries=0)
            except anthropic.AnthropicError as exc:
                raise ModelError("auth", f"Anthropic credentials unusable: {exc}") from None
            if client.api_key is None and client.auth_token is None and client.credentials is None:
                raise ModelError("auth", "no Anthropic credentials: set ANTHROPIC_API_KEY")
            self._client = client
        return self._client

    def _params(self, request: ModelRequest) -> dict[str, Any]:
        params: dict[str, Any] = {
            "model": request.model or self._settings.anthropic_model,
            "max_tokens": request.max_tokens,
            "system": request.system_blocks,
            "messages": request.messages,
            # A breakpoint on the last cacheable block too (the API places it), so the
            # history a tool loop resends every round is read from the cache.
            "cache_control": {"type": "ephemeral"},
        }
        if request.tools:
            params["tools"] = request.tools
        if request.reasoning_effort in _EFFORTS:
            params["output_config"] = {"effort": request.reasoning_effort}
        return params

    def _delay_s(self, attempt: int, retry_after_s: float | None) -> float:
        if retry_after_s is not None:
            return min(retry_after_s, self._max_retry_after_s)
        ceiling = min(self._base_delay_s * 2**attempt, self._max_delay_s)
        return random.uniform(0, ceiling)

    async def stream_round(self, request: ModelRequest) -> AsyncIterator[TextChunk | RoundResult]:
        params = self._params(request)
        client = self._sdk()
        attempt = 0
        while True:
            emitted = False
            try:
                assembler = _RoundAssembler()
                stream = await client.messages.create(**params, stream=True)
                async with stream:
                    async for event in stream:
                        text = assembler.feed(event)
                        if text:
                            emitted = True
                            yield TextChunk(text)
                result = assembler.result()
            except _Retry as failed:
                retry = failed
            except anthropic.APIStatusError as exc:
                retry = _status_error(exc)
            except anthropic.APITimeoutError:
                retry = _Retry(ModelError("connection", "the request timed out"))
            except anthropic.APIConnectionError as exc:
                retry = _Retry(ModelError("connection", exc.message))
            except httpx2.TransportError as exc:
                retry = _Retry(ModelError("connection", f"{type(exc).__name__} mid-stream"))
            except anthropic.APIResponseValidationError as exc:
                raise ModelError("provider_error", exc.message) from exc
            else:
                yield result
                return
            error = retry.error
            if (
                emitted
                or error.reason not in _RETRYABLE
                or attempt >= self._settings.model_max_retries
            ):
                raise error
            delay = self._delay_s(attempt, retry.retry_after_s)
            attempt += 1
            log.warning(
                "model round failed (%s), retry %d/%d in %.2fs",
                error.reason,
                attempt,
                self._settings.model_max_retries,
                delay,
            )
            await asyncio.sleep(delay)

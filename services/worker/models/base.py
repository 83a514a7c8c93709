"""The contract between the turn engine and a model: one streamed round at a time.

A round takes the system prompt (as Anthropic content blocks and as the joined
string), the model-facing history in Anthropic's message format and the tool
specs, and yields text chunks as they arrive (and ``ModelWaiting`` when a rate limit
holds the round before it starts), then exactly one ``RoundResult``.
Cancelling the consuming task (or closing the iterator) closes the model stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol, TypedDict

from turnbus.shared.contracts import FailureReason
from turnbus.shared.system import SystemBlock

__all__ = [
    "ModelClient",
    "ModelError",
    "ModelRequest",
    "ModelWaiting",
    "RoundResult",
    "TextChunk",
    "ToolSpec",
    "ToolUse",
    "UsageCounts",
]


class ToolSpec(TypedDict):
    name: str
    description: str
    input_schema: dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class ModelRequest:
    system_blocks: list[SystemBlock]
    system: str  # the same prompt joined; equals "".join(b["text"] for b in system_blocks)
    messages: list[dict[str, Any]]  # Anthropic Messages format: {"role", "content"}
    tools: list[ToolSpec]
    model: str | None = None  # meta.selectedModel, else the client's default
    max_tokens: int = 4096
    reasoning_effort: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class TextChunk:
    text: str


# Why a model's key is held back: the API said so (429) or said it is overloaded (529).
LimitReason = Literal["rate_limited", "overloaded"]


@dataclasses.dataclass(frozen=True, slots=True)
class ModelWaiting:
    """Nothing streams for now: the model's key is rate limited (``reason``:
    ``rate_limited`` or ``overloaded``) and the round waits about ``wait_s`` for it."""

    reason: LimitReason
    wait_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class ToolUse:
    id: str
    name: str
    input: dict[str, Any]
    # Why the model's arguments could not be read (e.g. invalid JSON), else None. Such a
    # call is not run: the engine gives the model an error result with this sentence.
    input_error: str | None = None


@dataclasses.dataclass(slots=True)
class UsageCounts:
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0

    def add(self, other: UsageCounts) -> None:
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.cache_read_tokens += other.cache_read_tokens
        self.cache_write_tokens += other.cache_write_tokens


@dataclasses.dataclass(frozen=True, slots=True)
class RoundResult:
    # end_turn | tool_use | max_tokens | pause_turn | refusal | stop_sequence
    stop_reason: str
    # The assistant message's content blocks, in Anthropic format, for the history.
    content: list[dict[str, Any]]
    tool_uses: list[ToolUse]
    usage: UsageCounts


class ModelError(Exception):
    """A model round that failed after the client's own retries.

    ``reason`` is a stable code for ``turn.failed``: ``rate_limited``, ``overloaded``,
    ``provider_error``, ``bad_request``, ``auth``, ``connection``.
    """

    def __init__(self, reason: FailureReason, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class ModelClient(Protocol):
    name: str

    def stream_round(
        self, request: ModelRequest
    ) -> AsyncIterator[TextChunk | ModelWaiting | RoundResult]:
        """Yield text chunks as they stream (and a ModelWaiting while a rate limit holds
        the round back), then exactly one RoundResult; raise ModelError."""
        ...

    async def aclose(self) -> None: ...

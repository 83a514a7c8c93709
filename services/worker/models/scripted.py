"""The offline scripted model: deterministic, no network, drives the notes tools on plain phrases.

It reads the turn's prompt (the last user message that carries text) and the rounds
already taken since it (assistant messages and tool results in ``request.messages``):

- a line with ``remember X`` → ``working_notes_update`` with X appended to the notes it
  sees in its system prompt, then a confirmation quoting the tool result;
- ``forget everything`` → ``working_notes_clear``, then a confirmation;
- ``what did we conclude?`` → ``working_notes_get``, then an answer from its result;
- a message made of lines ``call <tool> <json object>`` → one round calling each named
  tool with that input (whether or not it is offered: tests forge calls so), then a
  reply made of each result's text, in order, one per line;
- anything else → a short reply saying how many bytes of working notes it sees.

``settings.scripted_rounds = N`` makes every turn take N - 1 extra no-op rounds (each a
``working_notes_get`` call) before the phrase's own rounds, and
``settings.scripted_delay_ms`` sleeps before every streamed chunk: both are for tests of
long turns (the wall clock, the round cap, cancel mid-stream).

An LLM's timing, for benchmarks: ``settings.scripted_ttft_ms`` is each round's time to
first token and ``settings.scripted_tokens_per_s`` the streaming speed after it. A token
is a word here; a delta carries a few words (:func:`round_schedule`) and goes out when its
last token is due, so a round of ``n`` tokens takes ``ttft + (n - 1) / rate``
(:func:`round_time_s`). The schedule is kept against the round's start, so a slow
consumer does not stretch it.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from turnbus.shared.settings import Settings
from turnbus.shared.system import WORKING_NOTES_FOLD
from turnbus.worker.models.base import ModelRequest, RoundResult, TextChunk, ToolUse, UsageCounts

__all__ = ["ScriptedModel", "notes_in_system", "round_schedule", "round_time_s"]

_REMEMBER = re.compile(r"\bremember\s+(\S.*)", re.IGNORECASE)
_FORGET = re.compile(r"\bforget everything\b", re.IGNORECASE)
_CONCLUDE = re.compile(r"\bwhat did we conclude\b", re.IGNORECASE)
_CALL = re.compile(r"call\s+(\S+)\s+(\{.*\})\s*")
_input_decoder = msgspec.json.Decoder(dict[str, Any])
_WORDS_PER_CHUNK = 3
_json = msgspec.json.Encoder()


def notes_in_system(system: str) -> str:
    """The working notes folded into a system prompt built by ``resolve_system``; ``""`` when absent."""
    start = system.find(WORKING_NOTES_FOLD)
    if start < 0:
        return ""
    block = system[start + len(WORKING_NOTES_FOLD) :]
    # The notes sit inside a fence longer than any backtick run in them, so the first
    # line that starts with that fence again closes the block.
    fence, _, rest = block.partition("\n")
    end = rest.find("\n" + fence)
    return rest[:end] if end >= 0 else rest


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(block.get("text", ""))
            for block in content
            if isinstance(block, dict) and block.get("type") == "text"
        )
    return ""


def _tool_results(content: Any) -> list[str]:
    if not isinstance(content, list):
        return []
    return [
        _text_of(block.get("content", ""))
        for block in content
        if isinstance(block, dict) and block.get("type") == "tool_result"
    ]


def _chunks(text: str) -> list[str]:
    words = re.findall(r"\S+\s*", text)
    return [
        "".join(words[i : i + _WORDS_PER_CHUNK]) for i in range(0, len(words), _WORDS_PER_CHUNK)
    ]


def round_schedule(text: str, ttft_s: float, tokens_per_s: float) -> list[tuple[float, str]]:
    """The deltas of a round's ``text``, each with its offset in seconds from the round's start.

    The first token is due at ``ttft_s``, token ``k`` at ``ttft_s + k / tokens_per_s``
    (no rate: all at ``ttft_s``); a delta goes out with its last token."""
    schedule: list[tuple[float, str]] = []
    seen = 0
    for chunk in _chunks(text):
        seen += len(chunk.split())
        pace = (seen - 1) / tokens_per_s if tokens_per_s > 0 else 0.0
        schedule.append((ttft_s + pace, chunk))
    return schedule


def round_time_s(text: str, ttft_s: float, tokens_per_s: float) -> float:
    """The model's own time for a round that streams ``text``: ``ttft + (tokens - 1) / rate``."""
    schedule = round_schedule(text, ttft_s, tokens_per_s)
    return schedule[-1][0] if schedule else ttft_s


def _prompt_of(content: Any) -> str:
    """The user's text in a user message: its last text block. A message can also carry
    tool results, or an earlier prompt, when history merged it with the one before."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for block in reversed(content):
            if isinstance(block, dict) and block.get("type") == "text":
                return str(block.get("text", ""))
    return ""


class _Turn:
    """What the scripted model knows about the turn in progress."""

    def __init__(self, request: ModelRequest) -> None:
        messages = request.messages
        prompt_at = -1
        for i in range(len(messages) - 1, -1, -1):
            message = messages[i]
            # The prompt: the last user message with text (tool results alone are not).
            if message.get("role") == "user" and _prompt_of(message.get("content")).strip():
                prompt_at = i
                break
        self.prompt = _prompt_of(messages[prompt_at]["content"]) if prompt_at >= 0 else ""
        since = messages[prompt_at + 1 :]
        self.round = 1 + sum(1 for m in since if m.get("role") == "assistant")
        self.tool_results = [
            r for m in since if m.get("role") == "user" for r in _tool_results(m.get("content"))
        ]
        self.tool_names = {tool["name"] for tool in request.tools}


def _calls_in(prompt: str) -> list[tuple[str, dict[str, Any]]]:
    """The ``call <tool> <json object>`` lines of a prompt made only of such lines."""
    calls: list[tuple[str, dict[str, Any]]] = []
    for line in prompt.splitlines():
        if not line.strip():
            continue
        match = _CALL.fullmatch(line.strip())
        if match is None:
            return []
        try:
            calls.append((match.group(1), _input_decoder.decode(match.group(2))))
        except msgspec.DecodeError:
            return []
    return calls


class ScriptedModel:
    """A deterministic :class:`~turnbus.worker.models.base.ModelClient` for offline runs and tests."""

    name = "scripted"

    def __init__(self, settings: Settings) -> None:
        self._delay_s = settings.scripted_delay_ms / 1000
        self._ttft_s = settings.scripted_ttft_ms / 1000
        self._tokens_per_s = float(settings.scripted_tokens_per_s)
        self._padding = max(settings.scripted_rounds - 1, 0)

    async def aclose(self) -> None:
        return None

    async def stream_round(self, request: ModelRequest) -> AsyncIterator[TextChunk | RoundResult]:
        text, tool_uses = self._decide(request)
        loop = asyncio.get_running_loop()
        start = loop.time()
        paced = self._ttft_s > 0 or self._tokens_per_s > 0
        for due, chunk in round_schedule(text, self._ttft_s, self._tokens_per_s):
            if self._delay_s > 0:
                await asyncio.sleep(self._delay_s)
            if paced:
                wait = start + due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
            yield TextChunk(chunk)
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        for use in tool_uses:
            content.append({"type": "tool_use", "id": use.id, "name": use.name, "input": use.input})
        out_bytes = len(text.encode()) + sum(len(_json.encode(t.input)) for t in tool_uses)
        in_bytes = len(request.system.encode()) + len(_json.encode(request.messages))
        yield RoundResult(
            stop_reason="tool_use" if tool_uses else "end_turn",
            content=content,
            tool_uses=tool_uses,
            usage=UsageCounts(
                input_tokens=max(in_bytes // 4, 1), output_tokens=max(out_bytes // 4, 1)
            ),
        )

    def _decide(self, request: ModelRequest) -> tuple[str, list[ToolUse]]:
        turn = _Turn(request)
        calls = _calls_in(turn.prompt)
        if calls:
            if turn.round == 1:
                # Ids as a real model's are: new each time it is asked (a resumed round
                # that reuses its stored calls keeps them).
                uses = [ToolUse(f"toolu_{os.urandom(8).hex()}", n, i) for n, i in calls]
                names = ", ".join(n for n, _ in calls)
                return f"Calling {names}.", uses
            return "\n".join(turn.tool_results[-len(calls) :]), []
        text, use = self._decide_notes(request, turn)
        return text, [use] if use is not None else []

    def _decide_notes(self, request: ModelRequest, turn: _Turn) -> tuple[str, ToolUse | None]:
        notes = notes_in_system(request.system)
        tool_id = f"toolu_scripted_{turn.round}"

        if turn.round <= self._padding and "working_notes_get" in turn.tool_names:
            return (
                f"Checking my working notes, step {turn.round} of {self._padding}.",
                ToolUse(tool_id, "working_notes_get", {}),
            )
        step = turn.round - (self._padding if "working_notes_get" in turn.tool_names else 0)
        last_result = turn.tool_results[-1] if turn.tool_results else ""

        remember = next(
            (m for line in turn.prompt.splitlines() if (m := _REMEMBER.search(line))), None
        )
        if remember is not None and "working_notes_update" in turn.tool_names:
            item = remember.group(1).strip()
            if step == 1:
                updated = f"{notes}\n- {item}" if notes else f"- {item}"
                return (
                    "Saving that to my working notes.",
                    ToolUse(tool_id, "working_notes_update", {"notes": updated}),
                )
            return f"Noted: {item}. The tool said: {last_result}", None

        if _FORGET.search(turn.prompt) and "working_notes_clear" in turn.tool_names:
            if step == 1:
                return "Clearing my working notes.", ToolUse(tool_id, "working_notes_clear", {})
            return f"Done, everything is forgotten. The tool said: {last_result}", None

        if _CONCLUDE.search(turn.prompt) and "working_notes_get" in turn.tool_names:
            if step == 1:
                return "Let me check my working notes.", ToolUse(tool_id, "working_notes_get", {})
            return f"From my working notes:\n{last_result}", None

        size = len(notes.encode())
        return f"Scripted reply: I see {size} bytes of working notes in my system prompt.", None

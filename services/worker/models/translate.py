"""The stored history (Anthropic's message format) as Chat Completions messages, and back.

The history is stored in one format; a provider that speaks Chat Completions gets it
translated here, in one place (tests/worker/test_models_translate.py round-trips a
corpus of stored histories):

- the system prompt becomes the first message, ``role: system``, its bytes unchanged;
- a user message's text blocks become one ``user`` message (a string when one block,
  else text parts), its ``tool_result`` blocks ``role: tool`` messages in their order,
  before the text (a tool message must follow the assistant's call). An error result
  is sent with :data:`TOOL_ERROR_PREFIX` before its text (Chat Completions has no error
  flag), which tells the model the call failed and is how the flag comes back;
  a result's content blocks are sent as their text joined;
- an assistant message's text blocks become its ``content`` (a string when one, else
  text parts), its ``tool_use`` blocks ``tool_calls`` (arguments as JSON), in order;
  ``thinking`` and ``redacted_thinking`` are dropped (no Chat Completions API takes
  them back), as are block types Chat Completions has no place for.

Back (:func:`from_chat`), an assistant's text comes before its tool calls, and the tool
messages and the user message after them become one user message.
"""

from __future__ import annotations

from typing import Any

import msgspec

from turnbus.worker.models.base import ToolSpec

__all__ = ["TOOL_ERROR_PREFIX", "from_chat", "text_of", "to_chat", "tools_to_chat"]

TOOL_ERROR_PREFIX = "[tool error] "

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


def _text_content(texts: list[str]) -> str | list[dict[str, Any]]:
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": text} for text in texts]


def text_of(content: Any) -> str:
    """A message's or a tool result's text: a string as it is, text blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(b.get("text", ""))
            for b in content
            if isinstance(b, dict) and b.get("type") == "text"
        )
    return ""


def _user(content: Any, out: list[dict[str, Any]]) -> None:
    if isinstance(content, str):
        out.append({"role": "user", "content": content})
        return
    texts: list[str] = []
    for block in content or ():
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "tool_result":
            text = text_of(block.get("content"))
            if block.get("is_error"):
                text = TOOL_ERROR_PREFIX + text
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
        elif kind == "text":
            texts.append(str(block.get("text", "")))
    if texts:
        out.append({"role": "user", "content": _text_content(texts)})


def _assistant(content: Any, out: list[dict[str, Any]]) -> None:
    if isinstance(content, str):
        out.append({"role": "assistant", "content": content})
        return
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content or ():
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            arguments = _encoder.encode(block.get("input") or {}).decode()
            function = {"name": block.get("name"), "arguments": arguments}
            calls.append({"id": block.get("id"), "type": "function", "function": function})
    message: dict[str, Any] = {"role": "assistant"}
    message["content"] = _text_content(texts) if texts else ("" if not calls else None)
    if calls:
        message["tool_calls"] = calls
    out.append(message)


def to_chat(system: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The round's Chat Completions ``messages``: the system prompt, then the history."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system})
    for message in messages:
        if message.get("role") == "assistant":
            _assistant(message.get("content"), out)
        else:
            _user(message.get("content"), out)
    return out


def tools_to_chat(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    """Tool specs as Chat Completions ``tools``, in their order."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool["name"],
                "description": tool["description"],
                "parameters": tool["input_schema"],
            },
        }
        for tool in tools
    ]


def _texts_of(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return [
        {"type": "text", "text": str(part.get("text", ""))}
        for part in content or ()
        if isinstance(part, dict) and part.get("type") == "text"
    ]


def from_chat(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Chat Completions messages as ``(system, Anthropic messages)``: :func:`to_chat`
    undone (module docstring)."""
    system = ""
    out: list[dict[str, Any]] = []

    def user_blocks() -> list[dict[str, Any]]:
        if out and out[-1]["role"] == "user":
            blocks: list[dict[str, Any]] = out[-1]["content"]
            return blocks
        out.append({"role": "user", "content": []})
        return out[-1]["content"]  # type: ignore[no-any-return]

    for message in messages:
        role = message.get("role")
        if role == "system":
            system = str(message.get("content") or "")
        elif role == "tool":
            text = str(message.get("content") or "")
            block: dict[str, Any] = {"type": "tool_result", "tool_use_id": message["tool_call_id"]}
            if text.startswith(TOOL_ERROR_PREFIX):
                block["content"] = text[len(TOOL_ERROR_PREFIX) :]
                block["is_error"] = True
            else:
                block["content"] = text
            user_blocks().append(block)
        elif role == "user":
            user_blocks().extend(_texts_of(message.get("content")))
        elif role == "assistant":
            blocks = _texts_of(message.get("content"))
            for call in message.get("tool_calls") or ():
                function = call.get("function") or {}
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call.get("id"),
                        "name": function.get("name"),
                        "input": _decoder.decode(function.get("arguments") or "{}"),
                    }
                )
            out.append({"role": "assistant", "content": blocks})
    return system, out

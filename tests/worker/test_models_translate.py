"""The history translator: stored Anthropic-format messages ↔ Chat Completions messages."""

from __future__ import annotations

from typing import Any

import pytest

from turnbus.shared.system import resolve_system
from turnbus.worker.history import truncate_tool_result
from turnbus.worker.models.translate import (
    TOOL_ERROR_PREFIX,
    from_chat,
    to_chat,
    tools_to_chat,
)
from turnbus.worker.tools import NOTES_TOOL_SPECS


def user(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def assistant(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": list(blocks)}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def use(call_id: str, name: str, tool_input: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": tool_input}


def result(call_id: str, content: str, *, error: bool = False) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": call_id, "content": content}
    if error:
        block["is_error"] = True
    return block


THINKING = {"type": "thinking", "thinking": "Let me think.", "signature": "sig"}
REDACTED = {"type": "redacted_thinking", "data": "opaque"}
LONG, _ = truncate_tool_result("x" * 40_000)

CORPUS: dict[str, list[dict[str, Any]]] = {
    "one exchange": [user(text("hello")), assistant(text("Hi."))],
    "a tool loop": [
        user(text("remember the build is green")),
        assistant(text("Saving."), use("toolu_1", "working_notes_update", {"notes": "- green"})),
        user(result("toolu_1", "working notes updated (7 bytes)")),
        assistant(
            text("Checking twice."),
            use("toolu_2", "working_notes_get", {}),
            use("toolu_3", "working_notes_get", {}),
        ),
        user(result("toolu_2", "- green"), result("toolu_3", "- green")),
        assistant(text("Done.")),
        user(text("and now?")),
        assistant(text("Still green.")),
    ],
    "a truncated result": [
        user(text("read the log")),
        assistant(use("call_a", "read_log", {"lines": 9000, "nested": {"a": [1, 2]}})),
        user(result("call_a", LONG)),
        assistant(text("It is long.")),
    ],
    "an error result": [
        user(text("save this")),
        assistant(use("call_e", "working_notes_update", {"notes": "x" * 10})),
        user(result("call_e", "notes over the 32768-byte cap", error=True)),
        assistant(text("Too long.")),
    ],
    "thinking": [
        user(text("think first")),
        assistant(THINKING, text("Thought."), use("toolu_t", "working_notes_get", {})),
        user(result("toolu_t", "(no working notes yet)")),
        assistant(REDACTED, text("Nothing yet.")),
    ],
    "a prompt after results, several text blocks": [
        user(text("a"), text("b")),
        assistant(text("c"), text("d"), use("t1", "f", {})),
        user(result("t1", "r"), text("next prompt")),
        assistant(text("e")),
    ],
}


def without_thinking(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            **m,
            "content": [
                b for b in m["content"] if b.get("type") not in ("thinking", "redacted_thinking")
            ],
        }
        for m in messages
    ]


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_the_history_round_trips(name: str) -> None:
    messages = CORPUS[name]
    system = resolve_system(persona="Be brief.", notes="- a *note*\n```\nfenced\n```")
    chat = to_chat(system, messages)
    assert from_chat(chat) == (system, without_thinking(messages))


def test_the_system_prompt_is_the_first_message_with_its_bytes_unchanged() -> None:
    system = resolve_system(persona="Ünïcode persona \u2028 with odd spaces", notes="- n")
    chat = to_chat(system, CORPUS["one exchange"])
    assert chat[0] == {"role": "system", "content": system}
    assert chat[0]["content"].encode() == system.encode()


def test_tool_use_becomes_tool_calls_and_results_tool_messages_in_order() -> None:
    chat = to_chat("", CORPUS["a tool loop"])
    assert [m["role"] for m in chat] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    calls = chat[3]["tool_calls"]
    assert [c["id"] for c in calls] == ["toolu_2", "toolu_3"]
    assert calls[0] == {
        "id": "toolu_2",
        "type": "function",
        "function": {"name": "working_notes_get", "arguments": "{}"},
    }
    assert chat[1]["content"] == "Saving."
    assert [m["tool_call_id"] for m in chat if m["role"] == "tool"] == [
        "toolu_1",
        "toolu_2",
        "toolu_3",
    ]


def test_thinking_is_not_sent_and_an_error_result_says_so() -> None:
    chat = to_chat("", CORPUS["thinking"] + CORPUS["an error result"])
    assert "thinking" not in str(chat) and "opaque" not in str(chat)
    errors = [m["content"] for m in chat if m["role"] == "tool" and m["tool_call_id"] == "call_e"]
    assert errors == [TOOL_ERROR_PREFIX + "notes over the 32768-byte cap"]


def test_an_assistant_message_with_only_calls_has_no_text() -> None:
    chat = to_chat("", CORPUS["a truncated result"])
    assert chat[1]["content"] is None and len(chat[1]["tool_calls"]) == 1


def test_tool_specs_become_functions() -> None:
    tools = tools_to_chat(list(NOTES_TOOL_SPECS))
    assert [t["type"] for t in tools] == ["function"] * len(NOTES_TOOL_SPECS)
    for spec, tool in zip(NOTES_TOOL_SPECS, tools, strict=True):
        assert tool["function"] == {
            "name": spec["name"],
            "description": spec["description"],
            "parameters": spec["input_schema"],
        }

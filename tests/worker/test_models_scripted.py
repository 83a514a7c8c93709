from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.worker_kit import collect_round
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.settings import Settings, SettingsError
from turnbus.shared.system import resolve_system, resolve_system_blocks
from turnbus.worker.models import scripted
from turnbus.worker.models.base import ModelRequest, RoundResult, ToolSpec
from turnbus.worker.models.scripted import ScriptedModel, notes_in_system

TOOLS: list[ToolSpec] = [
    {"name": name, "description": "d", "input_schema": {"type": "object"}}
    for name in ("working_notes_get", "working_notes_update", "working_notes_clear")
]


def _request(
    messages: list[dict[str, Any]], notes: str | None = None, skills: str | None = None
) -> ModelRequest:
    return ModelRequest(
        system_blocks=resolve_system_blocks("Be terse.", notes, skills),
        system=resolve_system("Be terse.", notes, skills),
        messages=messages,
        tools=TOOLS,
    )


async def _round(model: ScriptedModel, request: ModelRequest) -> tuple[list[str], RoundResult]:
    chunks, result = await collect_round(model, request)
    assert "".join(chunks) == result.content[0]["text"]
    return chunks, result


def _tool_result(tool_id: str, text: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": tool_id, "content": text}],
    }


def test_notes_in_system_reads_the_fold_of_resolve_system() -> None:
    notes = "- the build is green\n- deploy on Friday"
    assert notes_in_system(resolve_system("p", notes, None)) == notes
    assert notes_in_system(resolve_system("p", notes, "skill: grep")) == notes
    assert notes_in_system(resolve_system("p", None, "skill: grep")) == ""
    assert notes_in_system(resolve_system()) == ""


async def test_remember_appends_to_the_notes_then_confirms_with_the_tool_result() -> None:
    model = ScriptedModel(Settings())
    prompt: dict[str, Any] = {"role": "user", "content": "Please REMEMBER the build is green"}

    _, first = await _round(model, _request([prompt], notes="- older"))
    assert first.stop_reason == "tool_use"
    assert [(t.id, t.name, t.input) for t in first.tool_uses] == [
        ("toolu_scripted_1", "working_notes_update", {"notes": "- older\n- the build is green"})
    ]
    assert first.content[1] == {
        "type": "tool_use",
        "id": "toolu_scripted_1",
        "name": "working_notes_update",
        "input": {"notes": "- older\n- the build is green"},
    }

    _, empty = await _round(model, _request([prompt]))
    assert empty.tool_uses[0].input == {"notes": "- the build is green"}

    result = "working notes updated (34 bytes)"
    tool_message = _tool_result("toolu_scripted_1", result)
    history: list[dict[str, Any]] = [
        prompt,
        {"role": "assistant", "content": first.content},
        tool_message,
    ]
    _, second = await _round(model, _request(history, notes="- older\n- the build is green"))
    assert second.stop_reason == "end_turn"
    assert second.tool_uses == []
    assert "the build is green" in second.content[0]["text"]
    assert result in second.content[0]["text"]


async def test_forget_everything_clears_then_confirms() -> None:
    model = ScriptedModel(Settings())
    prompt: dict[str, Any] = {
        "role": "user",
        "content": [{"type": "text", "text": "ok, forget everything"}],
    }
    _, first = await _round(model, _request([prompt], notes="- x"))
    assert [(t.name, t.input) for t in first.tool_uses] == [("working_notes_clear", {})]
    cleared = "working notes cleared — this is a new mind for this session"
    history: list[dict[str, Any]] = [
        prompt,
        {"role": "assistant", "content": first.content},
        _tool_result(first.tool_uses[0].id, cleared),
    ]
    _, second = await _round(model, _request(history))
    assert second.stop_reason == "end_turn"
    assert cleared in second.content[0]["text"]


async def test_what_did_we_conclude_reads_the_notes_and_answers_from_them() -> None:
    model = ScriptedModel(Settings())
    prompt: dict[str, Any] = {"role": "user", "content": "So, what did we conclude?"}
    _, first = await _round(model, _request([prompt], notes="- ship it"))
    assert [(t.name, t.input) for t in first.tool_uses] == [("working_notes_get", {})]
    history: list[dict[str, Any]] = [
        prompt,
        {"role": "assistant", "content": first.content},
        # A list-shaped tool_result content is read as well as a string one.
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": first.tool_uses[0].id,
                    "content": [{"type": "text", "text": "- ship it"}],
                }
            ],
        },
    ]
    _, second = await _round(model, _request(history, notes="- ship it"))
    assert second.content[0]["text"] == "From my working notes:\n- ship it"


async def test_anything_else_reports_the_notes_bytes_it_sees_in_several_chunks() -> None:
    model = ScriptedModel(Settings())
    notes = "- café ☕"
    earlier: list[dict[str, Any]] = [
        {"role": "user", "content": "remember old things"},
        {"role": "assistant", "content": [{"type": "text", "text": "Noted."}]},
    ]
    chunks, result = await _round(
        model, _request([*earlier, {"role": "user", "content": "hello there"}], notes=notes)
    )
    assert len(chunks) >= 3
    assert f"I see {len(notes.encode())} bytes of working notes" in result.content[0]["text"]
    assert result.stop_reason == "end_turn"
    assert result.usage.input_tokens > 0 and result.usage.output_tokens > 0

    _, bare = await _round(model, _request([{"role": "user", "content": "hello"}]))
    assert "I see 0 bytes of working notes" in bare.content[0]["text"]


async def test_call_lines_call_each_tool_in_one_round_then_answer_with_each_result() -> None:
    model = ScriptedModel(Settings())
    # Blank lines and the space around a line are skipped; a tool need not be offered
    # (TOOLS holds only the notes tools): tests forge calls so.
    prompt: dict[str, Any] = {
        "role": "user",
        "content": (
            'call lookup {"term": "lease"}\n'
            "\n"
            '  call charge {"n": 2, "memo": {"tags": ["a", "b"]}}  \n'
            "call lookup {}"
        ),
    }
    _, first = await _round(model, _request([prompt]))
    assert first.stop_reason == "tool_use"
    assert [(t.name, t.input) for t in first.tool_uses] == [
        ("lookup", {"term": "lease"}),
        ("charge", {"n": 2, "memo": {"tags": ["a", "b"]}}),
        ("lookup", {}),
    ]
    assert first.content[0]["text"] == "Calling lookup, charge, lookup."
    assert first.content[1:] == [
        {"type": "tool_use", "id": t.id, "name": t.name, "input": t.input} for t in first.tool_uses
    ]
    ids = [t.id for t in first.tool_uses]
    assert len(set(ids)) == 3 and all(i.startswith("toolu_") for i in ids)
    # Asked again, it calls with new ids, as a real model does.
    _, again = await _round(model, _request([prompt]))
    assert not set(ids) & {t.id for t in again.tool_uses}

    history: list[dict[str, Any]] = [
        prompt,
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": ids[0], "content": "lease: found"},
                {
                    "type": "tool_result",
                    "tool_use_id": ids[1],
                    "content": [{"type": "text", "text": "charged 2"}],
                },
                {
                    "type": "tool_result",
                    "tool_use_id": ids[2],
                    "content": "ERROR invalid input for lookup",
                    "is_error": True,
                },
            ],
        },
    ]
    _, second = await _round(model, _request(history))
    assert second.stop_reason == "end_turn" and second.tool_uses == []
    assert second.content[0]["text"] == "lease: found\ncharged 2\nERROR invalid input for lookup"


@pytest.mark.parametrize(
    "bad_line",
    [
        "call lookup",  # no input
        "call lookup [1, 2]",  # not an object
        "call lookup {term: lease}",  # not JSON
        'call lookup {"a": 1} {"b": 2}',  # two objects
        'call lookup {"term": "x"} now',  # words after the object
        'CALL lookup {"term": "x"}',  # the keyword is lower case
        "look this up",
    ],
)
async def test_one_malformed_line_makes_the_whole_message_an_ordinary_one(bad_line: str) -> None:
    model = ScriptedModel(Settings())
    message = f'call lookup {{"term": "lease"}}\n{bad_line}'
    _, result = await _round(model, _request([{"role": "user", "content": message}]))
    # Not even the well-formed line is called: the message gets the plain reply.
    assert result.stop_reason == "end_turn" and result.tool_uses == []
    assert result.content[0]["text"].startswith("Scripted reply: I see 0 bytes")
    # An ordinary message, so its phrases drive the notes tools as any other's do.
    remember = f"{message}\nremember the lease is 30 s"
    _, noted = await _round(model, _request([{"role": "user", "content": remember}]))
    assert [(t.name, t.input) for t in noted.tool_uses] == [
        ("working_notes_update", {"notes": "- the lease is 30 s"})
    ]


async def test_the_same_request_gives_the_same_round() -> None:
    request = _request([{"role": "user", "content": "remember x"}], notes="- y")
    a = await _round(ScriptedModel(Settings()), request)
    b = await _round(ScriptedModel(Settings()), request)
    assert a == b


async def test_tools_not_offered_are_never_called() -> None:
    model = ScriptedModel(Settings())
    request = ModelRequest(
        system_blocks=resolve_system_blocks(),
        system=resolve_system(),
        messages=[{"role": "user", "content": "remember x"}],
        tools=[],
    )
    _, result = await _round(model, request)
    assert result.stop_reason == "end_turn"
    assert result.tool_uses == []


async def test_scripted_rounds_pads_the_turn_with_noop_rounds() -> None:
    model = ScriptedModel(Settings(scripted_rounds=3))
    history: list[dict[str, Any]] = [{"role": "user", "content": "what did we conclude?"}]
    calls: list[tuple[str, str]] = []
    for _ in range(10):
        _, result = await _round(model, _request(history, notes="- n"))
        if result.stop_reason == "end_turn":
            break
        (tool_use,) = result.tool_uses
        calls.append((tool_use.id, tool_use.name))
        history += [
            {"role": "assistant", "content": result.content},
            _tool_result(tool_use.id, "- n"),
        ]
    assert calls == [
        ("toolu_scripted_1", "working_notes_get"),
        ("toolu_scripted_2", "working_notes_get"),
        ("toolu_scripted_3", "working_notes_get"),
    ]
    assert result.content[0]["text"] == "From my working notes:\n- n"


async def test_scripted_delay_sleeps_before_every_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay: float) -> None:
        slept.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(scripted.asyncio, "sleep", recording_sleep)
    model = ScriptedModel(Settings(scripted_delay_ms=20))
    chunks, _ = await _round(model, _request([{"role": "user", "content": "hi"}]))
    assert len(chunks) > 1
    assert slept == [0.02] * len(chunks)


async def test_a_note_remembered_reaches_the_next_turns_system_through_the_envelope(
    store: EnvelopeStore,
) -> None:
    """The scripted model's tool calls applied to a real envelope, as the engine does."""
    model = ScriptedModel(Settings())
    await store.create("u1", "s1")

    async def turn(history: list[dict[str, Any]], text: str) -> RoundResult:
        history.append({"role": "user", "content": text})
        while True:
            envelope = await store.read("u1", "s1")
            assert envelope is not None
            notes = envelope.meta.workingNotes
            _, result = await _round(model, _request(history, notes=notes))
            history.append({"role": "assistant", "content": result.content})
            if not result.tool_uses:
                return result
            for use in result.tool_uses:
                if use.name == "working_notes_update":
                    await store.worker_overlay("u1", "s1", {"workingNotes": use.input["notes"]})
                elif use.name == "working_notes_clear":
                    await store.worker_overlay("u1", "s1", {"workingNotes": ""})
                history.append(_tool_result(use.id, notes or "(empty)"))

    history: list[dict[str, Any]] = []
    await turn(history, "remember the build is green")
    await turn(history, "remember deploys are on Friday")
    answer = await turn(history, "hi")
    notes = "- the build is green\n- deploys are on Friday"
    assert f"I see {len(notes.encode())} bytes" in answer.content[0]["text"]
    envelope = await store.read("u1", "s1")
    assert envelope is not None and envelope.meta.workingNotes == notes

    await turn(history, "forget everything")
    answer = await turn(history, "hi")
    assert "I see 0 bytes" in answer.content[0]["text"]


async def test_the_prompt_is_found_in_a_message_merged_with_earlier_tool_results() -> None:
    # A turn cancelled after a tool round: its tool results and the next prompt are one
    # user message (the history merges consecutive rows of one role).
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "what did we conclude?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "working_notes_get", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "(empty)"},
                {"type": "text", "text": "an earlier prompt nobody answered"},
                {"type": "text", "text": "remember the cache is warm"},
            ],
        },
    ]
    _, result = await _round(ScriptedModel(Settings()), _request(messages, notes="- old"))
    [use] = result.tool_uses
    assert (use.name, use.input) == (
        "working_notes_update",
        {"notes": "- old\n- the cache is warm"},
    )


def test_round_schedule_paces_the_deltas_at_the_token_rate_after_the_first_token() -> None:
    text = "one two three four five six seven eight nine ten"
    schedule = scripted.round_schedule(text, 0.5, 10)
    chunks = [chunk for _, chunk in schedule]
    assert "".join(chunks) == text
    assert [len(chunk.split()) for chunk in chunks] == [3, 3, 3, 1]
    # A delta goes out with its last token: token k is due at ttft + k / rate.
    assert [round(due, 6) for due, _ in schedule] == [0.7, 1.0, 1.3, 1.4]
    assert scripted.round_time_s(text, 0.5, 10) == pytest.approx(0.5 + 9 / 10)
    # No rate: every delta is due at the time to first token.
    assert {due for due, _ in scripted.round_schedule(text, 0.25, 0)} == {0.25}
    assert scripted.round_time_s("", 0.25, 50) == 0.25


async def test_a_paced_round_streams_the_same_deltas_as_an_unpaced_one() -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "tell me about the build"}]
    plain, plain_result = await _round(ScriptedModel(Settings()), _request(messages))
    paced_model = ScriptedModel(Settings(scripted_ttft_ms=1, scripted_tokens_per_s=100_000))
    paced, paced_result = await _round(paced_model, _request(messages))
    assert len(paced) > 1
    assert paced == plain
    assert paced_result.content == plain_result.content


async def test_a_paced_round_waits_for_the_first_token_then_between_deltas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay: float) -> None:
        slept.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(scripted.asyncio, "sleep", recording_sleep)
    model = ScriptedModel(Settings(scripted_ttft_ms=60_000, scripted_tokens_per_s=1))
    chunks, _ = await _round(model, _request([{"role": "user", "content": "hi"}]))
    # The sleeps do not pass time here, so every delta sleeps for its own due time.
    assert len(chunks) > 1
    assert len(slept) == len(chunks)
    assert slept == sorted(slept)
    assert slept[0] > 59


def test_the_timing_settings_read_their_environment_variables() -> None:
    settings = Settings.from_env(
        {"TURNBUS_SCRIPTED_TTFT_MS": "500", "TURNBUS_SCRIPTED_TOKENS_PER_S": "50"}
    )
    assert (settings.scripted_ttft_ms, settings.scripted_tokens_per_s) == (500, 50)
    assert (Settings().scripted_ttft_ms, Settings().scripted_tokens_per_s) == (0, 0)
    with pytest.raises(SettingsError, match="TURNBUS_SCRIPTED_TOKENS_PER_S"):
        Settings.from_env({"TURNBUS_SCRIPTED_TOKENS_PER_S": "-1"})

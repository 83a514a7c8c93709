"""The prompt cache: the share of input tokens read from it, over a session and over one turn.

The real ``AnthropicModel`` sends each round to the fake Messages API in a process of its
own (harness/fake_anthropic.py), which counts the cache as the API does: the prefix up to
each ``cache_control`` breakpoint (tools, then system, then messages) is a hit when an
identical prefix was written in the last 5 minutes, a prefix under 1,024 tokens is not
cached (Sonnet's minimum), and a token is 4 bytes. The rounds are built as the turn
engine builds them: ``resolve_system_blocks`` with the in-turn notes, the notes tools'
specs, the history as ``SessionHistory.model_messages`` gives it, the tool result texts
of ``worker.tools``; a turn's own rounds resend its rows as they were sent, a later turn
resends them as the history stores them (``stored_row``: the notes of a
``working_notes_update`` input and of a ``working_notes_get`` result as their digest).

Figures:
  sessions  10 turns of one session with a 2 KiB persona and 4 KiB of skills; turns 3 and
            7 are "remember …" turns (a working_notes_update, so the notes change), the
            others a plain question: read / (read + written + uncached input), the cold
            first turn included. With notes from turn 1 (the target's scenario: they
            change at 3 and 7) and with none until turn 3 (its change is the first
            write). With the engine's breakpoints and what-ifs: the older breakpoints
            (head, fold, last system block, the end); the skills block before the notes (not the seed's order); a
            2.5 KiB persona (the head's prefix past the 1,024-token minimum). For the
            engine's runs also ``every_block``: the same requests with a breakpoint on
            every block, counted by a cache of its own in this process (the API allows
            4): the most any placement of breakpoints could read.
  tool_loop one turn of 6 rounds (5 working_notes_get calls, then the answer) in a fresh
            session: the share over its rounds, and over the tool rounds (2-6).
  openai    the same sessions (the engine's system order) and tool loop on the real
            ``OpenAIModel`` against the fake Chat Completions API in a process of its
            own (harness/fake_openai.py), which counts the cache the way OpenAI documents
            it: automatic, by prefix (tools, then the messages, the system one first),
            for prompts of 1,024 tokens and more, in steps of 128 tokens; the share is
            ``cached_tokens`` / ``prompt_tokens``.
Figures go to benchmarks/results/bench_cache.json.
Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_cache.py`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anthropic

from benchmarks.benchlib import arguments, write_results
from harness.fake_anthropic import FakeAnthropicProcess, PromptCache
from harness.fake_openai import FakeOpenAI
from turnbus.shared.providers import Provider
from turnbus.shared.settings import Settings
from turnbus.shared.system import (
    DEFAULT_AGENT_SYSTEM,
    WORKING_NOTES_FOLD,
    SystemBlock,
    resolve_system_blocks,
)
from turnbus.worker.history import SessionHistory, stored_row
from turnbus.worker.models.anthropic import AnthropicModel
from turnbus.worker.models.base import ModelClient, ModelRequest, RoundResult
from turnbus.worker.models.openai import OpenAIModel
from turnbus.worker.models.ratelimit import RateGate
from turnbus.worker.tools import NOTES_TOOL_SPECS, NOTES_UPDATED

SESSION_TURNS = 10
NOTES_CHANGE_AT = (3, 7)
_PROSE = (
    "review the quarterly figures keep answers short cite the source table flag any "
    "number that moved more than ten percent and never guess a date or an owner"
)
WORDS = _PROSE.split()


def _text(size: int, seed: int, line: str) -> str:
    """Deterministic prose of about ``size`` bytes, one ``line``-prefixed item per line."""
    rng = random.Random(seed)
    lines: list[str] = []
    while sum(len(x) + 1 for x in lines) < size:
        lines.append(line + " ".join(rng.choice(WORDS) for _ in range(12)))
    return "\n".join(lines)[:size]


Blocks = Callable[[str | None, str | None, str | None], list[SystemBlock]]
_MARK: Any = {"type": "ephemeral"}


def _unmarked(block: SystemBlock) -> SystemBlock:
    return {"type": "text", "text": block["text"]}


def _merged(
    blocks: list[SystemBlock],
) -> tuple[SystemBlock, SystemBlock | None, SystemBlock | None]:
    """The engine's blocks as (head, notes block with its fold, skills block), unmarked."""
    head = _unmarked(blocks[0])
    notes = skills = None
    rest = [b["text"] for b in blocks[1:]]
    if rest and rest[0].endswith(WORKING_NOTES_FOLD):
        notes = {"type": "text", "text": rest[0] + rest[1]}
        rest = rest[2:]
    if rest:
        skills = {"type": "text", "text": rest[0]}
    return head, notes, skills  # type: ignore[return-value]


def breakpoints_before(
    persona: str | None, notes: str | None, skills: str | None
) -> list[SystemBlock]:
    """The system's breakpoints before this change: the head always, the fold, the last."""
    blocks = resolve_system_blocks(persona, notes, skills)
    blocks[0] = {**blocks[0], "cache_control": _MARK}
    return blocks


def skills_before_notes(
    persona: str | None, notes: str | None, skills: str | None
) -> list[SystemBlock]:
    """A what-if, not the seed's order: the skills block before the notes; a breakpoint
    at the end of the stable part (the skills, else the head) and on the last block."""
    head, notes_block, skills_block = _merged(resolve_system_blocks(persona, notes, skills))
    out = [head, *(b for b in (skills_block, notes_block) if b is not None)]
    stable = 1 if skills_block is not None else 0
    out[stable] = {**out[stable], "cache_control": _MARK}
    out[-1] = {**out[-1], "cache_control": _MARK}
    return out


class EndOnly(AnthropicModel):
    """The model client before this change: no breakpoint on the turn's prompt."""

    def _params(self, request: ModelRequest) -> dict[str, Any]:
        return {**super()._params(request), "messages": request.messages}


# (system blocks, the client's message breakpoints: True = the engine's, False = the end only)
PLACEMENTS: dict[str, tuple[Blocks, bool]] = {
    "seed order (persona, notes, skills); the engine's breakpoints: the fold (the head "
    "without notes), the last system block, the turn's prompt, the end": (
        resolve_system_blocks,
        True,
    ),
    "seed order; the breakpoints before this change: head, fold, last system block, the end": (
        breakpoints_before,
        False,
    ),
    "skills before notes (not the seed's order); breakpoints: the skills, the last system "
    "block, the turn's prompt, the end": (skills_before_notes, True),
}
ENGINE = next(iter(PLACEMENTS))
# A persona whose head prefix (tools, default text, persona) passes the 1,024-token
# minimum: 2 KiB makes it 932 tokens, so a session's first notes read nothing.
WHAT_IF_PERSONA_BYTES = 2560
STARTING_NOTES = "- the quarterly review is on Friday\n- figures come from the finance table"


@dataclass
class Session:
    """One session's rounds, built as the engine builds them."""

    model: ModelClient
    persona: str
    skills: str
    blocks: Blocks
    notes: str | None = None
    every_block: PromptCache | None = None
    rows: list[dict[str, Any]] = field(default_factory=list, init=False)
    history: SessionHistory = field(init=False)

    def __post_init__(self) -> None:
        self.history = SessionHistory(self.rows, [])

    async def turn(self, prompt: str) -> tuple[list[dict[str, int]], list[dict[str, int]]]:
        """Run a turn to its end; the usage of each of its rounds, as the fake counted
        it and as a breakpoint on every block would have (empty without ``every_block``)."""
        # The earlier turns' rows as the history stores them, the way a turn loads them.
        self.rows[:] = [stored_row(row, keep_thinking=False) for row in self.rows]
        self.rows.append({"role": "user", "content": [{"type": "text", "text": prompt}]})
        usages: list[dict[str, int]] = []
        bounds: list[dict[str, int]] = []
        for _ in range(24):
            system = self.blocks(self.persona, self.notes, self.skills)
            request = ModelRequest(
                system_blocks=system,
                system="".join(b["text"] for b in system),
                messages=self.history.model_messages(),
                tools=list(NOTES_TOOL_SPECS),
            )
            if self.every_block is not None:
                bounds.append(_usage_of(self.every_block.usage(_every_block_marked(request))))
            result: RoundResult | None = None
            async for item in self.model.stream_round(request):
                if isinstance(item, RoundResult):
                    result = item
            assert result is not None
            u = result.usage
            usages.append(
                {
                    "input": u.input_tokens,
                    "read": u.cache_read_tokens,
                    "write": u.cache_write_tokens,
                }
            )
            self.rows.append({"role": "assistant", "content": result.content})
            if not result.tool_uses:
                return usages, bounds
            results = []
            held = []
            for use in result.tool_uses:
                if use.name == "working_notes_update":
                    self.notes = str(use.input.get("notes", ""))
                    output = NOTES_UPDATED.format(bytes=len(self.notes.encode()))
                elif self.notes:
                    output = self.notes
                    held.append(use.id)  # the notes' text: stored as its digest
                else:
                    output = "(empty — no working notes for this session)"
                results.append({"type": "tool_result", "tool_use_id": use.id, "content": output})
            self.rows.append({"role": "user", "content": results, "notesResults": held})
        return usages, bounds


def _every_block_marked(request: ModelRequest) -> dict[str, Any]:
    """The request's body with a breakpoint on every block (more than the API allows)."""

    def marked(blocks: list[Any]) -> list[Any]:
        return [{**b, "cache_control": _MARK} for b in blocks]

    return {
        "tools": marked(request.tools),
        "system": marked(list(request.system_blocks)),
        "messages": [{**m, "content": marked(m["content"])} for m in request.messages],
    }


def _usage_of(usage: dict[str, int]) -> dict[str, int]:
    return {
        "input": usage["input_tokens"],
        "read": usage["cache_read_input_tokens"],
        "write": usage["cache_creation_input_tokens"],
    }


def share(usages: list[dict[str, int]]) -> dict[str, Any]:
    read = sum(u["read"] for u in usages)
    write = sum(u["write"] for u in usages)
    plain = sum(u["input"] for u in usages)
    total = read + write + plain
    return {
        "rounds": len(usages),
        "input_tokens": total,
        "cache_read": read,
        "cache_write": write,
        "uncached": plain,
        "read_share": round(read / total, 3) if total else None,
    }


async def run_session(
    model: ModelClient,
    blocks: Blocks,
    seed: int,
    notes: str | None,
    persona_bytes: int = 2048,
    every_block: bool = False,
) -> dict[str, Any]:
    persona = _text(persona_bytes, seed, "- ")
    skills = _text(4096, seed + 1, "* skill: ")
    bound = PromptCache(min_tokens=1024) if every_block else None
    session = Session(model, persona, skills, blocks, notes, bound)
    per_turn = []
    every: list[dict[str, int]] = []
    bounds: list[dict[str, int]] = []
    for t in range(1, SESSION_TURNS + 1):
        if t in NOTES_CHANGE_AT:
            prompt = f"remember the figures of turn {t} were checked and the owner is team {t}"
        else:
            prompt = f"question {t}: what moved most in the quarterly figures, and why?"
        usages, turn_bounds = await session.turn(prompt)
        every += usages
        bounds += turn_bounds
        per_turn.append({"turn": t, "notes_change": t in NOTES_CHANGE_AT, **share(usages)})
    out = {"turns": per_turn, **share(every)}
    if bound is not None:
        out["every_block"] = share(bounds)
    return out


async def run_tool_loop(model: ModelClient, seed: int) -> dict[str, Any]:
    session = Session(
        model, _text(2048, seed, "- "), _text(4096, seed + 1, "* skill: "), resolve_system_blocks
    )
    usages, _ = await session.turn("check your notes 5 times, then tell me what they say")
    return {**share(usages), "after_round_1": share(usages[1:]), "per_round": usages}


async def measure() -> dict[str, Any]:
    settings = Settings(model="anthropic", anthropic_model="claude-sonnet-4-6")
    with FakeAnthropicProcess(responder="remember", min_cache_tokens=1024) as fake:
        sdk = anthropic.AsyncAnthropic(api_key=fake.api_key, base_url=fake.url)
        gate = RateGate()
        models = {
            True: AnthropicModel(settings, client=sdk, gate=gate),
            False: EndOnly(settings, client=sdk, gate=gate),
        }
        model = models[True]
        try:
            # Each run's persona differs (its seed), so no run reads another's cache.
            sessions = []
            seed = 0
            for placement, (blocks, engine_client) in PLACEMENTS.items():
                for notes in (STARTING_NOTES, None):
                    seed += 2
                    run = await run_session(
                        models[engine_client],
                        blocks,
                        seed,
                        notes,
                        every_block=placement == ENGINE,
                    )
                    sessions.append(
                        {"placement": placement, "notes_at_start": notes is not None, **run}
                    )
            for notes in (STARTING_NOTES, None):
                seed += 2
                run = await run_session(
                    model, resolve_system_blocks, seed, notes, WHAT_IF_PERSONA_BYTES
                )
                sessions.append(
                    {
                        "placement": (
                            f"seed order, the engine's breakpoints; a {WHAT_IF_PERSONA_BYTES:,} B "
                            "persona (the head's prefix past the 1,024-token minimum)"
                        ),
                        "notes_at_start": notes is not None,
                        "persona_bytes": WHAT_IF_PERSONA_BYTES,
                        **run,
                    }
                )
            tool_loop = await run_tool_loop(model, seed=100)
        finally:
            for m in models.values():
                await m.aclose()
            await sdk.close()
    return {
        "openai": await measure_openai(settings),
        "profile": {
            "persona_bytes": 2048,
            "skills_bytes": 4096,
            "default_text_bytes": len(DEFAULT_AGENT_SYSTEM.encode()),
            "turns": SESSION_TURNS,
            "notes_change_at_turns": list(NOTES_CHANGE_AT),
            "min_cache_tokens": 1024,
            "bytes_per_token": 4,
        },
        "sessions": sessions,
        "tool_loop": tool_loop,
        "target_read_share": 0.8,
    }


async def measure_openai(settings: Settings) -> dict[str, Any]:
    """The engine's sessions and tool loop on the OpenAI-compatible client (module
    docstring)."""
    with FakeOpenAI(responder="remember", min_cache_tokens=1024) as fake:
        provider = Provider("openai", "openai", fake.api_key, fake.base_url, "gpt-4.1-mini")
        model = OpenAIModel(settings, provider=provider, gate=RateGate())
        try:
            sessions = []
            for seed, notes in ((300, STARTING_NOTES), (302, None)):
                run = await run_session(model, resolve_system_blocks, seed, notes)
                sessions.append({"notes_at_start": notes is not None, **run})
            tool_loop = await run_tool_loop(model, seed=400)
        finally:
            await model.aclose()
    return {
        "cache": "automatic prefix cache, prompts of 1,024 tokens and more, 128-token steps",
        "sessions": sessions,
        "tool_loop": tool_loop,
    }


def main() -> None:
    parser = arguments(__doc__)
    args = parser.parse_args()
    figures = asyncio.run(measure())
    for f in [*figures["sessions"], figures["tool_loop"]]:
        what = f.get("placement", "tool loop") + (
            "; notes at start" if f.get("notes_at_start") else ""
        )
        print(f"{f['read_share']:.1%} of {f['input_tokens']} input tokens read from cache: {what}")
        if "every_block" in f:
            print(f"  {f['every_block']['read_share']:.1%} with a breakpoint on every block")
    openai = figures["openai"]
    for f in [*openai["sessions"], openai["tool_loop"]]:
        what = "tool loop" if "after_round_1" in f else "sessions"
        if f.get("notes_at_start"):
            what += "; notes at start"
        print(f"openai: {f['read_share']:.1%} of {f['input_tokens']} prompt tokens cached: {what}")
    print(f"wrote {write_results('bench_cache', figures, args.results_dir)}")


if __name__ == "__main__":
    main()

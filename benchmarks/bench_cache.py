"""The prompt cache: the share of input tokens read from it, over a session and over one turn.

The real ``AnthropicModel`` sends each round to the fake Messages API in a process of its
own (tests/fake_anthropic.py), which counts the cache as the API does: the prefix up to
each ``cache_control`` breakpoint (tools, then system, then messages) is a hit when an
identical prefix was written in the last 5 minutes, a prefix under 1,024 tokens is not
cached (Sonnet's minimum), and a token is 4 bytes. The rounds are built as the turn
engine builds them: ``resolve_system_blocks`` with the in-turn notes, the notes tools'
specs, the history as ``SessionHistory.model_messages`` gives it, the tool result texts
of ``worker.tools``.

Figures:
  sessions  10 turns of one session with a 2 KiB persona and 4 KiB of skills; turns 3 and
            7 are "remember …" turns (a working_notes_update, so the notes change), the
            others a plain question: read / (read + written + uncached input). With
            notes from the start and without; with the engine's breakpoints and three
            what-ifs (the breakpoints before the fold text had one; the skills block
            before the notes, which is not the seed's order; a 2.5 KiB persona, which
            puts the head's prefix past the 1,024-token minimum), to show what each
            costs or would take.
  tool_loop one turn of 6 rounds (5 working_notes_get calls, then the answer) in a fresh
            session: the share over its rounds.
Figures go to benchmarks/results/bench_cache.json.
Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_cache.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
from worker.history import SessionHistory
from worker.models.anthropic import AnthropicModel
from worker.models.base import ModelRequest, RoundResult
from worker.models.ratelimit import RateGate
from worker.tools import NOTES_TOOL_SPECS, NOTES_UPDATED

from benchmarks.benchlib import write_results
from shared.keys import Keys
from shared.settings import Settings
from shared.system import (
    DEFAULT_AGENT_SYSTEM,
    WORKING_NOTES_FOLD,
    SystemBlock,
    resolve_system_blocks,
)
from tests.fake_anthropic import FakeAnthropicProcess

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


def _merged(
    blocks: list[SystemBlock],
) -> tuple[SystemBlock, SystemBlock | None, SystemBlock | None]:
    """The engine's blocks as (head, notes block with its fold, skills block), unmarked."""
    head = blocks[0]
    notes = skills = None
    rest = [b["text"] for b in blocks[1:]]
    if rest and rest[0].endswith(WORKING_NOTES_FOLD):
        notes = {"type": "text", "text": rest[0] + rest[1]}
        rest = rest[2:]
    if rest:
        skills = {"type": "text", "text": rest[0]}
    return head, notes, skills  # type: ignore[return-value]


def seed_order_without_fold_breakpoint(
    persona: str | None, notes: str | None, skills: str | None
) -> list[SystemBlock]:
    """What the breakpoints were before: the head and the last block only."""
    head, notes_block, skills_block = _merged(resolve_system_blocks(persona, notes, skills))
    out = [head, *(b for b in (notes_block, skills_block) if b is not None)]
    out[-1] = {**out[-1], "cache_control": {"type": "ephemeral"}}
    return out


def skills_before_notes(
    persona: str | None, notes: str | None, skills: str | None
) -> list[SystemBlock]:
    """A what-if, not the seed's order: the skills block before the notes, a breakpoint
    after each (the notes, last, change; the skills then stay cached)."""
    head, notes_block, skills_block = _merged(resolve_system_blocks(persona, notes, skills))
    out = [head]
    for block in (skills_block, notes_block):
        if block is not None:
            out.append({**block, "cache_control": {"type": "ephemeral"}})
    return out


PLACEMENTS: dict[str, Blocks] = {
    "seed order (persona, notes, skills); breakpoints: head, fold text, last block": (
        resolve_system_blocks
    ),
    "seed order; breakpoints: head, last block (before this change)": (
        seed_order_without_fold_breakpoint
    ),
    "skills before notes (not the seed's order); breakpoints: head, skills, last block": (
        skills_before_notes
    ),
}
# A persona whose head prefix (tools, default text, persona) passes the 1,024-token
# minimum: 2 KiB makes it 932 tokens, so a session's first notes read nothing.
WHAT_IF_PERSONA_BYTES = 2560
STARTING_NOTES = "- the quarterly review is on Friday\n- figures come from the finance table"


class Session:
    """One session's rounds, built as the engine builds them."""

    def __init__(
        self,
        model: AnthropicModel,
        persona: str,
        skills: str,
        blocks: Blocks,
        notes: str | None = None,
    ) -> None:
        self.model = model
        self.persona = persona
        self.skills = skills
        self.blocks = blocks
        self.notes = notes
        self.rows: list[dict[str, Any]] = []
        self.history = SessionHistory(None, Keys("bench"), "u", "s", self.rows, [])  # type: ignore[arg-type]

    async def turn(self, prompt: str) -> list[dict[str, int]]:
        """Run a turn to its end; the usage of each of its rounds."""
        self.rows.append({"role": "user", "content": [{"type": "text", "text": prompt}]})
        usages = []
        for _ in range(24):
            system = self.blocks(self.persona, self.notes, self.skills)
            request = ModelRequest(
                system_blocks=system,
                system="".join(b["text"] for b in system),
                messages=self.history.model_messages(),
                tools=list(NOTES_TOOL_SPECS),
            )
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
                return usages
            results = []
            for use in result.tool_uses:
                if use.name == "working_notes_update":
                    self.notes = str(use.input.get("notes", ""))
                    output = NOTES_UPDATED.format(bytes=len(self.notes.encode()))
                else:
                    output = self.notes or "(empty — no working notes for this session)"
                results.append({"type": "tool_result", "tool_use_id": use.id, "content": output})
            self.rows.append({"role": "user", "content": results})
        return usages


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
    model: AnthropicModel,
    blocks: Blocks,
    seed: int,
    notes: str | None,
    persona_bytes: int = 2048,
) -> dict[str, Any]:
    persona = _text(persona_bytes, seed, "- ")
    skills = _text(4096, seed + 1, "* skill: ")
    session = Session(model, persona, skills, blocks, notes)
    per_turn = []
    every: list[dict[str, int]] = []
    for t in range(1, SESSION_TURNS + 1):
        if t in NOTES_CHANGE_AT:
            prompt = f"remember the figures of turn {t} were checked and the owner is team {t}"
        else:
            prompt = f"question {t}: what moved most in the quarterly figures, and why?"
        usages = await session.turn(prompt)
        every += usages
        per_turn.append({"turn": t, "notes_change": t in NOTES_CHANGE_AT, **share(usages)})
    return {"turns": per_turn, **share(every)}


async def run_tool_loop(model: AnthropicModel, seed: int) -> dict[str, Any]:
    session = Session(
        model, _text(2048, seed, "- "), _text(4096, seed + 1, "* skill: "), resolve_system_blocks
    )
    usages = await session.turn("check your notes 5 times, then tell me what they say")
    return {**share(usages), "after_round_1": share(usages[1:]), "per_round": usages}


async def measure() -> dict[str, Any]:
    settings = Settings(model="anthropic", anthropic_model="claude-sonnet-4-6")
    with FakeAnthropicProcess(responder="remember", min_cache_tokens=1024) as fake:
        sdk = anthropic.AsyncAnthropic(api_key=fake.api_key, base_url=fake.url)
        model = AnthropicModel(settings, client=sdk, gate=RateGate())
        try:
            # Each run's persona differs (its seed), so no run reads another's cache.
            sessions = []
            seed = 0
            for placement, blocks in PLACEMENTS.items():
                for notes in (STARTING_NOTES, None):
                    seed += 2
                    run = await run_session(model, blocks, seed, notes)
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
            await model.aclose()
            await sdk.close()
    return {
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results")
    args = parser.parse_args()
    figures = asyncio.run(measure())
    for f in [*figures["sessions"], figures["tool_loop"]]:
        what = f.get("placement", "tool loop") + (
            "; notes at start" if f.get("notes_at_start") else ""
        )
        print(f"{f['read_share']:.1%} of {f['input_tokens']} input tokens read from cache: {what}")
    print(f"wrote {write_results('bench_cache', figures, args.results_dir)}")


if __name__ == "__main__":
    main()

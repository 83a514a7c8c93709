"""Render benchmarks/results/*.json as the Markdown tables of docs/benchmarks.md.

`--write` replaces the part of docs/benchmarks.md between the ``results:begin`` and
``results:end`` markers; `--check` fails when that part differs from what the records
render (tests/test_docs.py checks the same); without either the tables go to stdout.
Run: `PYTHONPATH=. .venv/bin/python benchmarks/report.py --write` (`make bench` does).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOC = HERE.parent / "docs" / "benchmarks.md"
BEGIN = "<!-- results:begin (benchmarks/report.py --write renders this part) -->"
END = "<!-- results:end -->"


def _n(value: Any, digits: int = 0) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and digits:
        return f"{value:,.{digits}f}"
    if isinstance(value, (int, float)):
        return f"{value:,.0f}"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *(line(row) for row in rows)]


def _provenance(data: dict[str, Any]) -> list[str]:
    """One row of the records' table: where and when a record was measured."""
    machine = data.get("machine", {})
    load = machine.get("loadavg_at_start", [])
    return [
        f"`{data.get('name', '?')}`",
        f"`{data['command']}`" if "command" in data else "—",
        f"`{data['commit']}`" if "commit" in data else "—",
        str(data.get("measured_at", "—")),
        str(machine.get("cpus", "—")),
        " / ".join(str(x) for x in load) or "—",
        str(machine.get("python_loop_2m_s", "—")),
    ]


PROVENANCE_HEADER = [
    "record",
    "command",
    "commit",
    "measured at",
    "CPUs",
    "load average at start (1/5/15 min)",
    "`python_loop_2m_s`",
]


def _lat(figures: dict[str, Any] | None, key: str) -> str:
    return _n((figures or {}).get(key))


def _runs(median: Any, runs: Any) -> str:
    """A median with the runs it was taken from."""
    if not runs or len(runs) < 2:
        return _n(median, 1)
    return f"{_n(median, 1)} (median of {', '.join(_n(r, 1) for r in runs)})"


def _p50_p99(figures: dict[str, Any] | None) -> str:
    return f"{_lat(figures, 'p50_ms')} / {_lat(figures, 'p99_ms')}"


def _ratio(r: dict[str, Any] | None) -> str:
    return f"{r.get('p50', '—')} / {r.get('p99', '—')}" if r else "—"


def _not_completed(s: dict[str, Any]) -> int:
    return sum(v for k, v in s.get("outcomes", {}).items() if k != "turn.completed")


def _redis_cpu_us(s: dict[str, Any], kind: str) -> str:
    cpu = s.get("cpu_s_per_turn", {})
    return _n(1e6 * cpu[kind], 0) if kind in cpu else "—"


# A column of a scenario table: its title, and its cell from the scenario's figures.
Column = tuple[str, Callable[[dict[str, Any]], str]]

SESSIONS: Column = ("sessions", lambda s: _n(s.get("sessions", s.get("turns"))))
COMPLETED: Column = ("completed", lambda s: _n(s.get("turns_completed")))
TO_TERMINAL: Column = (
    "submit→terminal p50 / p99 ms",
    lambda s: _p50_p99(s.get("submit_to_terminal")),
)
MODEL_TIME: Column = ("model's own time ms", lambda s: _lat(s.get("model_own_time"), "p50_ms"))
RATIO: Column = ("÷ model time p50 / p99", lambda s: _ratio(s.get("ratio_to_model_time")))
NOT_COMPLETED: Column = ("not completed", lambda s: _n(_not_completed(s)))
HTTP_503: Column = ("503s", lambda s: _n(s.get("http_503")))
REDIS_COMMANDS: Column = ("Redis cmds/turn", lambda s: _n(s.get("redis_commands_per_turn"), 1))
ROUND_TRIPS: Column = (
    "Redis round trips/turn",
    lambda s: _n(s.get("redis_round_trips_per_turn"), 2),
)
CPU_WORKERS_GATEWAY: Column = (
    "CPU s/turn (workers+gateway)",
    lambda s: _n(s.get("cpu_s_per_turn_workers_gateway"), 4),
)


def _scenario_table(
    lead: list[str], columns: list[Column], rows: list[tuple[list[str], dict[str, Any]]]
) -> list[str]:
    """A table of scenarios: the ``lead`` columns' cells as given in each row, then
    ``columns`` of the row's figures."""
    return _table(
        [*lead, *(title for title, _ in columns)],
        [[*cells, *(cell(s) for _, cell in columns)] for cells, s in rows],
    )


def render_load(data: dict[str, Any]) -> list[str]:
    out = ["### bench_load", ""]
    profile = data.get("profile", {})
    out += [
        f"Model profile: time to first token {profile.get('ttft_ms')} ms, "
        f"{profile.get('tokens_per_s')} tokens/s, {profile.get('rounds')} rounds "
        f'("remember …"); {data.get("workers")} workers; the clients run {data.get("client", "two requests per turn")}.',
        "",
    ]
    scenarios: dict[str, Any] = data.get("scenarios", {})
    out += _scenario_table(
        ["scenario"],
        [
            SESSIONS,
            COMPLETED,
            ("turns/s", lambda s: _n(s.get("turns_per_s"), 1)),
            TO_TERMINAL,
            MODEL_TIME,
            RATIO,
            NOT_COMPLETED,
            HTTP_503,
            ("429s", lambda s: _n(s.get("http_429"))),
            ("abandoned", lambda s: _n(s.get("abandoned"))),
            REDIS_COMMANDS,
            ROUND_TRIPS,
            CPU_WORKERS_GATEWAY,
        ],
        [([name], s) for name in ("load", "delivery", "noop") if (s := scenarios.get(name))],
    )
    out.append("")
    notes = []
    for name in ("load", "delivery", "noop"):
        s = scenarios.get(name)
        if s and s.get("outcomes") and _not_completed(s):
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(s["outcomes"].items()))
            notes.append(f"- {name}: client outcomes {kinds}")
            if s.get("after_refollow"):
                again = ", ".join(f"{k} {v}" for k, v in sorted(s["after_refollow"].items()))
                notes.append(f"  (turns whose stream the client lost, followed again: {again})")
    out += [*notes, ""] if notes else []

    d = scenarios.get("delivery")
    if d:
        ev = d.get("event_delivery", {})
        out += _table(
            ["event delivery (worker append → SSE client)", "events", "p50 ms", "p99 ms", "max ms"],
            [
                [
                    f"{_n(d.get('turns'))} turns streaming at once",
                    _n(ev.get("n")),
                    _n(ev.get("p50_ms"), 1),
                    _runs(ev.get("p99_ms"), d.get("runs_event_delivery_p99_ms")),
                    _n(ev.get("max_ms"), 1),
                ]
            ],
        )
        out.append("")
        if d.get("events_caught_up_not_timed"):
            out += [
                f"Timed: the events appended after their client asked for the stream; "
                f"{_n(d.get('events_caught_up_not_timed'))} stored before that came by "
                "catch-up and are not timed.",
                "",
            ]
    n = scenarios.get("noop")
    if n and n.get("arq"):
        arq = n["arq"]
        out += _table(
            [
                "no model latency",
                "turnbus turns/s",
                "arq no-op jobs/s (same run, same Redis)",
                "ratio",
            ],
            [
                [
                    f"{_n(n.get('sessions'))} sessions × {_n(n.get('turns_per_session'))} "
                    f'"remember" turns vs {_n(arq.get("jobs"))} arq jobs '
                    f"({arq.get('workers')} workers × {arq.get('max_jobs_per_worker')} at once, "
                    f"arq {arq.get('arq_version')})",
                    _runs(n.get("turns_per_s"), n.get("runs_turns_per_s")),
                    _runs(arq.get("jobs_per_s"), arq.get("runs_jobs_per_s")),
                    f"{n.get('ratio_to_arq')}×",
                ]
            ],
        )
        out.append("")
    f = scenarios.get("flood")
    if f:
        wait = f.get("other_turn_submit_to_started", {})
        out += _table(
            ["flooded session", "other users' turns", "submit→turn.started p50 ms", "max ms"],
            [
                [
                    f"{_n(f.get('queued_accepted'))} of {_n(f.get('queued_in_one_session'))} "
                    "turns queued in one session",
                    _n(wait.get("n")),
                    _n(wait.get("p50_ms"), 1),
                    _n(wait.get("max_ms"), 1),
                ]
            ],
        )
        out.append("")
    return out


def render_turns(data: dict[str, Any]) -> list[str]:
    out = ["### bench_turns", ""]
    t = data.get("throughput", {})
    lat = t.get("submit_to_completed", {})
    c = data.get("cancel", {}).get("cancel_to_cancelled", {})
    fan = t.get("fan_out", {})
    rows = [
        [
            f'{_n(t.get("turns"))} "remember" turns over {_n(t.get("sessions"))} sessions, '
            "all submitted at once",
            f"{_n(t.get('turns_per_s'), 1)} turns/s; submit→completed p50 "
            f"{_n(lat.get('p50_ms'))} ms, p99 {_n(lat.get('p99_ms'))} ms",
        ],
        [
            "cancel mid-stream → `turn.cancelled` at the SSE client (target 250 ms)",
            f"p50 {_n(c.get('p50_ms'), 1)} ms, p99 {_n(c.get('p99_ms'), 1)} ms (n {_n(c.get('n'))})",
        ],
        [
            f"{_n(fan.get('followers'))} SSE followers of one turn",
            f"all saw its terminal event {_n(fan.get('all_saw_the_end_ms'))} ms after connecting",
        ],
    ]
    return [*out, *_table(["figure", "value"], rows), ""]


def render_envelope(data: dict[str, Any]) -> list[str]:
    out = ["### bench_envelope", ""]
    rows = [
        [label, _n(v.get("ops_per_s"))]
        for label, v in data.items()
        if isinstance(v, dict) and "ops_per_s" in v
    ]
    caption = (
        f"ops/s ({_n(data.get('concurrency'))} concurrent callers, "
        f"{_n(data.get('sessions'))} sessions)"
    )
    return [*out, *_table(["operation", caption], rows), ""]


def render_sdk(data: dict[str, Any]) -> list[str]:
    """bench_load's sdk scenario: the real model path in one worker beside the scripted."""
    s = data["scenarios"]["sdk"]
    profile = s.get("profile", {})
    out = ["### bench_load --scenario sdk", ""]
    out += [
        f"One worker process per model; the fake Messages API (sdk: the Anthropic client) "
        "and the fake Chat Completions API (openai: the OpenAI-compatible client), each in "
        "a process of its own, "
        f"paced like the API (time to first token {_n(profile.get('ttft_s'), 1)} s, "
        f"{profile.get('tokens_per_s')} tokens/s, {profile.get('text_words_per_delta')} words "
        'per text delta); the "remember" turn, two rounds. Each step runs the scripted '
        "stack, then each SDK stack, turn about.",
        "",
    ]
    rows = []
    for step in s.get("levels", []):
        for kind in ("scripted", "sdk", "openai"):
            if kind not in step:
                continue
            k = step.get(kind, {})
            ratio = step.get(f"cpu_ratio_{kind}_to_scripted")
            rows.append(
                [
                    _n(step.get("concurrent_turns")),
                    kind,
                    _n(k.get("turns_completed")),
                    _p50_p99(k.get("submit_to_terminal")),
                    _lat(k.get("model_own_time"), "p50_ms"),
                    _ratio(k.get("ratio_to_model_time")),
                    _n(k.get("worker_cpu_ms_per_turn"), 2),
                    _n(k.get("model_events_per_turn"), 1),
                    _n(k.get("worker_cpu_us_per_model_event"), 1),
                    f"{ratio}×" if kind != "scripted" else "",
                ]
            )
    out += _table(
        [
            "turns at once",
            "model",
            "completed",
            "submit→terminal p50 / p99 ms",
            "model's own time ms",
            "÷ model time p50 / p99",
            "worker CPU ms/turn",
            "model events/turn",
            "worker CPU µs/model event",
            "CPU ÷ scripted",
        ],
        rows,
    )
    holds = s.get("holds_within_1_5x_p50", {})
    out += [
        "",
        f"One worker process holds {_n(holds.get('sdk'))} Anthropic turns at once, "
        f"{_n(holds.get('openai'))} OpenAI-compatible ones "
        f"({_n(holds.get('scripted'))} scripted) with its p50 within 1.5× the model's time "
        "(the largest step that did). CPU per turn ÷ per scripted turn: median "
        f"{s.get('cpu_ratio_sdk_to_scripted_median')}× (Anthropic), "
        f"{s.get('cpu_ratio_openai_to_scripted_median')}× (OpenAI-compatible); target "
        f"{s.get('cpu_ratio_target')}×. Model events: the SSE events the fake sent (SDK), "
        "the text deltas the scripted model yielded.",
        "",
    ]
    return out


def render_tools(data: dict[str, Any]) -> list[str]:
    """bench_load's tools scenario: a side-effecting Python tool call beside the turns
    without one, each on a fresh stack."""
    s = data["scenarios"]["tools"]
    tool_ms = s.get("tool_ms")
    sessions = (s.get("load") or {}).get("sessions")
    out = ["### bench_load --scenario tools", ""]
    out += [
        f"{data.get('workers')} workers; {_n(sessions)} sessions each sending one turn at "
        "once, three fresh stacks in turn: the load turn, a turn of the same shape that "
        f"calls only a notes tool, and one that calls `wait_50ms`, a {tool_ms} ms Python "
        "tool (benchmarks/tools_50ms.py). Read the three side by side, not against the "
        "other sections: they share one run and one machine.",
        "",
    ]
    out += _scenario_table(
        ["turn"],
        [
            COMPLETED,
            TO_TERMINAL,
            ("model's own time p50 ms", lambda k: _lat(k.get("model_own_time"), "p50_ms")),
            RATIO,
            ("Redis commands/turn", REDIS_COMMANDS[1]),
            ROUND_TRIPS,
        ],
        [
            ([label], k)
            for key, label in (
                ("load", 'load ("remember")'),
                ("notes_call", "a notes-tool call"),
                ("tools", f"a {tool_ms} ms Python tool call"),
            )
            if (k := s.get(key))
        ],
    )
    call = s.get("per_call")
    if call:
        ratio, target = call.get("p50_ratio_to_model_plus_tool"), call.get("target_ratio_p50")
        met = (
            "" if ratio is None or target is None else (": met" if ratio <= target else ": not met")
        )
        out += [
            "",
            "The tool turn and the notes-tool turn have the same shape (round 1 calls the "
            "tool, round 2 answers with its result); the tool turn adds the "
            f"{tool_ms} ms call, the intent write before it and the result write after it "
            "(`wait_50ms` is side-effecting). Per call, against the notes-tool turn: "
            f"**{_n(call.get('added_latency_p50_ms'), 1)} ms** of added latency at p50 "
            f"beyond the {tool_ms} ms the tool takes; the tool turn's p50 is "
            f"{ratio}× the model's time plus the tool's (target {target}×{met}); "
            f"**{_n(call.get('redis_commands'), 1)} Redis commands** (the two scripts and "
            "the commands inside them) in **2 calls** to Redis (the intent and the "
            "result), which share the worker's multiplexed writes with the other turns': "
            f"{call.get('redis_round_trips')} Redis round trips per turn against the "
            "notes-tool turn on this run.",
        ]
    return [*out, ""]


def _held_by(p: dict[str, Any]) -> str:
    """How long the held answers waited past 1 s, and how far apart they went."""
    by = (p.get("answers_held_by") or {}).get("max_ms")
    if not by:
        return ""
    return (
        f", each by {by:,.0f} ms, sent within {p.get('answers_sent_within_s')} s of "
        "each other as the pauses came"
    )


def render_pause(data: dict[str, Any]) -> list[str]:
    """bench_load's pause scenario: turns waiting for their caller, then answered."""
    s = data["scenarios"]["pause"]
    p = s.get("pause", {})
    waiting = p.get("while_all_wait", {})
    out = ["### bench_load --scenario pause", ""]
    out += [
        f"{_n(s.get('sessions'))} sessions, each turn pausing once for a client tool "
        f"(`turn.requires_action`); each client answers {p.get('answer_after_s')} s after "
        f"it sees the pause ({_n(p.get('turns_paused'))} paused, seen within "
        f"{p.get('pauses_seen_within_s')} s of each other; "
        f"{_n(p.get('answers_held_for_the_state'))} answers held until the state below "
        f"was taken{_held_by(p)}); {data.get('workers')} workers.",
        "",
    ]
    resident = waiting.get("workers_resident_mib", {})
    idle = p.get("workers_resident_mib_idle", {})
    out += _table(
        [
            "while every turn waits",
            "turns waiting",
            "workers' resident memory MiB (before the turns)",
            "session leases open",
            "turns running (run slots held; target 0)",
            "work entries in flight",
        ],
        [
            [
                f"{_n(s.get('sessions'))} sessions",
                _n(waiting.get("turns_waiting")),
                ", ".join(
                    f"{_n(mib, 1)} ({_n(idle.get(name), 1)})" for name, mib in resident.items()
                )
                or "—",
                _n(waiting.get("session_leases_open")),
                _n(waiting.get("turns_running")),
                _n(waiting.get("entries_in_flight")),
            ]
        ],
    )
    out.append("")
    out += _pause_rates(p)
    out += [
        "",
        f"Turns completed {_n(s.get('turns_completed'))} of {_n(s.get('turns_accepted'))}; "
        f"Redis commands per turn {_n(s.get('redis_commands_per_turn'), 1)}, round trips "
        f"{_n(s.get('redis_round_trips_per_turn'), 2)}. Latencies run from just before the "
        "answer's request; the answer window from the first answer to the last resumed "
        "turn's next round. Turns sent at once pause within a fraction of a second of each "
        "other, so their answers come as fast, and in clumps (the workers start turns in "
        "batches, so the pauses are written in clumps): a clump of a hundred answers is "
        "tens of ms of both cores, and the p99 is the wait behind it. A resume is one call "
        "to Redis before the model is asked (the start script announces the next round), "
        "and an answer that opens a connection is accepted at once, not behind the "
        "others' (docs/architecture.md, the gateway's `connections`). Sent across a few "
        "seconds, the answers come slower, and the window also holds the second rounds "
        "(their text streaming) of the turns resumed first, so its CPU per answer is higher.",
        "",
    ]
    return out


_PAUSE_LATENCIES = ("answer_accepted", "answer_to_turn_started", "answer_to_next_round")


def _pause_rates(p: dict[str, Any]) -> list[str]:
    """The pause scenario's runs, at the answer rate each gave: latencies, CPU."""
    window = p.get("answer_window") or {}
    runs = p.get("by_answer_rate") or [
        {
            "submits_spread_s": p.get("submits_spread_s", 0),
            "answers_per_s": window.get("answers_per_s"),
            "cores_busy": window.get("cores_busy"),
            "cpu_ms_per_answer": window.get("cpu_ms_per_answer"),
            **{key: p.get(key) for key in _PAUSE_LATENCIES},
            "runs_answer_to_next_round_p99_ms": p.get("runs_answer_to_next_round_p99_ms"),
        }
    ]
    processes = ("gateway", "workers", "redis", "load_generator")
    rows = []
    for run in runs:
        cpu = run.get("cpu_ms_per_answer") or {}
        nxt = run.get("answer_to_next_round") or {}
        spread = run.get("submits_spread_s")
        rows.append(
            [
                f"across {spread} s" if spread else "at once",
                _n(run.get("answers_per_s")),
                *(
                    f"{_n(f.get('p50_ms'), 1)} / {_n(f.get('p99_ms'), 1)}"
                    for f in (run.get(key) or {} for key in _PAUSE_LATENCIES[:2])
                ),
                f"{_n(nxt.get('p50_ms'), 1)} / "
                + _runs(nxt.get("p99_ms"), run.get("runs_answer_to_next_round_p99_ms")),
                " / ".join(_n(cpu.get(k), 2) for k in processes) if cpu else "—",
                _n(run.get("cores_busy"), 2),
                _clumps(run),
            ]
        )
    return _table(
        [
            "turns sent",
            "answers/s",
            "to its 202, p50 / p99 ms",
            "to the resumed `turn.started`",
            "to the next `round.started` (target p99 < 100 ms)",
            "CPU ms per answer: gateway / workers / Redis / load generator",
            "cores busy (of 2)",
            "most answers within 25 ms; mean ms to the next round, by fifth of the window",
        ],
        rows,
    )


def _clumps(run: dict[str, Any]) -> str:
    """The answers' largest clump and the wait's rise across the window."""
    fifths = run.get("to_next_round_mean_ms_by_fifth")
    if not fifths:
        return "—"
    rise = " → ".join(_n(v, 0) for v in fifths)
    return f"{_n(run.get('most_answers_within_25_ms'))}; {rise}"


def _read_share(figures: dict[str, Any] | None) -> str:
    share = (figures or {}).get("read_share")
    return "—" if share is None else f"{share * 100:.1f} %"


def render_cache(data: dict[str, Any]) -> list[str]:
    out = ["### bench_cache", ""]
    p = data.get("profile", {})
    sessions = data.get("sessions", [])
    engine = [f for f in sessions if f.get("every_block")]
    by_notes = {bool(f.get("notes_at_start")): f for f in engine}
    other_order = {
        bool(f.get("notes_at_start")): f
        for f in sessions
        if str(f.get("placement", "")).startswith("skills before notes")
    }
    t = data.get("tool_loop", {})
    target = f"{(data.get('target_read_share') or 0) * 100:.0f} %"
    out += [
        f"A {_n(p.get('turns'))}-turn session, {_n(p.get('persona_bytes'))} B persona, "
        f'{_n(p.get("skills_bytes"))} B of skills, "remember" turns (a notes write) at '
        f"{', '.join(str(t) for t in p.get('notes_change_at_turns', []))}; the fake API "
        f"counts the cache as the API does (a prefix under {_n(p.get('min_cache_tokens'))} "
        "tokens is not cached). Share = tokens read from the cache ÷ all input tokens, the "
        "cold first turn included.",
        "",
    ]
    out += _table(
        [
            "share of input tokens read from the cache",
            "the engine (seed order)",
            "most any placement could read",
            "skills before notes",
            f"target {target}",
        ],
        [
            [
                "session, notes from turn 1, changed at 3 and 7",
                _read_share(by_notes.get(True)),
                _read_share((by_notes.get(True) or {}).get("every_block")),
                _read_share(other_order.get(True)),
                "met" if ((by_notes.get(True) or {}).get("read_share") or 0) >= 0.8 else "not met",
            ],
            [
                "session, notes first written at 3, changed at 7",
                _read_share(by_notes.get(False)),
                _read_share((by_notes.get(False) or {}).get("every_block")),
                _read_share(other_order.get(False)),
                "met" if ((by_notes.get(False) or {}).get("read_share") or 0) >= 0.8 else "not met",
            ],
            [
                f"the tool rounds (2–{_n(t.get('rounds'))}) of one turn of "
                f"{_n(t.get('rounds'))} rounds; the whole turn, its cold first round "
                f"included: {_read_share(t)}",
                _read_share(t.get("after_round_1")),
                "",
                "",
                "",
            ],
        ],
    )
    openai = data.get("openai")
    if openai:
        by = {bool(f.get("notes_at_start")): f for f in openai.get("sessions", [])}
        loop = openai.get("tool_loop", {})
        out += [
            "",
            "The OpenAI-compatible client, the same sessions and tool loop (the engine's "
            "order: the stable prefix first) against the fake Chat Completions API, which "
            f"counts the cache as OpenAI documents it ({openai.get('cache')}). Share = "
            "`cached_tokens` ÷ `prompt_tokens`.",
            "",
        ]
        out += _table(
            ["OpenAI-compatible", "share of prompt tokens cached"],
            [
                ["session, notes from turn 1, changed at 3 and 7", _read_share(by.get(True))],
                ["session, notes first written at 3, changed at 7", _read_share(by.get(False))],
                ["one turn of a tool loop, whole", _read_share(loop)],
                ["its tool rounds", _read_share(loop.get("after_round_1"))],
            ],
        )
    return [*out, ""]


def render_cluster_client(data: dict[str, Any]) -> list[str]:
    out = ["### bench_cluster_client", ""]
    shape, versions = data.get("cluster") or {}, data.get("versions") or {}
    if shape:
        libraries = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
        out += [
            f"{shape.get('masters')} masters, {shape.get('replicas')} replicas, Redis "
            f"{shape.get('redis_server')}; {data.get('event_loop')}; "
            f"{data.get('pool_size_per_node')} pooled connections per node; {libraries}.",
            "",
        ]
    rows = [
        [
            name,
            _runs(row.get("turns_per_s"), row.get("turns_per_s_runs")),
            _n(row.get("client_cpu_us_per_turn"), 1),
        ]
        for name, row in (data.get("clients") or {}).items()
    ]
    caption = (
        f"turns/s ({_n(data.get('turns'))} turns, {_n(data.get('concurrency'))} sessions "
        "at once, 3-master cluster)"
    )
    return [*out, *_table(["client", caption, "client CPU µs per turn"], rows), ""]


def render_load_cluster(data: dict[str, Any]) -> list[str]:
    """bench_load --cluster: each scenario on one Redis and on the cluster, then per node."""
    out = ["### bench_load --cluster", ""]
    shards = (data.get("cluster") or {}).get("shards")
    out += [
        f"The cluster: 3 masters with a replica each (turnbus.local_cluster), "
        f"TURNBUS_SHARDS={shards}; one Redis: `turnbus up`'s own, TURNBUS_SHARDS=1. "
        f"{data.get('workers')} workers; the clients run {data.get('client')}. "
        "Redis figures are the masters' (on one Redis, its own); a replica's CPU is "
        "beside them.",
        "",
    ]
    return [*out, *_render_sides(data, ("one_redis", "cluster"))]


def render_load_replica(data: dict[str, Any]) -> list[str]:
    """bench_load --replica: each scenario with each TURNBUS_WAIT_REPLICAS, then per node."""
    out = ["### bench_load --replica", ""]
    waits = (data.get("replica") or {}).get("wait_replicas") or [0, 1]
    out += [
        "A primary with one replica (AOF everysec, as `turnbus up` starts its own), "
        f'TURNBUS_WAIT_REPLICAS as in the "on" column; {data.get("workers")} workers; '
        f"the clients run {data.get('client')}. Redis figures are the primary's; the "
        "replica's CPU is beside them.",
        "",
    ]
    return [*out, *_render_sides(data, tuple(f"wait_replicas_{n}" for n in waits))]


def render_load_otel(data: dict[str, Any]) -> list[str]:
    """bench_load --otel: noop with tracing off and on, turn about, and what on costs."""
    out = ["### bench_load --otel", ""]
    otel = data.get("otel", {})
    rows = []
    for side in ("off", "on"):
        s = data.get("scenarios", {}).get(f"noop_otel_{side}")
        if s is None:
            continue
        otlp = s.get("otlp", {})
        sink_cpu = otlp.get("sink_cpu_s_per_turn")
        rows.append(
            [
                side,
                _n(s.get("turns_completed")),
                _runs(s.get("turns_per_s"), s.get("runs_turns_per_s")),
                _n(otel.get(f"cpu_s_per_turn_workers_gateway_{side}"), 4),
                _n(otlp.get("spans_per_turn"), 1),
                _n(otlp.get("bytes_per_turn")),
                _n(None if sink_cpu is None else 1e6 * sink_cpu),
                _n(_not_completed(s)),
            ]
        )
    out += _table(
        [
            "tracing",
            "completed",
            "turns/s",
            "CPU s/turn (workers+gateway, median)",
            "spans/turn at the sink",
            "OTLP bytes/turn",
            "sink CPU µs/turn",
            "not completed",
        ],
        rows,
    )
    if otel:
        out += [
            "",
            f"{data.get('workers')} workers, {otel.get('repeats')} runs of each side, "
            f"turn about. On costs {_n(otel.get('on_throughput_cost_pct'), 1)} % of "
            f"turns/s (the off runs spread over {_n(otel.get('off_runs_spread_pct'), 1)} % "
            f"of their median) and {_n(otel.get('on_cpu_us_per_turn'))} µs of workers' "
            f"and gateway's CPU per turn ({_n(otel.get('on_cpu_cost_pct'), 1)} %).",
        ]
    return [*out, ""]


def _render_sides(data: dict[str, Any], sides: tuple[str, ...]) -> list[str]:
    """Each scenario on each side, then per node."""
    out: list[str] = []
    scenarios: dict[str, Any] = data.get("scenarios", {})
    out += _scenario_table(
        ["scenario", "on"],
        [
            SESSIONS,
            COMPLETED,
            ("turns/s", lambda s: _runs(s.get("turns_per_s"), s.get("runs_turns_per_s"))),
            TO_TERMINAL,
            NOT_COMPLETED,
            HTTP_503,
            REDIS_COMMANDS,
            ROUND_TRIPS,
            ("Redis CPU µs/turn", lambda s: _redis_cpu_us(s, "redis")),
            ("replicas' CPU µs/turn", lambda s: _redis_cpu_us(s, "redis_replicas")),
            CPU_WORKERS_GATEWAY,
        ],
        [
            ([name, where.replace("_", " ")], s)
            for name in ("load", "noop")
            for where in sides
            if (s := scenarios.get(f"{name}_{where}"))
        ],
    )
    return [*out, ""]


def render_faults(data: dict[str, Any]) -> list[str]:
    """bench_faults: a reset with replies in flight, and a master SIGKILLed, under load."""
    out = ["### bench_faults", ""]
    profile = data.get("profile") or {}
    out += [
        f"{data.get('workers')} workers, the scripted model at TTFT "
        f"{profile.get('ttft_ms')} ms and {profile.get('tokens_per_s')} tokens/s; each "
        f"session sends its next turn when its last ended; the fault after "
        f"{data.get('warm_s')} s of load, the load kept {data.get('after_s')} s after it.",
        "",
    ]
    scenarios: dict[str, Any] = data.get("scenarios", {})
    if reset := scenarios.get("reset"):
        end = reset.get("reset_to_in_flight_end") or {}
        out += _table(
            [
                "reset",
                "turns",
                "in flight at the reset",
                "reset → their end p50 / max ms (target 10 s)",
                "lost",
                "doubled",
                "second attempts",
                "workers alive at the end",
            ],
            [
                [
                    f"{_n(reset.get('sessions'))} sessions",
                    _n(reset.get("turns_accepted")),
                    _n(reset.get("in_flight_at_reset")),
                    f"{_n(end.get('p50_ms'))} / {_n(end.get('max_ms'))}",
                    _n(reset.get("lost")),
                    _n(reset.get("doubled")),
                    _n(reset.get("second_attempts")),
                    f"{_n(reset.get('workers_alive_at_end'))} of {data.get('workers')}",
                ]
            ],
        )
        out.append("")
    rows = []
    for name, s in scenarios.items():
        if not name.startswith("failover_wait_replicas_"):
            continue
        waits = s.get("accepted_to_started") or {}
        rows.append(
            [
                name.removeprefix("failover_wait_replicas_"),
                _n(s.get("sessions")),
                _n(s.get("turns_accepted")),
                _n(s.get("kill_to_takeover_ms")),
                f"{_n(waits.get('p50_ms'))} / {_n(waits.get('p99_ms'))} / "
                f"{_n(waits.get('max_ms'))}",
                _n(s.get("accepted_to_started_over_target")),
                _n(s.get("lost")),
                _n(s.get("doubled")),
                _n(s.get("http_503")),
                _n((s.get("worker_log_lines") or {}).get("cancel_subscription")),
            ]
        )
    if rows:
        out += _table(
            [
                "failover: TURNBUS_WAIT_REPLICAS",
                "sessions",
                "turns",
                "kill → takeover ms",
                "202 → turn.started p50 / p99 / max ms (target max 10 s)",
                "over 10 s",
                "lost",
                "doubled",
                "503s",
                "log lines about the cancel subscription",
            ],
            rows,
        )
        out.append("")
    return out


def render_model_client(data: dict[str, Any]) -> list[str]:
    """bench_model_client: the Anthropic client alone, the SDK's post against DirectPost."""
    runs = data.get("cpu_ms_per_turn_runs") or {}
    median = data.get("cpu_ms_per_turn_median") or {}
    profile = data.get("profile") or {}
    out = ["### bench_model_client", ""]
    out += _table(
        [
            f"{_n(data.get('turns_at_once'))} two-round turns at once, TTFT "
            f"{profile.get('ttft_s')} s, {profile.get('tokens_per_s')} tokens/s",
            "client CPU ms/turn, median (passes)",
        ],
        [
            [label, f"{_n(median.get(key), 2)} ({', '.join(_n(r, 2) for r in runs.get(key, []))})"]
            for key, label in (
                ("sdk_post", "the SDK's `client.post`"),
                ("direct", "the request built once (`DirectPost`, what the worker sends)"),
            )
        ],
    )
    return [*out, "", f"Built once ÷ through the SDK: {data.get('direct_to_sdk_post')}×.", ""]


def render_openai_parse(data: dict[str, Any]) -> list[str]:
    """bench_openai_parse: the openai SDK's stream parser against the worker's reader."""
    return [
        "### bench_openai_parse",
        "",
        f"{_n(data.get('streams'))} streams of {_n(data.get('events_per_stream'))} "
        "Chat Completions chunks, CPU µs per chunk: the `openai` SDK's parser "
        f"{_n(data.get('sdk_parser_cpu_us_per_event'), 1)}, the worker's lean reader "
        f"{_n(data.get('lean_reader_cpu_us_per_event'), 2)} "
        f"({data.get('sdk_over_lean')}× less).",
        "",
    ]


def render_redis_instr(data: dict[str, Any]) -> list[str]:
    """bench_redis_instr: Redis's instructions per turn and per script call."""
    commands = data.get("commands_per_turn") or {}
    by_count = sorted(commands.items(), key=lambda kv: (-kv[1], kv[0]))
    out = [
        "### bench_redis_instr",
        "",
        f'{_n(data.get("turns"))} "remember" turns, no model delay: '
        f"**{_n(data.get('redis_instructions_per_turn'))}** Redis instructions and "
        f"{_n(data.get('redis_commands_per_turn'), 1)} commands per turn ("
        + ", ".join(f"{name} {_n(n, 1) if n % 1 else _n(n)}" for name, n in by_count)
        + ").",
        "",
    ]
    out += _table(
        ["script", "calls", "instructions per call (median)"],
        [
            [f"`{name}`", _n(v.get("calls")), _n(v.get("median_instructions"))]
            for name, v in (data.get("scripts") or {}).items()
        ],
    )
    return [*out, ""]


def render_hub_instr(data: dict[str, Any]) -> list[str]:
    """bench_hub_instr: Redis's instructions per event delivered, per way of following."""
    out = [
        "### bench_hub_instr",
        "",
        f"{_n(data.get('streams_followed'))} streams followed, "
        f"{_n(data.get('active_per_wave'))} written per wave, {_n(data.get('waves'))} "
        "waves; `none` is the writes alone.",
        "",
    ]
    out += _table(
        ["hub", "events", "Redis instructions/event", "of them the hub's", "round trips"],
        [
            [
                f"`{mode}`",
                _n(r.get("events")),
                _n(r.get("instructions_per_event")),
                _n(r.get("hub_instructions_per_event")),
                _n(r.get("round_trips")),
            ]
            for mode, r in (data.get("runs") or {}).items()
        ],
    )
    return [*out, ""]


def render_flood_user(data: dict[str, Any]) -> list[str]:
    """bench_load's flood_user scenario: one user's flood against the quotas."""
    s = data["scenarios"]["flood_user"]
    wait = s.get("other_turn_submit_to_started") or {}
    quotas = ", ".join(f"{k}={v}" for k, v in (s.get("quotas") or {}).items())
    out = ["### bench_load --scenario flood_user", ""]
    out += _table(
        [
            f"one user's flood ({quotas})",
            "accepted",
            "refused `429 quota_exceeded`",
            "other users' turns",
            f"their submit→turn.started p50 / max ms (target {_n(s.get('target_ms'))})",
        ],
        [
            [
                f"{_n(s.get('flood_turns_sent'))} turns over {_n(s.get('flood_sessions'))} "
                "sessions",
                _n(s.get("flood_accepted")),
                _n(s.get("flood_refused_quota_exceeded")),
                _n(wait.get("n")),
                f"{_n(wait.get('p50_ms'), 1)} / {_n(wait.get('max_ms'), 1)}",
            ]
        ],
    )
    return [*out, ""]


def _medians(medians: dict[str, Any]) -> str:
    """A turn-about record's medians: ``what old → new unit`` for each figure."""
    return "; ".join(
        f"{name} {_n(m.get('old'), 2)} → {_n(m.get('new'), 2)}"
        + (f" {m['unit']}" if m.get("unit") else "")
        for name, m in medians.items()
        if isinstance(m, dict) and "old" in m
    )


def render_comparisons(records: dict[str, dict[str, Any]]) -> list[str]:
    """The turn-about records: one change measured against the code before it."""
    rows = []
    for name, data in records.items():
        medians = data.get("medians") or next(
            (v["medians"] for v in data.values() if isinstance(v, dict) and "medians" in v), {}
        )
        summary = _medians(medians) or "; ".join(
            f"{side}: " + ", ".join(f"{k} {_n(v, 1)}" for k, v in m.items())
            for side, m in medians.items()
            if isinstance(m, dict)
        )
        what = data.get("what") or data.get("command") or f"`turn_about.sh {data.get('old')}`"
        rows.append([f"`{name}`", str(what), summary or f"{len(data.get('runs') or [])} runs"])
    return _table(["record", "what it compares", "medians (old → new)"], rows)


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "bench_load": render_load,
    "bench_turns": render_turns,
    "bench_envelope": render_envelope,
    "bench_cache": render_cache,
    "bench_model_client": render_model_client,
    "bench_openai_parse": render_openai_parse,
    "bench_cluster_client": render_cluster_client,
    "bench_load_cluster": render_load_cluster,
    "bench_load_replica": render_load_replica,
    "bench_load_otel": render_load_otel,
    "bench_faults": render_faults,
    "bench_redis_instr": render_redis_instr,
    "bench_hub_instr": render_hub_instr,
}


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    data.setdefault("name", path.stem)
    return data


def _scenario_figures(scenario: str, results: Path) -> dict[str, Any] | None:
    """The newest figures of one scenario: from the full run, or from a run of that
    scenario alone (``bench_load_<scenario>.json``)."""
    found = []
    for name in ("bench_load", f"bench_load_{scenario}"):
        path = results / f"{name}.json"
        if path.exists():
            data = _load(path)
            if scenario in data.get("scenarios", {}):
                found.append(data)
    return max(found, key=lambda d: str(d.get("measured_at", ""))) if found else None


# Rendered after bench_load, each from its newest figures.
SCENARIO_RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "sdk": render_sdk,
    "tools": render_tools,
    "pause": render_pause,
    "flood_user": render_flood_user,
}

# The turn-about records (benchmarks/turn_about.sh, and runs alternated by hand).
COMPARISONS = ("turn_about", "hub_")


def render(results: Path = RESULTS) -> str:
    """The Markdown of every record in ``results``: where each was measured, then its
    figures. Raises ValueError when a record is one no renderer reads."""
    sections: list[str] = []
    measured: list[dict[str, Any]] = []
    read: set[str] = set()
    for name, renderer in RENDERERS.items():
        path = results / f"{name}.json"
        if path.exists():
            data = _load(path)
            measured.append(data)
            read.add(path.name)
            sections += renderer(data)
        if name == "bench_load":
            for scenario, render_scenario in SCENARIO_RENDERERS.items():
                read.add(f"bench_load_{scenario}.json")
                if (figures := _scenario_figures(scenario, results)) is not None:
                    if figures not in measured:
                        measured.append(figures)
                    sections += render_scenario(figures)
    comparisons = {
        path.stem: _load(path)
        for path in sorted(results.glob("*.json"))
        if path.stem.startswith(COMPARISONS)
    }
    read.update(f"{name}.json" for name in comparisons)
    if comparisons:
        render_comparisons(comparisons)  # each must render: `--comparisons` prints them
        names = ", ".join(f"`{name}`" for name in comparisons)
        sections += [
            "### Turn-about records",
            "",
            f"One change measured against the code before it, alternating: {names} "
            "(`benchmarks/report.py --comparisons` prints their medians).",
            "",
        ]
    unread = sorted(p.name for p in results.glob("*.json") if p.name not in read)
    if unread:
        raise ValueError(f"no renderer reads {', '.join(unread)}: add one to report.py")
    lines = [
        "Where each record was measured (`python_loop_2m_s`: the seconds a 2-million-step "
        "Python loop took at the start, the machine's speed at that moment):",
        "",
        *_table(PROVENANCE_HEADER, [_provenance(d) for d in measured]),
        "",
        *sections,
    ]
    return "\n".join(lines).rstrip() + "\n"


def write_docs(doc: Path = DOC, results: Path = RESULTS) -> str:
    """``doc`` with the part between the markers rendered from ``results``."""
    text = doc.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n\n" + render(results) + "\n" + text[end:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"update {DOC.name} in place")
    parser.add_argument(
        "--check", action="store_true", help=f"fail when {DOC.name} differs from the records"
    )
    parser.add_argument(
        "--comparisons", action="store_true", help="print the turn-about records' medians"
    )
    args = parser.parse_args()
    if args.comparisons:
        records = {
            p.stem: _load(p)
            for p in sorted(RESULTS.glob("*.json"))
            if p.stem.startswith(COMPARISONS)
        }
        print("\n".join(render_comparisons(records)))
        return
    if args.check:
        if DOC.read_text() != write_docs():
            raise SystemExit(f"{DOC} is stale: run benchmarks/report.py --write")
        print(f"{DOC} holds the figures of benchmarks/results/")
        return
    if not args.write:
        print(render(), end="")
        return
    DOC.write_text(write_docs())
    print(f"updated {DOC}")


if __name__ == "__main__":
    main()

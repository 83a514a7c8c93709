"""The load benchmark's smoke run: `turnbus up` with its own Redis, every scenario at a
few sessions. Counts only — the figures themselves are the benchmark's business."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.local_cluster import cluster_binaries
from tests import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _quick_run(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    """``bench_load.py --quick ARGS`` with one worker per stack (one worker reads every
    shard; a stack starts faster); its figures, from ``<name>.json``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_load.py"), "--quick", *args]
    argv += ["--workers", "1", "--results-dir", str(tmp_path)]
    run = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    figures: dict[str, Any] = json.loads((tmp_path / f"{name}.json").read_text())
    return figures


def test_bench_load_quick_runs_every_scenario_to_completion(tmp_path: Path) -> None:
    figures = _quick_run(tmp_path, "bench_load_quick", "--sessions", "5", "--no-arq")
    assert len(figures["machine"]["loadavg_at_start"]) == 3
    scenarios = figures["scenarios"]
    assert set(scenarios) == {
        "load",
        "delivery",
        "noop",
        "flood",
        "flood_user",
        "sdk",
        "tools",
        "pause",
    }
    for name, expected in (("load", 5), ("delivery", 2), ("noop", 5 * 3)):
        s = scenarios[name]
        assert s["turns_accepted"] == s["turns_completed"] == expected, (name, s)
        assert s["outcomes"] == {"turn.completed": expected}, (name, s)
        assert (s["http_errors"], s["client_errors"], s["abandoned"]) == (0, 0, 0), (name, s)
        assert s["submit_to_terminal"]["n"] == expected
        assert s["redis_commands_per_turn"] > 0
        assert s["redis_round_trips_per_turn"] > 0
        # TURNBUS_WAIT_REPLICAS is 0 by default: nothing waits for a replica.
        assert "wait" not in s["redis_commands_top_per_turn"], (name, s)
    assert scenarios["delivery"]["event_delivery"]["n"] > 2 * 2
    assert scenarios["load"]["model_own_time"]["n"] == 5
    flood = scenarios["flood"]
    assert flood["queued_accepted"] == flood["queued_in_one_session"] == 10
    assert flood["other_turn_submit_to_started"]["n"] == flood["other_turns"] == 2
    # One user's flood over 50 sessions: its quotas refuse the excess, others start.
    flood_user = scenarios["flood_user"]
    assert flood_user["flood_refused_quota_exceeded"] > 0
    assert flood_user["flood_accepted"] + flood_user["flood_refused_quota_exceeded"] == 1200
    assert flood_user["other_turn_submit_to_started"]["n"] == flood_user["other_users"] == 3
    # The real model path against the fake API, beside the scripted model.
    (step,) = scenarios["sdk"]["levels"]
    for kind in ("scripted", "sdk", "openai"):
        assert step[kind]["turns_completed"] == 5 and step[kind]["not_completed"] == 0
    for kind in ("sdk", "openai"):
        assert step[kind]["fake_api_statuses"] == {"200": 5 * 2}
        assert step[kind]["model_events_per_turn"] > step["scripted"]["model_events_per_turn"]
    # The tool turn, beside load and a turn of the same shape calling a notes tool.
    tools = scenarios["tools"]
    for side in ("load", "notes_call", "tools"):
        assert tools[side]["outcomes"] == {"turn.completed": 5}, (side, tools[side])
    assert set(tools["per_call"]) >= {"added_latency_p50_ms", "redis_commands", "redis_round_trips"}
    assert scenarios["pause"]["outcomes"] == {"turn.completed": 5}, scenarios["pause"]


def test_bench_load_quick_pause_holds_nothing_while_every_turn_waits(tmp_path: Path) -> None:
    figures = _quick_run(
        tmp_path, "bench_load_pause_quick", "--scenario", "pause", "--sessions", "4"
    )
    s = figures["scenarios"]["pause"]
    assert s["turns_accepted"] == s["turns_completed"] == 4, s
    assert s["outcomes"] == {"turn.completed": 4}, s
    assert (s["http_errors"], s["client_errors"], s["abandoned"]) == (0, 0, 0), s
    pause = s["pause"]
    assert pause["turns_paused"] == 4
    waiting = pause["while_all_wait"]
    assert waiting["turns_waiting"] == 4 and waiting["workers_metered"] == 1, waiting
    # Every turn waits for its caller: no lease, no run slot, no work entry held.
    assert (waiting["session_leases_open"], waiting["turns_running"]) == (0, 0), waiting
    assert waiting["entries_in_flight"] == 0, waiting
    assert waiting["workers_resident_mib_total"] > 0
    for measure in ("answer_accepted", "answer_to_turn_started", "answer_to_next_round"):
        assert pause[measure]["n"] == 4, (measure, pause)


def test_bench_load_cluster_quick_measures_every_node(tmp_path: Path) -> None:
    if cluster_binaries() is None:
        pytest.skip("a local cluster needs redis-server >= 7 and redis-cli on the PATH")
    figures = _quick_run(
        tmp_path,
        "bench_load_cluster_noop_quick",
        "--cluster",
        "--scenario",
        "noop",
        "--sessions",
        "4",
    )
    assert figures["cluster"] == {"shards": 3}
    assert figures["machine"]["python_loop_2m_s"] > 0
    scenarios = figures["scenarios"]
    assert set(scenarios) == {"noop_one_redis", "noop_cluster"}
    for s in scenarios.values():
        assert s["turns_accepted"] == s["turns_completed"] == 4 * 3, s
        assert s["outcomes"] == {"turn.completed": 4 * 3}, s
    (one,) = scenarios["noop_one_redis"]["redis_per_node"].values()
    assert one["role"] == "master"
    nodes = scenarios["noop_cluster"]["redis_per_node"]
    assert sorted(nodes) == [f"{role} {i}" for role in ("master", "replica") for i in (1, 2, 3)]
    masters = [n for n in nodes.values() if n["role"] == "master"]
    # Every master served the turns (the workers read a work stream on each); the
    # masters' counts add up to the total.
    assert all(n["commands_per_turn"] > 0 and n["cpu_us_per_turn"] > 0 for n in masters)
    total = sum(n["commands_per_turn"] for n in masters)
    assert abs(total - scenarios["noop_cluster"]["redis_commands_per_turn"]) < 0.5
    assert scenarios["noop_cluster"]["cpu_s_per_turn"]["redis_replicas"] > 0


def test_bench_load_replica_quick_waits_for_the_replica_when_asked(tmp_path: Path) -> None:
    # One side, the one that waits (a run's sides alternate as --cluster's do, which
    # the test above runs; the quick run's noop above shows no WAIT at the default 0).
    figures = _quick_run(
        tmp_path,
        "bench_load_replica_noop_quick",
        *("--replica", "--wait-replicas", "1", "--scenario", "noop", "--sessions", "2"),
    )
    assert figures["replica"] == {"replicas": 1, "wait_replicas": [1]}
    assert figures["machine"]["python_loop_2m_s"] > 0
    (s,) = figures["scenarios"].values()
    assert s["outcomes"] == {"turn.completed": 2 * 3}, s
    assert sorted(s["redis_per_node"]) == ["primary", "replica"]
    assert s["cpu_s_per_turn"]["redis_replicas"] > 0
    # WAIT after the submit, the notes write and the finish of every turn: 18. The
    # counters are read around the measured turns while WAITs may be in flight: the
    # last turn's finish may still be waiting (its terminal event is out before the
    # replica's ack: one fewer), and each session's warm-up turn's finish may land after
    # the first read (up to one more each, 2 sessions).
    waits = round(s["redis_commands_top_per_turn"]["wait"] * 2 * 3)
    assert 17 <= waits <= 20, waits


def test_bench_load_otel_quick_traces_the_on_side_only(tmp_path: Path) -> None:
    figures = _quick_run(tmp_path, "bench_load_otel_quick", "--otel", "--sessions", "4")
    assert figures["machine"]["python_loop_2m_s"] > 0
    scenarios = figures["scenarios"]
    assert set(scenarios) == {"noop_otel_off", "noop_otel_on"}
    for s in scenarios.values():
        assert s["outcomes"] == {"turn.completed": 4 * 3}, s
        assert (s["http_errors"], s["client_errors"], s["abandoned"]) == (0, 0, 0), s
    # On, every turn's spans reach the sink from the gateway and the worker; off, none.
    assert scenarios["noop_otel_off"]["otlp"]["spans_per_turn"] == 0
    on = scenarios["noop_otel_on"]["otlp"]
    assert on["turns_traced"] == 4 + 4 * 3
    assert set(on["spans_per_turn_by_service"]) == {"turnbus-gateway", "turnbus-worker"}, on
    assert on["spans_per_turn"] >= 2 and on["bytes_per_turn"] > 0, on
    otel = figures["otel"]
    assert otel["turns_per_s_off"] > 0 and otel["turns_per_s_on"] > 0
    assert otel["spans_per_turn_on"] == on["spans_per_turn"]
    assert {"on_throughput_cost_pct", "on_cpu_us_per_turn", "off_runs_spread_pct"} <= set(otel)


def test_bench_faults_quick_reset_loses_and_doubles_nothing(tmp_path: Path) -> None:
    # The reset scenario only: the failover's cluster and takeover take a minute.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_faults.py"), "--quick"]
    argv += ["--scenario", "reset", "--sessions", "5", "--results-dir", str(tmp_path)]
    run = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    figures = json.loads((tmp_path / "bench_faults_reset_quick.json").read_text())
    assert figures["machine"]["python_loop_2m_s"] > 0
    reset = figures["scenarios"]["reset"]
    assert reset["in_flight_at_reset"] > 0, reset
    assert (reset["lost"], reset["doubled"], reset["in_flight_not_ended"]) == (0, 0, 0), reset
    assert reset["statuses"] == {"completed": reset["turns_accepted"]}, reset
    assert reset["workers_alive_at_end"] == 3, reset
    assert reset["reset_to_in_flight_end"]["n"] == reset["in_flight_at_reset"], reset

#!/usr/bin/env bash
# Turn about: bench_load's `noop` and `delivery` scenarios on an older revision and on
# this tree, alternating, so a change is measured against the code before it in one run
# (this machine's speed drifts by up to 3x between days, and within a day between runs).
#
#   benchmarks/turn_about.sh REV [ROUNDS]     (ROUNDS: default 3)
#   SCENARIOS=load benchmarks/turn_about.sh REV [ROUNDS]
#
# SCENARIOS (default "noop delivery") may name `load` too: its figures are Redis's CPU
# per turn, the SSE hub's XREAD time per turn, commands and round trips per turn, and
# the gateway's CPU per turn; a stack is started fresh for every run.
# The older revision is checked out into a temporary worktree with a virtualenv of its
# own. Each round runs both scenarios once on each side (arq's side-by-side is skipped);
# each run's figures go to benchmarks/results/turn_about/<side>-<round>/ (not kept by
# git), and the table of runs and medians, with each run's python_loop_2m_s, is printed
# and saved as benchmarks/results/turn_about.json.
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:?usage: benchmarks/turn_about.sh REV [ROUNDS]}"
rounds="${2:-3}"
scenarios="${SCENARIOS:-noop delivery}"
here="$(pwd)"
tag="$(echo "$scenarios" | tr ' ' '_')"
if [ "$tag" = noop_delivery ]; then tag=""; else tag="_$tag"; fi
out="$here/benchmarks/results/turn_about$tag"
old="$(mktemp -d)/old"
cleanup() { git worktree remove --force "$old" >/dev/null 2>&1 || true; }
trap cleanup EXIT

git worktree add --detach --quiet "$old" "$rev"
echo "== a virtualenv for $rev in $old"
python3 -m venv "$old/.venv"
"$old/.venv/bin/pip" install --quiet -e "$old[dev]"
rm -rf "$out"
mkdir -p "$out"
for round in $(seq "$rounds"); do
    for side in old new; do
        if [ "$side" = old ]; then dir="$old"; else dir="$here"; fi
        for scenario in $scenarios; do
            echo "== round $round: $scenario on $side"
            (cd "$dir" && PYTHONPATH=. .venv/bin/python benchmarks/bench_load.py \
                --scenario "$scenario" --no-arq --noop-repeats 1 --delivery-repeats 1 \
                --results-dir "$out/$side-$round" >"$out/$side-$round-$scenario.log" 2>&1)
        done
    done
done
.venv/bin/python - "$out" "$rev" <<'EOF'
import json, statistics, sys
from pathlib import Path

out, rev = Path(sys.argv[1]), sys.argv[2]


def load_figures(s):
    """The load scenario's Redis figures per turn (µs, counts) and the gateway's CPU."""
    return {
        "redis_cpu_us": round(s["cpu_s_per_turn"]["redis"] * 1e6),
        "xread_us": s["redis_usec_top_per_turn"].get("xread", 0.0),
        "xread_calls": s["redis_commands_top_per_turn"].get("xread", 0.0),
        "cmds": s["redis_commands_per_turn"],
        "round_trips": s["redis_round_trips_per_turn"],
        "gateway_cpu_us": round(s["cpu_s_per_turn"]["gateway"] * 1e6),
        "turns_per_s": s["turns_per_s"],
        "p99_ratio": s["ratio_to_model_time"]["p99"],
    }


rows: dict[str, dict[str, list[float]]] = {}
runs = []
for path in sorted(out.glob("*/bench_load_*.json")):
    side = path.parent.name.split("-")[0]
    figures = json.loads(path.read_text())
    loop = figures.get("machine", {}).get("python_loop_2m_s")
    for name, s in figures["scenarios"].items():
        if name == "load":
            load = load_figures(s)
            for figure, value in load.items():
                rows.setdefault(f"load {figure}", {}).setdefault(side, []).append(float(value))
            runs.append({"run": path.parent.name, "scenario": name, **load,
                         "python_loop_2m_s": loop})
            print(f"{side:3} {path.parent.name:6} load     {load}   python_loop_2m_s {loop}")
            continue
        value = s["turns_per_s"] if name == "noop" else s["event_delivery"]["p99_ms"]
        rows.setdefault(name, {}).setdefault(side, []).append(float(value))
        runs.append({"run": path.parent.name, "scenario": name, "value": value,
                     "python_loop_2m_s": loop})
        print(f"{side:3} {path.parent.name:6} {name:8} {value:>8}   python_loop_2m_s {loop}")
print(f"\nmedians ({rev} = old, this tree = new)")
medians = {}
for name, sides in rows.items():
    unit = {"noop": "turns/s", "delivery": "ms p99 event delivery"}.get(name, "")
    old, new = statistics.median(sides.get("old", [0])), statistics.median(sides.get("new", [0]))
    medians[name] = {"old": old, "new": new, "unit": unit}
    print(f"  {name:20} old {old:8.2f}  new {new:8.2f}  {unit}")
summary = {"old": rev, "runs": runs, "medians": medians}
(out.parent / f"{out.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
EOF

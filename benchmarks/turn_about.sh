#!/usr/bin/env bash
# Turn about: bench_load's `noop` and `delivery` scenarios on an older revision and on
# this tree, alternating, so a change is measured against the code before it in one run
# (this machine's speed drifts by up to 3x between days, and within a day between runs).
#
#   benchmarks/turn_about.sh REV [ROUNDS]     (ROUNDS: default 3)
#
# The older revision is checked out into a temporary worktree with a virtualenv of its
# own. Each round runs both scenarios once on each side (arq's side-by-side is skipped);
# each run's figures go to benchmarks/results/turn_about/<side>-<round>/ (not kept by
# git), and the table of runs and medians, with each run's python_loop_2m_s, is printed
# and saved as benchmarks/results/turn_about.json.
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:?usage: benchmarks/turn_about.sh REV [ROUNDS]}"
rounds="${2:-3}"
here="$(pwd)"
out="$here/benchmarks/results/turn_about"
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
        for scenario in noop delivery; do
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
rows: dict[str, dict[str, list[float]]] = {}
runs = []
for path in sorted(out.glob("*/bench_load_*.json")):
    side = path.parent.name.split("-")[0]
    figures = json.loads(path.read_text())
    loop = figures.get("machine", {}).get("python_loop_2m_s")
    for name, s in figures["scenarios"].items():
        value = s["turns_per_s"] if name == "noop" else s["event_delivery"]["p99_ms"]
        rows.setdefault(name, {}).setdefault(side, []).append(float(value))
        runs.append({"run": path.parent.name, "scenario": name, "value": value,
                     "python_loop_2m_s": loop})
        print(f"{side:3} {path.parent.name:6} {name:8} {value:>8}   python_loop_2m_s {loop}")
print(f"\nmedians ({rev} = old, this tree = new)")
medians = {}
for name, sides in rows.items():
    unit = "turns/s" if name == "noop" else "ms p99 event delivery"
    old, new = statistics.median(sides.get("old", [0])), statistics.median(sides.get("new", [0]))
    medians[name] = {"old": old, "new": new, "unit": unit}
    print(f"  {name:8} old {old:8.1f}  new {new:8.1f}  {unit}")
summary = {"old": rev, "runs": runs, "medians": medians}
(out.parent / "turn_about.json").write_text(json.dumps(summary, indent=1) + "\n")
EOF

"""The code's shape: no class a newcomer must read is over 300 lines (the product, the
harness and the benchmarks; a class that grows past it is split along a seam)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_CLASS_LINES = 300
FOLDERS = ("shared", "services", "harness", "benchmarks")


def test_no_class_is_over_300_lines() -> None:
    long = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > MAX_CLASS_LINES:
                        long.append(f"{path.relative_to(ROOT)}: {node.name} ({lines} lines)")
    assert not long, "split these classes: " + "; ".join(long)

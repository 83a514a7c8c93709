"""The repository's text: the benchmarks page holds what the records render, and no file
names an issue number (the docs describe the system, not its history)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import report

ROOT = Path(__file__).resolve().parent.parent

# The word issue (or issues) then a number, with or without "#", or a number in
# parentheses after "#": a reference to a tracker's item.
ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\d+|\(#\d+\)", re.IGNORECASE)


def test_the_benchmarks_page_holds_the_figures_report_py_renders() -> None:
    page = report.DOC.read_text()
    assert page == report.write_docs(), (
        "run: PYTHONPATH=. .venv/bin/python benchmarks/report.py --write"
    )
    assert len(page.splitlines()) < 300


def test_report_py_renders_every_committed_record() -> None:
    rendered = report.render()
    for path in sorted(report.RESULTS.glob("*.json")):
        assert f"`{path.stem}`" in rendered, f"{path.name} is not on the benchmarks page"


def test_a_record_no_renderer_reads_fails_the_render(tmp_path: Path) -> None:
    shutil.copy(report.RESULTS / "bench_turns.json", tmp_path / "bench_turns.json")
    (tmp_path / "bench_new.json").write_text(json.dumps({"name": "bench_new"}))
    with pytest.raises(ValueError, match=r"no renderer reads bench_new\.json"):
        report.render(tmp_path)


def _tracked_text_files() -> list[Path]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
    ).stdout
    files = []
    for name in listed.decode().split("\0"):
        path = ROOT / name
        if name and path.is_file() and b"\0" not in path.read_bytes()[:8192]:
            files.append(path)
    return files


def test_no_tracked_text_file_names_an_issue_number() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _tracked_text_files()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if ISSUE_NUMBER.search(line)
    ]
    assert found == []


def test_the_issue_number_check_catches_each_form() -> None:
    # Built here, so that this file names no issue number itself.
    forms = [f"{word} {n}" for word, n in (("see issue", "17"), ("Issue", "#17"), ("issues", "17"))]
    forms += ["fixed (" + "#17)", "ISSUE" + "#9"]
    assert [bool(ISSUE_NUMBER.search(text)) for text in forms] == [True] * len(forms)
    ordinary = ["the issue's scenario", "#1 run", "blocking #2", "1 issue", "color #fff"]
    assert [bool(ISSUE_NUMBER.search(text)) for text in ordinary] == [False] * len(ordinary)

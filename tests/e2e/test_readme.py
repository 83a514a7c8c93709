"""The README's first-turn walk-through, run verbatim against a started ``turnbus up``.

The block runs as the README says it does: from a directory holding ``.venv`` and
the stack's ``.turnbus``, with ``API`` set to the stack's URL. It must end with the
note printed; with a token the gateway refuses it must stop at the first request.
The Python snippet runs from that directory, from a folder inside it, and from a
folder elsewhere (its token found through the pointer ``turnbus up`` leaves).
The tools section's example is examples/tools.py in part, line for line.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.redis_server import free_port
from tests import ROOT
from tests.up_process import running_up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def walkthrough(language: str = "sh") -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## A first turn", 1)[1].split("\n## ", 1)[0]
    match = re.search(rf"```{language}\n(.*?)```", section, re.DOTALL)
    assert match is not None, f"README's 'A first turn' has no {language} block"
    return match.group(1)


async def _bash(script: str, cwd: Path, api: str, *options: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        "bash", *options, "-c", script,
        cwd=cwd, env={"PATH": "/usr/bin:/bin", "API": api, "HOME": str(cwd)},
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _workdir(path: Path, stack_dir: Path) -> Path:
    """A directory like the repository's: ``.venv`` (this one) and ``.turnbus``."""
    path.mkdir()
    (path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (path / ".turnbus").symlink_to(stack_dir)
    return path


async def test_the_readme_walkthrough_runs_verbatim_and_stops_on_a_refusal(
    tmp_path: Path,
) -> None:
    block = walkthrough()
    data_dir = tmp_path / "data"
    async with running_up(data_dir, free_port(), tmp_path / "up.txt") as up:
        stack = await up.ready()
        repo = _workdir(tmp_path / "repo", data_dir)

        code, out, err = await _bash(block, repo, stack["url"], "-euo", "pipefail")
        assert code == 0, (out, err)
        assert "event: turn.completed" in out
        assert out.rstrip().endswith("- the build is green"), out

        # The Python snippet too, token and all, from the same directory, a folder in
        # it, and a folder elsewhere.
        (repo / "examples").mkdir()
        (tmp_path / "elsewhere").mkdir()
        state = str(data_dir.parent / "state")  # where the up process points at its stack
        for cwd in (repo, repo / "examples", tmp_path / "elsewhere"):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-W", "error", "-c", walkthrough("python"),
                cwd=cwd, env={"API": stack["url"], "HOME": str(cwd), "XDG_STATE_HOME": state},
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            async with asyncio.timeout(60):
                py_out, py_err = await proc.communicate()
            assert proc.returncode == 0, (cwd, py_err.decode())
            assert "TurnCompleted(" in py_out.decode()
            assert py_out.decode().rstrip().endswith("- the build is green")

        # A stack whose secret is not the gateway's: the token is refused with 401.
        other = tmp_path / "other"
        other.mkdir()
        (other / "jwt-secret").write_text("not-the-secret-of-this-stack-0123456789abcdef\n")
        wrong = _workdir(tmp_path / "wrong", other)
        code, out, err = await _bash(block, wrong, stack["url"], "-euo", "pipefail")
        assert code != 0 and out == ""
        assert "curl: (22) The requested URL returned error: 401" in err, err
        assert "Traceback" not in err, err
        # Without set -e, the next line refuses to run with no session id.
        code, out, err = await _bash(block, wrong, stack["url"])
        assert code != 0 and out == ""
        assert "SID: parameter null or not set" in err, err


def test_the_readme_tool_example_is_the_example_file_in_part() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## The agent's own tools", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n# examples/tools.py\n(.*?)```", section, re.DOTALL)
    assert match is not None, "README's tools section has no block from examples/tools.py"
    example = (ROOT / "examples" / "tools.py").read_text(encoding="utf-8").splitlines()
    # Each of the block's lines, less its trailing comment, is a line of the file, in
    # the file's order; "..." stands for the lines left out.
    at = 0
    for line in match.group(1).splitlines():
        code = line.split("  # ", 1)[0]
        if not code.strip() or code.strip() == "...":
            continue
        assert code in example[at:], f"README line not in examples/tools.py: {line!r}"
        at = example.index(code, at) + 1

"""The package as it ships: a wheel built from the tree installs one top-level package,
``turnbus``, with the Lua scripts and the console's files inside it, and the client
imports without Redis."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy of what the Dockerfile copies, so the checkout gets no build/.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "shared", src / "shared", ignore=ignore)
    shutil.copytree(ROOT / "services", src / "services", ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
         "--wheel-dir", str(out), str(src)],
        check=True,
        timeout=150,
    )  # fmt: skip
    (built,) = out.glob("turnbus-*.whl")
    return built


def test_the_wheel_installs_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {
        name.split("/", 1)[0] for name in names if not name.split("/", 1)[0].endswith(".dist-info")
    }
    assert top == {"turnbus"}
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["turnbus"]


def test_the_wheel_carries_the_scripts_console_and_types(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (
        "turnbus/py.typed",
        "turnbus/client.py",
        "turnbus/shared/records.py",
        "turnbus/shared/lua/turn_finish.lua",
        "turnbus/gateway/console/console.js",
        "turnbus/gateway/console/favicon.svg",
        "turnbus/gateway/console_page.py",
        "turnbus/worker/models/anthropic.py",
    ):
        assert path in names
    # What only the tests and the benchmarks use stays in the checkout (harness/).
    assert "turnbus/local_cluster.py" not in names


def test_the_client_imports_without_redis() -> None:
    code = "import sys; from turnbus import Client; print(sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'hiredis')))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=30
    ).stdout
    assert out.strip() == "[]"

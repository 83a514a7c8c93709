"""The ``turnbus`` package itself: what importing it costs a service, what it exports."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import turnbus
from tests import ROOT
from turnbus import client


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module", ["turnbus.gateway.app", "turnbus.worker.consumer"])
def test_a_service_imports_neither_the_client_nor_httpx(module: str) -> None:
    code = (
        f"import sys, {module}; "
        "print(sorted(m for m in ('httpx', 'turnbus.client') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.timeout(60)
def test_the_client_s_names_come_from_the_package() -> None:
    code = "import turnbus; from turnbus import *; from turnbus import Client; print(Client.__module__)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "turnbus.client"


def test_the_package_exports_every_public_name_of_the_client() -> None:
    own = {"NoStack", "__version__", "dev_token"}
    assert set(turnbus.__all__) - own == set(client.__all__)
    for name in client.__all__:
        assert getattr(turnbus, name) is getattr(client, name)
    with pytest.raises(AttributeError, match="no attribute 'Clint'"):
        _ = turnbus.Clint  # type: ignore[attr-defined]


def _imported_modules(path: Path) -> set[str]:
    """The modules a Python file imports (at any depth of its code)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [("benchmarks", ("tests",)), ("harness", ("tests", "benchmarks"))],
)
def test_the_benchmarks_and_the_harness_import_nothing_from_the_tests(
    folder: str, forbidden: tuple[str, ...]
) -> None:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    wrong = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in files
        for module in _imported_modules(path)
        if module.split(".")[0] in forbidden
    }
    assert not wrong, f"move what they need to harness/: {sorted(wrong)}"


def test_the_harness_is_not_installed_with_the_product() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
        "setuptools"
    ]
    packages = [*setuptools["packages"], *setuptools["package-dir"].values()]
    assert not [p for p in packages if p.startswith("harness")], packages

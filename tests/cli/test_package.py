"""The ``turnbus`` package itself: what importing it costs a service, what it exports."""

from __future__ import annotations

import subprocess
import sys

import pytest

import turnbus
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

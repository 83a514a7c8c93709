"""The harness's Redis container is removed however its run ends: a failing body, or a
killed run (its leftover is removed by the next session's start)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from harness.redis_container import LABEL, docker_answers, remove_orphans
from tests import ROOT

pytestmark = [pytest.mark.containers, pytest.mark.timeout(120)]


# Starts the harness's container, prints its URL, then fails or waits to be killed.
_CHILD = """
import signal, sys
from harness.redis_container import redis_container
with redis_container() as url:
    print(url, flush=True)
    if sys.argv[1] == "fail":
        raise RuntimeError("a failing test session")
    signal.pause()  # until the test kills it
"""


@pytest.fixture
def client() -> Iterator[Any]:
    if not docker_answers():
        if os.environ.get("CI") == "true":
            pytest.fail("no Docker engine answers; CI=true needs the containers tests to run")
        pytest.skip("no Docker engine answers")
    import docker  # type: ignore[import-untyped]

    client = docker.from_env()
    yield client
    client.close()


def containers_of(client: Any, pid: int) -> list[Any]:
    found = client.containers.list(all=True, filters={"label": f"{LABEL}.pid={pid}"})
    return list(found)


def test_a_failing_run_removes_its_container(client: Any) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, "fail"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = child.communicate(timeout=90)
    assert "a failing test session" in err
    assert out.startswith("redis://")
    assert containers_of(client, child.pid) == []


def test_a_killed_runs_container_is_removed_at_the_next_start(client: Any) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, "wait"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    assert child.stdout.readline().startswith("redis://")
    remove_orphans(client)  # a live run's container is left alone
    assert len(containers_of(client, child.pid)) == 1

    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    child.stdout.close()
    assert len(containers_of(client, child.pid)) == 1  # left behind: no reaper
    remove_orphans(client)
    assert containers_of(client, child.pid) == []

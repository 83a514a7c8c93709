"""compose.yaml for real: the image is built, the stack comes up (Redis with AOF on a
volume, the gateway, two workers), and a user's turn survives a worker killed mid-turn
and a Redis restart. The stack is always taken down with ``down -v``.

Needs a Docker engine and a compose (``docker compose``, else ``docker-compose``).
Without them the tests skip, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.redis_container import docker_answers, pick_image
from harness.redis_server import free_port
from tests import ROOT
from turnbus.gateway.auth import mint_token
from turnbus.shared.events import TERMINAL_TYPES

# One stack for the module: under pytest-xdist its tests all go to one worker.
pytestmark = [
    pytest.mark.containers,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.xdist_group("compose"),
]


def compose_command() -> list[str] | None:
    """``docker compose`` (v2) when present, else Debian's ``docker-compose`` (1.29)."""
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    if v2.returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def compose_argv(compose: list[str], project: str, *args: str) -> list[str]:
    return [*compose, "-p", project, "-f", str(ROOT / "compose.yaml"), *args]


def require(ok: bool, why: str) -> None:
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}; CI=true needs the containers tests to run")
    pytest.skip(why)


def wait_healthy(container: str, since: float, deadline_s: float) -> None:
    """Wait for Docker's ``health_status: healthy`` event of ``container`` (replayed from
    ``since``, so one that came before the call counts), within the deadline."""
    command = [
        "docker",
        "events",
        "--since",
        f"{since:.3f}",
        "--filter",
        f"container={container}",
        "--filter",
        "event=health_status",
        "--format",
        "{{.Status}}",
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as events:
        deadline = threading.Timer(deadline_s, events.kill)
        deadline.start()
        try:
            assert events.stdout is not None
            for line in events.stdout:
                if line.strip() == "health_status: healthy":
                    return
            raise AssertionError(f"{container[:12]} was not healthy within {deadline_s:.0f} s")
        finally:
            deadline.cancel()
            events.kill()


@dataclasses.dataclass
class Stack:
    compose: list[str]
    project: str
    env: dict[str, str]
    http: httpx.Client

    def run(self, *args: str, timeout: float = 600) -> str:
        done = subprocess.run(
            compose_argv(self.compose, self.project, *args),
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def containers(self, service: str) -> list[str]:
        out = docker(
            "ps",
            "-q",
            "--no-trunc",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--filter",
            f"label=com.docker.compose.service={service}",
        )
        return out.split()


def docker(*args: str) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed: {done.stderr}")
    return done.stdout


@dataclasses.dataclass
class _Plan:
    """What the stack is built and run with: one per test session."""

    compose: list[str]
    project: str
    env: dict[str, str]
    port: int
    secret: str
    build: subprocess.Popen[bytes] | None = None
    build_log: Path | None = None


_plan: _Plan | None = None


def _make_plan() -> _Plan:
    """The stack's compose command and environment (the base images picked once);
    skips, or fails under ``CI=true``, without an engine or a compose."""
    global _plan
    if _plan is not None:
        return _plan
    require(docker_answers(), "no Docker engine answers")
    compose = compose_command()
    require(compose is not None, "no docker compose and no docker-compose")
    assert compose is not None
    import docker as docker_sdk  # type: ignore[import-untyped]

    client = docker_sdk.from_env()
    try:
        redis_image = os.environ.get("TURNBUS_REDIS_IMAGE") or pick_image(
            client, "redis:7", "turnbus-local/redis:7"
        )
        python_image = os.environ.get("TURNBUS_PYTHON_IMAGE") or pick_image(
            client, "python:3.11-slim", "turnbus-local/python:3.11"
        )
    finally:
        client.close()
    secret = secrets.token_urlsafe(32)
    port = free_port()
    env = {
        **os.environ,
        "TURNBUS_JWT_SECRET": secret,
        "TURNBUS_PORT": str(port),
        "TURNBUS_REDIS_IMAGE": redis_image,
        "TURNBUS_PYTHON_IMAGE": python_image,
        "TURNBUS_MODEL": "scripted",
        # A dead worker's turn is reclaimed quickly; with 100 ms a chunk, the turn that
        # kills its worker mid-turn has a long reply (its note) to outlast the kill.
        "TURNBUS_SCRIPTED_DELAY_MS": "100",
        "TURNBUS_LEASE_MS": "3000",
        "TURNBUS_HEARTBEAT_MS": "1000",
        "TURNBUS_CLAIM_IDLE_MS": "3000",
        # Docker's health checks are the events the tests wait for.
        "TURNBUS_HEALTHCHECK_INTERVAL": "1s",
    }
    _plan = _Plan(compose, f"turnbustest{os.getpid()}", env, port, secret)
    return _plan


def start_image_build() -> None:
    """Start building the image in the background (about 30 s, most of it ``pip
    install`` inside the build), so it is ready by the time this module's first test
    runs; tests/conftest.py calls it once the session has collected this module. Quiet
    where the stack fixture would skip: the fixture says why."""
    global _plan
    try:
        plan = _make_plan()
    except (pytest.skip.Exception, pytest.fail.Exception):
        _plan = None
        return
    if plan.build is None:
        fd, log = tempfile.mkstemp(prefix="turnbus-compose-build-", suffix=".log")
        with os.fdopen(fd, "wb") as out:
            plan.build = subprocess.Popen(
                compose_argv(plan.compose, plan.project, "build"),
                cwd=ROOT,
                env=plan.env,
                stdout=out,
                stderr=out,
            )
        plan.build_log = Path(log)


def stop_image_build() -> None:
    """A build still running when the session ends (the module was never reached)."""
    if _plan is not None and _plan.build is not None and _plan.build.poll() is None:
        _plan.build.kill()
        _plan.build.wait(10)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    plan = _make_plan()
    headers = {"Authorization": f"Bearer {mint_token(plan.secret, 'alice')}"}
    with httpx.Client(
        base_url=f"http://127.0.0.1:{plan.port}", headers=headers, timeout=20
    ) as http:
        running = Stack(plan.compose, plan.project, plan.env, http)
        try:
            if plan.build is None:
                running.run("build")
            else:
                assert plan.build_log is not None
                if plan.build.wait(600) != 0:
                    log = plan.build_log.read_text(errors="replace")
                    raise AssertionError(f"compose build failed:\n{log[-3000:]}")
                plan.build_log.unlink(missing_ok=True)
            since = time.time() - 1
            running.run("up", "-d")
            gateway = running.containers("gateway")
            assert len(gateway) == 1
            assert len(running.containers("worker")) == 2
            try:
                wait_healthy(gateway[0], since, 120)
            except AssertionError as e:
                e.add_note(running.run("logs", "--tail=30"))
                raise
            yield running
        finally:
            running.run("down", "-v", "--remove-orphans", timeout=300)


def new_session(http: httpx.Client) -> str:
    r = http.post("/v1/sessions")
    assert r.status_code == 201, r.text
    return str(r.json()["sessionId"])


def submit(http: httpx.Client, session: str, message: str) -> str:
    r = http.post(f"/v1/sessions/{session}/turns", json={"message": message})
    assert r.status_code == 202, r.text
    return str(r.json()["turnId"])


def turn_record(http: httpx.Client, session: str, turn: str) -> dict[str, Any]:
    r = http.get(f"/v1/sessions/{session}/turns/{turn}")
    assert r.status_code == 200, r.text
    record: dict[str, Any] = r.json()
    return record


def follow(
    http: httpx.Client, session: str, turn: str, until: frozenset[str], deadline_s: float
) -> list[str]:
    """The turn's event types from its SSE stream, up to the first of ``until`` (or the
    stream's end, after the terminal event), within the deadline."""
    end = time.monotonic() + deadline_s
    types: list[str] = []
    with http.stream("GET", f"/v1/sessions/{session}/turns/{turn}/events") as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if time.monotonic() > end:
                raise AssertionError(f"turn {turn}: no {sorted(until)} within {deadline_s} s")
            if line.startswith("data:"):
                types.append(json.loads(line.removeprefix("data:"))["type"])
                if types[-1] in until:
                    break
    return types


def terminal_record(http: httpx.Client, session: str, turn: str) -> dict[str, Any]:
    follow(http, session, turn, TERMINAL_TYPES, 120)
    return turn_record(http, session, turn)


def event_types(http: httpx.Client, session: str, turn: str) -> list[str]:
    """Every event of the turn, from its SSE stream (which ends after the terminal event)."""
    return follow(http, session, turn, frozenset(), 120)


def notes(http: httpx.Client, session: str) -> str:
    r = http.get(f"/v1/sessions/{session}/notes")
    assert r.status_code == 200, r.text
    return str(r.json()["notes"])


def test_remember_turn_over_http(stack: Stack) -> None:
    session = new_session(stack.http)
    turn = submit(stack.http, session, "remember the deploy window is Tuesday")
    assert terminal_record(stack.http, session, turn)["status"] == "completed"
    types = event_types(stack.http, session, turn)
    assert "working_notes" in types
    assert [t for t in types if t in TERMINAL_TYPES] == ["turn.completed"]
    assert "the deploy window is Tuesday" in notes(stack.http, session)


def test_worker_killed_mid_turn_the_other_worker_completes_it(stack: Stack) -> None:
    session = new_session(stack.http)
    # About 25 chunks, 2.5 s: the kill lands well inside the turn.
    canary = "the canary is eu-west " + " ".join(
        f"then region {n} after an hour" for n in range(10)
    )
    turn = submit(stack.http, session, f"remember {canary}")

    follow(stack.http, session, turn, frozenset({"turn.started"}), 60)
    first = turn_record(stack.http, session, turn)
    assert first["status"] == "running" and first.get("worker"), first
    # A worker's name starts with its hostname, the container's short id.
    hostname = first["worker"].split("-", 1)[0]
    workers = stack.containers("worker")
    victim = next(c for c in workers if c.startswith(hostname))
    docker("update", "--restart=no", victim)  # a lost machine: it does not come back
    docker("kill", victim)

    record = terminal_record(stack.http, session, turn)
    assert record["status"] == "completed", record
    assert not record["worker"].startswith(hostname)
    assert record["attempt"] == 2
    types = event_types(stack.http, session, turn)
    assert [t for t in types if t in TERMINAL_TYPES] == ["turn.completed"]
    assert canary in notes(stack.http, session)


def test_redis_restart_keeps_the_notes(stack: Stack) -> None:
    session = new_session(stack.http)
    turn = submit(stack.http, session, "remember the release is 4.2")
    assert terminal_record(stack.http, session, turn)["status"] == "completed"

    redis = stack.containers("redis")
    since = time.time()
    stack.run("restart", "redis")
    assert stack.containers("redis") == redis  # the same container, its AOF on the volume
    wait_healthy(redis[0], since, 60)
    # The gateway's connection to Redis broke with the restart; its next command
    # reconnects.
    assert "the release is 4.2" in notes(stack.http, session)
    # The workers carry on after the restart.
    again = submit(stack.http, session, "remember the freeze starts Friday")
    assert terminal_record(stack.http, session, again)["status"] == "completed"
    assert "the freeze starts Friday" in notes(stack.http, session)


def test_services_stop_on_sigterm_before_the_grace_period(stack: Stack) -> None:
    """Last: it stops the stack. Exit code 0, not 137: SIGTERM ended them, not SIGKILL."""
    containers = stack.containers("gateway") + stack.containers("worker")
    stack.run("stop", "-t", "30", "gateway", "worker")
    for container in containers:
        state = json.loads(docker("inspect", "-f", "{{json .State}}", container))
        assert not state["OOMKilled"]
        if state["ExitCode"] != 0:
            # What the service logged on its way down says why it did not stop in time.
            logs = subprocess.run(
                ["docker", "logs", "--tail", "60", "--timestamps", container],
                capture_output=True,
                text=True,
                check=False,
            )
            raise AssertionError(
                f"{container} exited {state['ExitCode']}: {state}\n{logs.stdout}{logs.stderr}"
            )

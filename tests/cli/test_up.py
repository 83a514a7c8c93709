"""``turnbus up`` as a user runs it: a subprocess on free ports with a fresh data dir.

A turn goes over HTTP to ``turn.completed``; a worker killed with SIGKILL is
restarted; SIGINT stops every child; a second ``up`` on the same data dir finds the
session's notes again (same JWT secret, same Redis AOF).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.redis_server import free_port, redis_binary
from tests.up_process import UNSET_ENV, alive, redis_major, running_up, wait_for
from turnbus import AsyncClient
from turnbus.shared.connect import connect_sync
from turnbus.shared.events import event_type
from turnbus.shared.settings import Settings
from turnbus.stackfile import read_secret, read_stack_file
from turnbus.supervisor import UpError, shards_warning, worker_metrics_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def _turnbus(*args: str, stdin: str = "") -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "turnbus", *args,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k not in UNSET_ENV},
    )  # fmt: skip
    async with asyncio.timeout(30):
        out, err = await proc.communicate(stdin.encode())
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def _chat_cancels_a_turn_on_ctrl_c(data_dir: Path, session: str) -> bool:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "turnbus", "chat", "--data-dir", str(data_dir), "--session", session,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k not in UNSET_ENV},
    )  # fmt: skip
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write(b"tell me a long story\n")
    await proc.stdin.drain()
    seen = b""
    async with asyncio.timeout(30):
        while b"agent> " not in seen:  # the first text delta of the turn
            chunk = await proc.stdout.read(4096)
            assert chunk, seen
            seen += chunk
        proc.send_signal(signal.SIGINT)
        proc.stdin.write(b"/quit\n")
        out, err = await proc.communicate()
    text = (seen + out).decode()
    assert proc.returncode == 0, (text, err)
    assert "[turn.cancelled]" in text, text
    return True


async def _follow(stack: dict[str, Any], token: str, session: str, turn: str) -> list[str]:
    async with asyncio.timeout(30), AsyncClient(stack["url"], token) as client:
        return [event_type(e) async for e in client.events(session, turn)]


async def test_up_runs_a_turn_stops_cleanly_and_finds_its_notes_again(tmp_path: Path) -> None:
    # Also: each worker's metrics port, as `up` and `turnbus status` name it.
    data_dir = tmp_path / "data"

    async with running_up(data_dir, free_port(), tmp_path / "up1.txt") as up:
        stack = await up.ready()
        output = up.output()
        secret = read_secret(data_dir)
        assert secret is not None
        assert secret not in output
        assert "curl" in output
        assert "turnbus chat" in output
        # How to see a long turn: one line on slowing the scripted model.
        assert "restart with TURNBUS_SCRIPTED_DELAY_MS=500" in output
        match = re.search(r"export TOKEN=(\S+)", output)
        assert match is not None
        token = match.group(1)
        assert stack["url"] == f"http://127.0.0.1:{up.port}"
        assert set(stack["children"]) == {"redis", "gateway", "worker-1", "worker-2"}
        # The Redis asked for (--redis-server), with its AOF in the data dir.
        aof = "appendonlydir" if redis_major(redis_binary()) >= 7 else "appendonly.aof"
        assert (data_dir / "redis" / aof).exists()
        await _each_worker_serves_metrics_where_up_says(up.output(), stack, data_dir)

        async with httpx.AsyncClient(
            base_url=stack["url"], headers={"Authorization": f"Bearer {token}"}, timeout=10
        ) as client:
            assert (await client.get("/readyz")).status_code == 200
            created = await client.post("/v1/sessions", json={})
            assert created.status_code == 201, created.text
            session = created.json()["sessionId"]
            turn = await client.post(
                f"/v1/sessions/{session}/turns", json={"message": "remember the build is green"}
            )
            assert turn.status_code == 202, turn.text
            types = await _follow(stack, token, session, turn.json()["turnId"])
            assert types[-1] == "turn.completed", types
            assert "working_notes" in types

        # A worker that dies is restarted under the same name.
        first_pids = dict(stack["children"])
        os.kill(first_pids["worker-1"], signal.SIGKILL)

        def restarted() -> dict[str, Any] | None:
            now = read_stack_file(data_dir) or {"children": {}}
            pid = now["children"].get("worker-1")
            return now if pid and pid != first_pids["worker-1"] else None

        stack = await wait_for(restarted, "worker-1 to be restarted")
        assert "worker-1 was killed by SIGKILL unexpectedly" in up.output()

        assert await up.stop(signal.SIGINT) == 0
        pids = {*first_pids.values(), *stack["children"].values()}
        assert [pid for pid in pids if alive(pid)] == []
        assert read_stack_file(data_dir) is None
        assert "stopped" in up.output()
        for log in (data_dir / "logs").glob("*.log"):
            text = log.read_text(errors="replace")
            assert secret not in text, log.name
            assert token not in text, log.name

    # The same data dir again, on another port: same secret, same Redis data. The
    # scripted model is slowed so that a chat's Ctrl-C lands mid-turn.
    async with running_up(
        data_dir, free_port(), tmp_path / "up2.txt", TURNBUS_SCRIPTED_DELAY_MS="800"
    ) as up:
        stack = await up.ready()
        assert "The scripted model waits 800 ms per chunk" in up.output()
        assert read_secret(data_dir) == secret
        async with httpx.AsyncClient(
            base_url=stack["url"], headers={"Authorization": f"Bearer {token}"}, timeout=10
        ) as client:
            notes = await client.get(f"/v1/sessions/{session}/notes")
            assert notes.status_code == 200, notes.text
            assert "the build is green" in notes.json()["notes"]

        code, out, err = await _turnbus(
            "chat", "--data-dir", str(data_dir), "--session", session, stdin="/notes\n/quit\n"
        )
        assert code == 0, err
        assert "the build is green" in out
        code, out, err = await _turnbus("chat", "--data-dir", str(data_dir), "--list")
        assert code == 0, err
        assert out.splitlines()[0].startswith(session + "  ")

        assert await _chat_cancels_a_turn_on_ctrl_c(data_dir, session)

        code, out, err = await _turnbus("status", "--data-dir", str(data_dir), "--json")
        assert code == 0, err
        assert json.loads(out)["shards"][0]["pending"] == 0

        children = stack["children"]
        assert await up.stop(signal.SIGTERM) == 0
        assert [pid for pid in children.values() if alive(pid)] == []


async def _each_worker_serves_metrics_where_up_says(
    output: str, stack: dict[str, Any], data_dir: Path
) -> None:
    """`up` says where each worker's metrics are; each answers there, and `turnbus
    status` shows the same ports."""
    (line,) = [x for x in output.splitlines() if x.startswith("turnbus up: metrics ")]
    gateway, _, workers = line.partition(", workers ")
    assert gateway == f"turnbus up: metrics  gateway {stack['url']}/metrics", line
    urls = workers.split(", ")
    ports = [
        int(m.group(1))
        for u in urls
        if (m := re.fullmatch(r"http://127\.0\.0\.1:(\d+)/metrics", u))
    ]
    gateway_port = int(stack["url"].rsplit(":", 1)[1])
    assert len(ports) == 2 and len(set(ports)) == 2 and gateway_port not in ports, line

    # Ready means every worker answers: each URL is its own worker's Prometheus text.
    async with httpx.AsyncClient(timeout=10) as http:
        for url in urls:
            answer = await http.get(url)
            assert answer.status_code == 200, url
            assert answer.headers["content-type"].startswith("text/plain"), url
            assert "\nturnbus_worker_turns_running 0.0\n" in answer.text, url

    code, out, err = await _turnbus("status", "--data-dir", str(data_dir), "--json")
    assert code == 0, err
    workers_seen = json.loads(out)["workers"]
    assert sorted(w["metricsPort"] for w in workers_seen if w["live"]) == sorted(ports)
    code, out, err = await _turnbus("status", "--data-dir", str(data_dir))
    assert code == 0, err
    for port in ports:
        assert f"  metrics port {port}\n" in out + "\n", out


def test_worker_metrics_ports_run_on_from_a_base_the_user_set() -> None:
    free = worker_metrics_ports(0, 3, host="127.0.0.1", taken={8000})
    assert len(set(free)) == 3 and 8000 not in free
    assert worker_metrics_ports(0, 0, host="127.0.0.1", taken=set()) == []

    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(
            UpError, match=f"port {port} on 127.0.0.1 is in use; set another TURNBUS_METRICS_PORT"
        ):
            worker_metrics_ports(port, 2, host="127.0.0.1", taken=set())
    with pytest.raises(UpError, match=f"port {port} is the gateway's"):
        worker_metrics_ports(port, 2, host="127.0.0.1", taken={port})
    with pytest.raises(UpError, match="TURNBUS_METRICS_PORT=65535 leaves no room for 2 workers"):
        worker_metrics_ports(65535, 2, host="127.0.0.1", taken=set())

    for _ in range(20):  # a base whose next port is free too
        base = free_port()
        try:
            assert worker_metrics_ports(base, 2, host="127.0.0.1", taken=set()) == [base, base + 1]
        except UpError:
            continue
        break
    else:
        raise AssertionError("no two consecutive free ports found")


def test_up_refuses_a_busy_port_and_a_locked_data_dir(tmp_path: Path) -> None:
    import socket

    env = {k: v for k, v in os.environ.items() if k not in UNSET_ENV}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "turnbus",
                "up",
                "--port",
                str(port),
                "--data-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
            check=False,
        )
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 is in use" in result.stdout
    assert not list((tmp_path / "logs").glob("*.log"))  # nothing was started

    import fcntl

    with (tmp_path / "up.lock").open("a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "turnbus",
                "up",
                "--port",
                str(free_port()),
                "--data-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
            check=False,
        )
    assert result.returncode == 1
    assert "another `turnbus up` is running" in result.stdout


def test_up_reports_a_redis_that_will_not_start(tmp_path: Path) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'FATAL: cannot open the AOF' >&2\nexit 3\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in UNSET_ENV}
    data_dir = tmp_path / "data"
    result = subprocess.run(
        [
            sys.executable, "-m", "turnbus", "up",
            "--port", str(free_port()),
            "--data-dir", str(data_dir),
            "--redis-server", str(fake),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "redis-server exited with code 3" in result.stdout
    assert "FATAL: cannot open the AOF" in result.stdout
    assert result.stderr == ""
    assert read_stack_file(data_dir) is None
    assert not (data_dir / "logs" / "gateway.log").exists()  # nothing started after Redis


def test_up_refuses_an_external_redis_url_option_it_cannot_honour(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from turnbus.supervisor import UpOptions, run_up

    env = {k: v for k, v in os.environ.items() if k not in UNSET_ENV}
    env["TURNBUS_REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0?socket_keepalive=true"
    data_dir = tmp_path / "data"
    assert run_up(UpOptions(port=free_port(), data_dir=data_dir), env) == 1
    out = capsys.readouterr().out
    assert "TURNBUS_REDIS_URL: the option 'socket_keepalive' is not supported" in out
    assert not (data_dir / "logs" / "gateway.log").exists()  # nothing started


@pytest.mark.cluster
def test_up_warns_when_a_cluster_has_more_masters_than_work_shards(
    redis_backend: str, request: pytest.FixtureRequest
) -> None:
    url = str(request.getfixturevalue("backend_url"))
    on_cluster = redis_backend == "cluster"
    for shards, warned in ((1, on_cluster), (3, False)):
        settings = Settings(redis_url=url, redis_cluster=on_cluster, shards=shards)
        client = connect_sync(settings, "admin")
        try:
            warning = shards_warning(settings, client)
        finally:
            client.close()
        assert bool(warning) == warned, warning
        if warning:
            assert "TURNBUS_SHARDS=1 is below the cluster's 3 masters" in warning

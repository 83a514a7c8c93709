"""The ``turnbus`` command: token, status, argument errors, and ``up``'s private Redis."""

from __future__ import annotations

import asyncio
import json
import shlex
import stat
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import jwt
import pytest
import redis as sync_redis
import redis.asyncio as aioredis

import turnbus
from harness.redis_server import redis_binary
from tests import ROOT
from turnbus.cli import main
from turnbus.gateway.auth import verify_token
from turnbus.hints import show_path, turnbus_command
from turnbus.procs import UpError, free_port
from turnbus.redis_local import PrivateRedis, redact_url
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.stackfile import (
    DEFAULT_DATA_DIR,
    NoStack,
    forget_stack,
    load_or_create_secret,
    read_secret,
    remember_stack,
    write_stack_file,
)

# --- token -----------------------------------------------------------------------------


def test_token_from_env_secret(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TURNBUS_JWT_SECRET", "s3cret-for-tests-0123456789abcdefghij")
    assert main(["token", "--user", "alice", "--ttl", "60"]) == 0
    token = capsys.readouterr().out.strip()
    assert verify_token("s3cret-for-tests-0123456789abcdefghij", token) == "alice"
    claims = jwt.decode(token, "s3cret-for-tests-0123456789abcdefghij", algorithms=["HS256"])
    assert claims["exp"] - claims["iat"] == 60


def test_token_mints_up_to_the_gateways_lifetime_cap(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = "s3cret-for-tests-0123456789abcdefghij"
    monkeypatch.setenv("TURNBUS_JWT_SECRET", secret)
    monkeypatch.delenv("TURNBUS_TOKEN_MAX_TTL_S", raising=False)
    assert main(["token", "--user", "alice", "--ttl", "86400"]) == 0
    assert verify_token(secret, capsys.readouterr().out.strip()) == "alice"
    # One second more is a usage error, not a token the gateway would refuse.
    assert main(["token", "--user", "alice", "--ttl", "86401"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "TURNBUS_TOKEN_MAX_TTL_S" in captured.err
    # An operator who raises the cap can mint up to it.
    monkeypatch.setenv("TURNBUS_TOKEN_MAX_TTL_S", str(7 * 86400))
    assert main(["token", "--user", "alice", "--ttl", str(7 * 86400)]) == 0
    token = capsys.readouterr().out.strip()
    assert verify_token(secret, token, max_ttl_s=7 * 86400) == "alice"


def test_token_from_the_up_stacks_secret_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TURNBUS_JWT_SECRET", raising=False)
    secret = load_or_create_secret(tmp_path)
    assert stat.S_IMODE((tmp_path / "jwt-secret").stat().st_mode) == 0o600
    assert load_or_create_secret(tmp_path) == secret == read_secret(tmp_path)
    assert main(["token", "--user", "dev", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert verify_token(secret, out.strip()) == "dev"
    assert secret not in out


def test_token_without_a_secret_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TURNBUS_JWT_SECRET", raising=False)
    assert main(["token", "--user", "dev", "--data-dir", str(tmp_path / "none")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "TURNBUS_JWT_SECRET" in captured.err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["launch"],
        ["token"],
        ["token", "--user", "a:b"],
        ["token", "--user", "dev", "--ttl", "0"],
        ["token", "--user", "dev", "--ttl", "soon"],
        ["up", "--port", "70000"],
        ["up", "--workers", "-1"],
        ["up", "--log-level", "loud"],
        ["worker", "--concurrency", "0"],
        ["worker", "--name", "has space"],
        ["gateway", "--port", "http"],
    ],
)
def test_argument_errors_exit_2_with_usage(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage: turnbus" in capsys.readouterr().err


def test_bad_setting_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TURNBUS_SHARDS", "many")
    assert main(["status", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert "TURNBUS_SHARDS must be an integer" in capsys.readouterr().err


def test_python_dash_m_turnbus_is_the_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "turnbus", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    for command in ("up", "gateway", "worker", "token", "chat", "status"):
        assert command in out


def test_version_prints_the_installed_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "turnbus", "--version"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == f"turnbus {metadata.version('turnbus')}"
    assert turnbus.__version__ == metadata.version("turnbus")


def test_hints_name_the_turnbus_that_runs_when_the_path_has_none(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no turnbus on it
    monkeypatch.delenv("TURNBUS_JWT_SECRET", raising=False)
    script = Path(sys.executable).parent / "turnbus"
    assert turnbus_command() == shlex.quote(show_path(script))
    assert main(["chat", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{turnbus_command()} up" in err and "`turnbus up`" not in err
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    assert turnbus_command() == "turnbus"


def test_chat_title_is_for_a_new_session(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chat", "--title", "x", "--session", "s_1"]) == 2
    assert "--title names a new session" in capsys.readouterr().err


def test_dev_token_finds_the_stack_from_a_parent_folder_or_the_state_pointer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    repo = tmp_path / "repo"
    data = repo / DEFAULT_DATA_DIR
    data.mkdir(parents=True)
    secret = load_or_create_secret(data)
    elsewhere = tmp_path / "elsewhere"
    (repo / "examples").mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(repo / "examples")
    with pytest.raises(NoStack, match="no running `turnbus up` found"):
        turnbus.dev_token()  # not running: no stack.json
    write_stack_file(data, {"url": "http://127.0.0.1:1"})
    assert verify_token(secret, turnbus.dev_token()) == "dev"
    monkeypatch.chdir(elsewhere)
    with pytest.raises(NoStack):
        turnbus.dev_token()
    remember_stack(data)
    assert verify_token(secret, turnbus.dev_token(user="ann")) == "ann"
    assert verify_token(secret, turnbus.dev_token(data)) == "dev"
    forget_stack(data)
    with pytest.raises(NoStack):
        turnbus.dev_token()


# --- status ----------------------------------------------------------------------------


@pytest.mark.cluster
async def test_status_reads_queue_pending_consumers_and_workers(
    redis: aioredis.Redis,
    settings: Settings,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    redis_url = settings.redis_url
    stream = Keys(prefix).work(0)
    for i in range(3):
        await redis.xadd(stream, {"turn": str(i)})
    await redis.xgroup_create(stream, "workers", id="0")
    await redis.xreadgroup("workers", "w-a", {stream: ">"}, count=1)
    now = int(time.time() * 1000)
    await redis.hset(f"{prefix}:workers", mapping={"w-a": now, "w-old": now - 600_000})
    monkeypatch.setenv("TURNBUS_PREFIX", prefix)
    monkeypatch.setenv("TURNBUS_SHARDS", "2")
    monkeypatch.setenv("TURNBUS_REDIS_CLUSTER", str(int(settings.redis_cluster)))

    # The command runs its own event loop, as it does in a process of its own.
    assert await asyncio.to_thread(main, ["status", "--redis-url", redis_url, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    first, second = status["shards"]
    assert (first["length"], first["waiting"], first["pending"], first["group"]) == (3, 2, 1, True)
    assert (second["length"], second["waiting"], second["group"]) == (0, 0, False)
    assert [(c["name"], c["pending"]) for c in status["consumers"]] == [("w-a", 1)]
    assert {w["name"]: w["live"] for w in status["workers"]} == {"w-a": True, "w-old": False}

    assert await asyncio.to_thread(main, ["status", "--url", redis_url]) == 0
    text = capsys.readouterr().out
    assert "w-a" in text
    assert "live workers" in text


def test_status_reports_an_unreachable_redis(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TURNBUS_SHARDS", raising=False)
    assert main(["status", "--redis-url", "redis://:pw@127.0.0.1:1/0"]) == 1
    err = capsys.readouterr().err
    assert "cannot read Redis at redis://:***@127.0.0.1:1/0" in err
    assert "pw" not in err


def test_status_without_a_stack_or_a_url_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("TURNBUS_REDIS_URL", "REDIS_URL", "TURNBUS_SHARDS"):
        monkeypatch.delenv(name, raising=False)
    # Not a silent read of 127.0.0.1:6379, which may be another project's Redis.
    assert main(["status", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"no running stack found in {tmp_path}" in err
    assert "--redis-url" in err and "TURNBUS_REDIS_URL" in err
    assert "6379" not in err


def test_reindex_sessions_lists_sessions_created_before_the_index(
    redis_url: str,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TURNBUS_PREFIX", prefix)
    client = sync_redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        # Two envelopes as an older version wrote them: no index entry.
        for session, at in (("s_a", 1000), ("s_b", 2000)):
            client.hset(
                f"{prefix}:{{alice:{session}}}:env", mapping={"createdAt": at, "updatedAt": at}
            )
        assert main(["reindex-sessions", "--redis-url", redis_url]) == 0
        assert "indexed 2 session(s)" in capsys.readouterr().out
        index = f"{prefix}:user:alice:sessions"
        assert client.zrevrangebylex(index, "+", "-") == [
            "0000000000002000:s_b",
            "0000000000001000:s_a",
        ]
        assert main(["reindex-sessions", "--redis-url", redis_url]) == 0
        assert "indexed 0 session(s)" in capsys.readouterr().out
    finally:
        for key in client.scan_iter(match=f"{prefix}:*"):
            client.delete(key)
        client.close()


def test_redact_url() -> None:
    assert redact_url("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


# --- up's private Redis ----------------------------------------------------------------


def test_private_redis_keeps_data_across_restarts_in_its_aof(tmp_path: Path) -> None:
    directory, log = tmp_path / "redis", tmp_path / "redis.log"
    first = PrivateRedis(directory, log, binary=redis_binary())
    first.start()
    try:
        assert first.port != 6379
        client = sync_redis.Redis.from_url(first.url, decode_responses=True)
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        client.set("session", "kept")
        client.close()
    finally:
        first.stop()
    assert first.child is not None
    assert first.child.poll() == 0

    second = PrivateRedis(directory, log, binary=redis_binary())
    second.start()
    try:
        client = sync_redis.Redis.from_url(second.url, decode_responses=True)
        assert client.get("session") == "kept"
        client.close()
    finally:
        second.stop()


def test_private_redis_on_a_busy_port_says_so(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        private = PrivateRedis(tmp_path, tmp_path / "redis.log", port=port, binary=redis_binary())
        with pytest.raises(
            UpError, match=f"port {port} on 127.0.0.1 is in use; pass another --redis-port"
        ):
            private.start()


# --- docs and compose stay in step with the settings -----------------------------------


def _env_var(field: str) -> str:
    return "TURNBUS_" + field.upper()


def test_operations_settings_table_lists_every_setting() -> None:
    import dataclasses
    import inspect

    import turnbus.shared.settings
    from turnbus.shared.settings import Settings

    source = inspect.getsource(turnbus.shared.settings)
    rows = [
        line
        for line in (ROOT / "docs/operations.md").read_text().splitlines()
        if line.startswith("| `TURNBUS_")
    ]
    for field in dataclasses.fields(Settings):
        env = _env_var(field.name)
        assert f'"{env}"' in source, f"{env} is not read by Settings.from_env"
        row = next((r for r in rows if r.startswith(f"| `{env}`")), None)
        assert row is not None, f"docs/operations.md has no row for {env}"
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == f"`{field.name}`", row
        default = field.default
        shown = "none" if default in (None, ()) else f"`{default}`"
        assert cells[2] == shown, f"{env}: the docs say {cells[2]}, Settings says {shown}"


def test_compose_file_runs_redis_with_aof_and_two_workers() -> None:
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "gateway", "worker"}
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    assert redis_cmd[redis_cmd.index("--appendfsync") + 1] == "everysec"
    assert services["worker"]["deploy"]["replicas"] == 2
    assert services["worker"]["command"] == ["turnbus", "worker"]
    assert services["gateway"]["command"][:2] == ["turnbus", "gateway"]
    import dataclasses

    from turnbus.shared.settings import Settings

    known = {_env_var(f.name) for f in dataclasses.fields(Settings)} | {
        "ANTHROPIC_API_KEY",
        "ANTHROPIC_BASE_URL",
        "OPENAI_API_KEY",
        "OPENAI_BASE_URL",
    }
    for name in ("gateway", "worker"):
        env = services[name]["environment"]
        assert set(env) <= known, set(env) - known
        assert env["TURNBUS_REDIS_URL"] == "redis://redis:6379/0"


def test_free_ports_come_from_below_the_kernels_range_for_outgoing_connections() -> None:
    # A port from the ephemeral range, let go until the server binds it, may become the
    # local end of another process's outgoing connection meanwhile (a gateway then
    # fails with "address already in use"); below it no outgoing connection takes it.
    range_file = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not range_file.exists():
        pytest.skip("no Linux ephemeral port range to stay below")
    low = int(range_file.read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(20000 <= port < low for port in ports), ports

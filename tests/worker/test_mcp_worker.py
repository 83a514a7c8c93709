"""MCP servers in a running worker: a turn calls their tools through the round's
pipeline, and a bad config stops the worker's start with a clear message."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from harness.waits import poll
from tests.mcp_kit import REPO, stdio_entry, write_config
from tests.worker_kit import ProgramModel, rounds, running_worker, wait_terminal
from turnbus.cli import main
from turnbus.procs import free_port
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.events import ToolResult, TurnCompleted
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.base import ModelRequest, RoundResult, TextChunk, ToolUse, UsageCounts

pytestmark = [pytest.mark.slow]

SECRET = "sk-worker-9d8c7b6a5f4e3d2c"


def _round_calling(*uses: ToolUse) -> list[TextChunk | RoundResult]:
    content = [{"type": "tool_use", "id": u.id, "name": u.name, "input": u.input} for u in uses]
    return [RoundResult("tool_use", content, list(uses), UsageCounts(10, 5))]


def _answer(text: str) -> list[TextChunk | RoundResult]:
    return [
        TextChunk(text),
        RoundResult("end_turn", [{"type": "text", "text": text}], [], UsageCounts(10, 5)),
    ]


async def test_a_turn_calls_mcp_tools_through_the_pipeline(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    tmp_path: Path,
) -> None:
    config = write_config(tmp_path, {"t": stdio_entry(env={"MCP_TEST_SECRET": SECRET})})
    settings = dataclasses.replace(settings, mcp_config=str(config))
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        if index == 0:
            return _round_calling(
                ToolUse("toolu_a", "t__echo", {"text": "from the turn"}),
                ToolUse("toolu_b", "t__fail", {"message": "it broke"}),
                ToolUse("toolu_c", "t__whoami", {}),
            )
        return _answer("done")

    model = ProgramModel(program)
    async with running_worker(settings, model) as worker:
        record, _, _ = await turns.submit_queued("u1", "s1", "go", multitask="reject")
        events = await wait_terminal(redis, keys, "u1", "s1", record.turnId, within=20)
        results = {e.callId: e for e in events if isinstance(e, ToolResult)}
        assert results["toolu_a"].output == "from the turn" and not results["toolu_a"].isError
        assert results["toolu_b"].isError and "it broke" in results["toolu_b"].output
        identity = json.loads(results["toolu_c"].output)
        assert identity["turnbus/callId"] == "toolu_c"
        assert identity["turnbus/turnId"] == record.turnId
        assert identity["turnbus/userId"] == "u1" and identity["turnbus/sessionId"] == "s1"
        offered = [spec["name"] for spec in model.requests[0].tools]
        assert "t__echo" in offered and "t__drop" in offered
        status = worker.tools.status()["t"]
        assert status["state"] == "up" and status["tools"] > 0
        assert SECRET not in json.dumps(worker.tools.status())
    raw = json.dumps([str(e) for e in events])
    assert SECRET not in raw


async def test_a_server_killed_mid_turn_gives_an_error_result_then_serves_the_next_turn(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    tmp_path: Path,
) -> None:
    config = write_config(tmp_path, {"t": stdio_entry()})
    settings = dataclasses.replace(settings, mcp_config=str(config))
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    started = tmp_path / "hang.started"

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        last = request.messages[-1]["content"][0]
        if last.get("type") == "tool_result":
            return _answer("done")
        if last.get("text") == "hang":
            return _round_calling(
                ToolUse("toolu_h", "t__hang", {"seconds": 30, "started": str(started)})
            )
        return _round_calling(ToolUse("toolu_e", "t__echo", {"text": "back again"}))

    async with running_worker(settings, ProgramModel(program)) as worker:
        first, _, _ = await turns.submit_queued("u1", "s1", "hang", multitask="reject")
        await poll(started.exists, within=20, what="the server to run the call")
        os.kill(worker.tools.status()["t"]["pid"], signal.SIGKILL)
        events = await wait_terminal(redis, keys, "u1", "s1", first.turnId, within=20)
        (lost,) = [e for e in events if isinstance(e, ToolResult)]
        assert lost.isError and "outcome of this call is unknown" in lost.output
        assert isinstance(events[-1], TurnCompleted)

        await poll(
            lambda: worker.tools.status()["t"]["reconnects"] >= 1,
            within=20,
            what="the server to be reconnected",
        )
        second, _, _ = await turns.submit_queued("u1", "s1", "echo", multitask="reject")
        events = await wait_terminal(redis, keys, "u1", "s1", second.turnId, within=20)
        (echo,) = [e for e in events if isinstance(e, ToolResult)]
        assert (echo.output, echo.isError) == ("back again", False)


async def test_readyz_and_turnbus_status_show_each_servers_state_and_the_metrics_port(
    settings: Settings,
    prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = write_config(tmp_path, {"t": stdio_entry(env={"MCP_TEST_SECRET": SECRET})})
    port = free_port()
    settings = dataclasses.replace(settings, mcp_config=str(config), metrics_port=port)
    monkeypatch.setenv("TURNBUS_PREFIX", prefix)
    monkeypatch.setenv("TURNBUS_REDIS_CLUSTER", str(int(settings.redis_cluster)))
    async with (
        running_worker(settings, ProgramModel(rounds()), name="w-mcp"),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http,
    ):
        ready = await http.get("/readyz")
        assert ready.status_code == 200
        detail = ready.json()["tools"]["t"]
        assert detail["state"] == "up" and detail["transport"] == "stdio"
        assert detail["reconnects"] == 0 and detail["tools"] > 0
        assert SECRET not in ready.text

        argv = ["status", "--redis-url", settings.redis_url, "--json"]
        assert await asyncio.to_thread(main, argv) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["toolSources"]["w-mcp"]["t"]["state"] == "up"
        (worker,) = [w for w in status["workers"] if w["name"] == "w-mcp"]
        assert worker["metricsPort"] == port
        assert await asyncio.to_thread(main, argv[:-1]) == 0
        text = capsys.readouterr().out
        assert "stdio up" in text and SECRET not in text
        assert f"metrics port {port}\n" in text


def _turnbus(config: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m turnbus <args>`` with ``TURNBUS_MCP_CONFIG`` and no other TURNBUS_ knob."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("TURNBUS_")}
    full.update(env, TURNBUS_MCP_CONFIG=str(config))
    return subprocess.run(
        [sys.executable, "-m", "turnbus", *args],
        env=full,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize(
    ("servers", "expected"),
    [
        ('{"servers": {"files": {"command": "x",}}}', "not valid JSON"),
        (
            json.dumps(
                {"servers": {"files": {"command": "no-such-mcp-binary", "env": {"K": SECRET}}}}
            ),
            "server 'files': command 'no-such-mcp-binary' not found",
        ),
    ],
)
def test_a_bad_config_stops_the_worker_with_a_message_not_a_traceback(
    tmp_path: Path, redis_url: str, servers: str, expected: str
) -> None:
    config = tmp_path / "mcp.json"
    config.write_text(servers)
    done = _turnbus(
        config,
        "worker",
        "--name",
        "mcp-refused",
        TURNBUS_REDIS_URL=redis_url,
        TURNBUS_MODEL="scripted",
    )
    assert done.returncode == 2
    assert expected in done.stderr and str(config) in done.stderr
    assert "Traceback" not in done.stderr
    assert SECRET not in done.stderr + done.stdout


def test_turnbus_up_refuses_a_bad_config_before_it_starts_anything(tmp_path: Path) -> None:
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"servers": {"files": {"url": "ftp://nowhere"}}}))
    data_dir = tmp_path / "data"
    done = _turnbus(config, "up", "--port", str(free_port()), "--data-dir", str(data_dir))
    assert done.returncode == 1
    assert f"MCP config {config}: server 'files'" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    assert not (data_dir / "logs").exists()  # not even Redis was started

"""The MCP tool source against the real test server (tests/mcp_server.py) in its own
process, over stdio and streamable HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import mcp_types
import pytest

from harness.waits import poll
from tests.mcp_kit import HttpMcpServer, stdio_entry
from turnbus.worker.mcp_config import McpServerConfig, parse_mcp_config
from turnbus.worker.mcp_source import (
    McpStartError,
    McpToolSource,
    call_result_text,
    is_idempotent,
    prefixed_name,
)
from turnbus.worker.toolsource import RegisteredTool, ToolCallResult, ToolContext

pytestmark = [pytest.mark.slow]  # each test starts the MCP server's process

SECRET = "sk-test-5f1e9c0d7a2b4e6f"
CTX = ToolContext(user_id="u1", session_id="s1", turn_id="t1", call_id="toolu_1")
FAST = {"backoff_initial_s": 0.05, "backoff_max_s": 0.5, "ping_interval_s": 0.5}


def _config(entry: dict[str, Any], name: str = "t") -> McpServerConfig:
    (config,) = parse_mcp_config({"servers": {name: entry}}, where="test.json")
    return config


@contextlib.asynccontextmanager
async def _source(entry: dict[str, Any], name: str = "t") -> AsyncIterator[McpToolSource]:
    source = McpToolSource(_config(entry, name), **FAST)
    await source.start()
    try:
        yield source
    finally:
        await source.aclose()


def _tool(source: McpToolSource, name: str, **changes: Any) -> RegisteredTool:
    tool = next(t for t in source.tools() if t.name == f"{source.name}__{name}")
    return dataclasses.replace(tool, **changes)


async def _call(source: McpToolSource, name: str, /, **arguments: Any) -> tuple[str, bool]:
    result = await source.call(_tool(source, name), arguments, CTX)
    return result.output, result.is_error


async def _hang_in_flight(source: McpToolSource, tmp_path: Path) -> asyncio.Task[ToolCallResult]:
    """A call of ``hang`` that the server is running now."""
    started = tmp_path / "hang.started"
    hang = _tool(source, "hang", timeout_s=20)
    call = source.call(hang, {"seconds": 30, "started": str(started)}, CTX)
    pending = asyncio.create_task(call)
    await poll(started.exists, what="the server to run the call")
    return pending


# --- names, rerun rules, results --------------------------------------------------------


def test_names_are_prefixed_and_fit_the_model_apis() -> None:
    assert prefixed_name("files", "read") == "files__read"
    assert prefixed_name("files", "a.b c") == "files__a_b_c"
    long = prefixed_name("files", "x" * 80)
    assert len(long) == 64 and long.startswith("files__xxx")
    clash = prefixed_name("files", "a.b", taken=["files__a_b"])
    assert clash != "files__a_b" and clash.startswith("files__a_b_")


@pytest.mark.parametrize(
    ("hints", "idempotent"),
    [
        (None, False),
        ({}, False),
        ({"readOnlyHint": True}, True),
        ({"idempotentHint": True}, True),
        ({"destructiveHint": True}, False),
        ({"readOnlyHint": False, "destructiveHint": False}, False),
    ],
)
def test_annotations_decide_the_rerun_rule(hints: dict[str, Any] | None, idempotent: bool) -> None:
    annotations = None if hints is None else mcp_types.ToolAnnotations.model_validate(hints)
    assert is_idempotent(annotations) is idempotent


def test_results_join_text_and_fall_back_to_structured_content() -> None:
    result = mcp_types.CallToolResult(
        content=[mcp_types.TextContent(text="a"), mcp_types.TextContent(text="b")],
        structured_content={"ignored": True},
    )
    assert call_result_text(result).output == "a\nb"
    structured = mcp_types.CallToolResult(content=[], structured_content={"n": 1})
    assert json.loads(call_result_text(structured).output) == {"n": 1}
    failed = mcp_types.CallToolResult(content=[mcp_types.TextContent(text="no")], is_error=True)
    assert call_result_text(failed).is_error


# --- stdio ------------------------------------------------------------------------------


async def test_stdio_tools_are_listed_prefixed_with_schemas_and_rerun_rules() -> None:
    async with _source(stdio_entry()) as source:
        tools = {t.name: t for t in source.tools()}
        assert list(tools) == sorted(tools)
        assert "t__echo" in tools and "t__dotted_name" in tools
        echo = tools["t__echo"]
        assert echo.source == "t" and echo.description == "Echo the text back."
        assert echo.input_schema["type"] == "object"
        assert echo.input_schema["required"] == ["text"]
        assert tools["t__lookup"].idempotent and tools["t__put"].idempotent
        assert not tools["t__drop"].idempotent and not tools["t__note"].idempotent
        assert source.status() == {
            "name": "t",
            "transport": "stdio",
            "state": "up",
            "tools": len(tools),
            "reconnects": 0,
            "lastError": None,
            "pid": source.status()["pid"],
        }


async def test_the_config_marks_the_tools_that_require_approval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with _source(stdio_entry(requiresApproval=["drop", "gone"])) as source:
        tools = {t.name: t for t in source.tools()}
    assert tools["t__drop"].requires_approval
    assert not any(t.requires_approval for name, t in tools.items() if name != "t__drop")
    assert "requiresApproval names 'gone', which the server does not list" in caplog.text
    async with _source(stdio_entry(requiresApproval=True)) as source:
        assert all(t.requires_approval for t in source.tools())


async def test_stdio_calls_answer_errors_and_structured_content() -> None:
    async with _source(stdio_entry()) as source:
        assert await _call(source, "echo", text="hello") == ("hello", False)
        assert await _call(source, "dotted_name") == ("dotted", False)
        output, is_error = await _call(source, "fail", message="it broke")
        assert is_error and "it broke" in output
        output, is_error = await _call(source, "stats", word="abc")
        assert not is_error and json.loads(output) == {"word": "abc", "length": 3}
        identity = json.loads((await _call(source, "whoami"))[0])
        assert identity == {
            "turnbus/callId": "toolu_1",
            "turnbus/sessionId": "s1",
            "turnbus/turnId": "t1",
            "turnbus/userId": "u1",
        }


async def test_a_hanging_call_times_out_and_the_server_stays_usable() -> None:
    async with _source(stdio_entry()) as source:
        hang = _tool(source, "hang", timeout_s=0.3)
        result = await source.call(hang, {"seconds": 30}, CTX)
        assert result.is_error and "timed out after 1.3 s" in result.output
        assert await _call(source, "echo", text="still here") == ("still here", False)
        assert source.status()["state"] == "up"


async def test_a_killed_stdio_server_gives_error_results_then_comes_back(
    tmp_path: Path,
) -> None:
    async with _source(stdio_entry()) as source:
        first_pid = source.status()["pid"]
        pending = await _hang_in_flight(source, tmp_path)
        os.kill(first_pid, signal.SIGKILL)
        result = await asyncio.wait_for(pending, 10)
        assert result.is_error and "outcome of this call is unknown" in result.output

        output, is_error = await _call(source, "echo", text="x")
        assert is_error and "unavailable" in output and "not made" in output

        await poll(lambda: source.status()["state"] == "up", within=20, what="the reconnect")
        assert source.status()["reconnects"] >= 1
        assert source.status()["pid"] != first_pid
        assert await _call(source, "echo", text="back") == ("back", False)


async def test_shutdown_kills_the_servers_whole_process_group(tmp_path: Path) -> None:
    child_pid_file = tmp_path / "child.pid"
    async with _source(stdio_entry("--child-pid-file", str(child_pid_file))) as source:
        assert await _call(source, "echo", text="x") == ("x", False)
        child = int(child_pid_file.read_text())
        server = source.status()["pid"]
    assert source.status()["state"] == "closed"
    for pid in (server, child):
        await poll(lambda pid=pid: not _alive(pid), what=f"process {pid} to die")


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


async def test_env_reaches_the_server_and_never_the_status_or_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with _source(stdio_entry(env={"MCP_TEST_SECRET": SECRET})) as source:
        assert await _call(source, "has_env", name="MCP_TEST_SECRET") == ("yes", False)
        assert await _call(source, "has_env", name="TURNBUS_JWT_SECRET") == ("no", False)
        os.kill(source.status()["pid"], signal.SIGKILL)
        await poll(lambda: source.status()["reconnects"] >= 1, within=20, what="a reconnect")
        assert SECRET not in json.dumps(source.status())
    assert SECRET not in caplog.text


async def test_a_server_that_exits_at_once_fails_the_start() -> None:
    entry = {"command": "python3", "args": ["-c", "pass"], "connect_timeout_s": 5}
    with pytest.raises(McpStartError, match=r"MCP server 'gone' \(stdio\): could not connect"):
        await McpToolSource(_config(entry, "gone"), **FAST).start()


async def test_a_server_that_never_answers_fails_the_start_in_its_bound() -> None:
    entry = {"command": "sleep", "args": ["30"], "connect_timeout_s": 0.5}
    with pytest.raises(McpStartError, match=r"no answer to initialize and tools/list in 0.5 s"):
        await McpToolSource(_config(entry, "mute"), **FAST).start()


# --- streamable HTTP --------------------------------------------------------------------


async def test_http_tools_are_listed_called_and_timed_out(http_mcp_server: HttpMcpServer) -> None:
    entry = {"url": http_mcp_server.url, "headers": {"X-Api-Key": SECRET}}
    async with _source(entry, "web") as source:
        assert "web__echo" in {t.name for t in source.tools()}
        assert source.status()["url"] == http_mcp_server.url
        assert await _call(source, "echo", text="over http") == ("over http", False)
        assert await _call(source, "has_header", name="X-Api-Key") == ("yes", False)
        output, is_error = await _call(source, "fail", message="nope")
        assert is_error and "nope" in output
        hang = _tool(source, "hang", timeout_s=0.3)
        result = await source.call(hang, {"seconds": 30}, CTX)
        assert result.is_error and "timed out" in result.output
        assert await _call(source, "echo", text="again") == ("again", False)


async def test_a_killed_http_server_gives_error_results_then_comes_back(
    http_mcp_server: HttpMcpServer, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.DEBUG)
    entry = {"url": http_mcp_server.url + f"?key={SECRET}", "headers": {"Authorization": SECRET}}
    async with _source(entry, "web") as source:
        pending = await _hang_in_flight(source, tmp_path)
        http_mcp_server.kill()
        result = await asyncio.wait_for(pending, 10)
        assert result.is_error and "outcome of this call is unknown" in result.output

        await poll(lambda: source.status()["state"] != "up", what="the drop to be seen")
        output, is_error = await _call(source, "echo", text="x")
        assert is_error and "unavailable" in output

        await http_mcp_server.start()
        await poll(lambda: source.status()["state"] == "up", within=20, what="the reconnect")
        assert await _call(source, "echo", text="back") == ("back", False)
        assert SECRET not in json.dumps(source.status())
    assert SECRET not in caplog.text


async def test_an_unreachable_http_server_fails_the_start_without_secrets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from turnbus.procs import free_port

    caplog.set_level(logging.DEBUG)
    entry = {
        "url": f"http://127.0.0.1:{free_port()}/mcp?token={SECRET}",
        "headers": {"Authorization": f"Bearer {SECRET}"},
        "connect_timeout_s": 5,
    }
    with pytest.raises(McpStartError, match=r"MCP server 'web' \(http\)") as caught:
        await McpToolSource(_config(entry, "web"), **FAST).start()
    assert SECRET not in str(caught.value)
    assert SECRET not in caplog.text


async def test_an_http_server_restarted_while_idle_is_connected_again(
    http_mcp_server: HttpMcpServer,
) -> None:
    async with _source({"url": http_mcp_server.url}, "web") as source:
        assert await _call(source, "echo", text="first") == ("first", False)
        http_mcp_server.kill()
        await http_mcp_server.start()  # a new process, which knows no session
        await poll(
            lambda: source.status()["state"] == "up" and source.status()["reconnects"] >= 1,
            within=20,
            what="a new connection",
        )
        assert await _call(source, "echo", text="again") == ("again", False)


async def _a_5_mb_result_arrives_whole(source: McpToolSource) -> None:
    """The pipeline, not the source, cuts a result to its tool's cap."""
    output, is_error = await _call(source, "big", size=5_000_000)
    assert not is_error and len(output) == 5_000_000
    assert await _call(source, "echo", text="after") == ("after", False)


async def test_a_5_mb_result_arrives_whole_over_stdio() -> None:
    async with _source(stdio_entry()) as source:
        await _a_5_mb_result_arrives_whole(source)


async def test_a_5_mb_result_arrives_whole_over_http(http_mcp_server: HttpMcpServer) -> None:
    async with _source({"url": http_mcp_server.url}) as source:
        await _a_5_mb_result_arrives_whole(source)

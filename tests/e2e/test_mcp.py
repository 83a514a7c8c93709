"""MCP servers through the whole stack, as a user runs them: ``turnbus up`` with
``TURNBUS_MCP_CONFIG`` naming a stdio and a streamable HTTP server (the test server,
tests/mcp_server.py, in processes of their own), the scripted model calling their tools
in a real turn, the Python client and ``GET /v1/tools``."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.redis_server import free_port
from harness.waits import poll
from tests.mcp_kit import HttpMcpServer, stdio_entry, write_config
from tests.up_process import running_up
from turnbus import AsyncClient
from turnbus.gateway.auth import mint_token
from turnbus.shared.events import TextDelta, ToolCall, ToolResult, TurnCompleted
from turnbus.stackfile import read_secret

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SECRET = "sk-e2e-0a1b2c3d4e5f6a7b"


async def test_mcp_tools_are_called_in_a_real_turn_through_turnbus_up(
    tmp_path: Path, http_mcp_server: HttpMcpServer
) -> None:
    config = write_config(
        tmp_path,
        {
            "local": stdio_entry(env={"MCP_TEST_SECRET": SECRET}),
            "web": {"url": http_mcp_server.url, "headers": {"X-Api-Key": SECRET}},
        },
    )
    data_dir = tmp_path / "data"
    out = tmp_path / "up.txt"
    async with running_up(data_dir, free_port(), out, TURNBUS_MCP_CONFIG=str(config)) as up:
        stack = await up.ready()
        secret = read_secret(data_dir)
        assert secret is not None
        async with AsyncClient(stack["url"], mint_token(secret, "dev", 600)) as client:
            # The stack is ready before its workers have connected to their MCP servers.
            listed = await poll(client.tools, within=30, what="the workers' MCP tools")
            tools = {t.name: t for t in listed}
            assert {"local__echo", "local__lookup", "web__echo", "web__has_header"} <= set(tools)
            assert tools["local__lookup"].idempotent and not tools["local__drop"].idempotent
            assert tools["web__echo"].source == "web"
            session = await client.create_session()
            message = "\n".join(
                [
                    'call local__echo {"text": "over stdio"}',
                    'call web__echo {"text": "over http"}',
                    'call local__has_env {"name": "MCP_TEST_SECRET"}',
                    'call web__has_header {"name": "X-Api-Key"}',
                    'call local__fail {"message": "it broke"}',
                ]
            )
            stream = await client.run_turn(session.session_id, message)
            events = [e async for e in stream]
        log = up.output()
    assert isinstance(events[-1], TurnCompleted), events[-1]
    calls = [e for e in events if isinstance(e, ToolCall)]
    results = {e.callId: e for e in events if isinstance(e, ToolResult)}
    assert [c.name for c in calls] == [
        "local__echo",
        "web__echo",
        "local__has_env",
        "web__has_header",
        "local__fail",
    ]
    answers = [results[c.callId] for c in calls]
    assert [(r.output, r.isError) for r in answers[:4]] == [
        ("over stdio", False),
        ("over http", False),
        ("yes", False),
        ("yes", False),
    ]
    assert answers[4].isError and "it broke" in answers[4].output
    # The scripted model's next round answers with each result's text, in order.
    text = "".join(e.text for e in events if isinstance(e, TextDelta) and e.round == 2)
    assert text.index("over stdio") < text.index("over http") < text.index("it broke")
    assert SECRET not in repr(events)
    assert SECRET not in log

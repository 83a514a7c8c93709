"""The example tool module (examples/tools.py) through the whole stack, as a user runs
it: ``turnbus up`` with ``TURNBUS_TOOLS`` naming it, the scripted model calling its
tools, the Python client and ``GET /v1/tools``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.redis_server import free_port
from tests import ROOT
from tests.up_process import running_up
from turnbus import AsyncClient
from turnbus.gateway.auth import mint_token
from turnbus.shared.events import ToolCall, ToolResult, TurnCompleted
from turnbus.stackfile import read_secret

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def test_the_example_tools_work_end_to_end_through_turnbus_up(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    appended = tmp_path / "appended.txt"
    env = {
        "TURNBUS_TOOLS": str(ROOT / "examples" / "tools.py"),
        "EXAMPLE_APPEND_FILE": str(appended),
    }
    async with running_up(data_dir, free_port(), tmp_path / "up.txt", **env) as up:
        stack = await up.ready()
        secret = read_secret(data_dir)
        assert secret is not None
        token = mint_token(secret, "dev", 600)
        async with AsyncClient(stack["url"], token) as client:
            names = [t.name for t in await client.tools()]
            assert {"lookup", "append_line"} <= set(names)
            session = await client.create_session(
                {"allowedTools": json.dumps(["lookup", "append_line"])}
            )
            message = "\n".join(
                [
                    'call lookup {"term": "lease"}',
                    'call append_line {"line": "the build is green"}',
                ]
            )
            stream = await client.run_turn(session.session_id, message)
            events = [e async for e in stream]
    decoded = events
    assert isinstance(decoded[-1], TurnCompleted), decoded[-1]
    calls = [e for e in decoded if isinstance(e, ToolCall)]
    results = {e.callId: e for e in decoded if isinstance(e, ToolResult)}
    assert [c.name for c in calls] == ["lookup", "append_line"]
    lookup, append = (results[c.callId] for c in calls)
    assert not lookup.isError and lookup.output.startswith("the session's lock")
    assert not append.isError and append.output.startswith("appended ")
    lines = appended.read_text().splitlines()
    assert lines == [f"{session.session_id} {calls[1].callId} the build is green"]

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.mcp_kit import stdio_entry, write_config
from turnbus.worker.mcp_config import (
    DEFAULT_CALL_TIMEOUT_S,
    McpConfigError,
    McpHttpServer,
    McpStdioServer,
    load_mcp_config,
)
from turnbus.worker.toolsource import ToolSourceError

SECRET = "sk-live-0123456789abcdef"


def _error(tmp_path: Path, servers: Any) -> str:
    path = write_config(tmp_path, servers)
    with pytest.raises(McpConfigError) as caught:
        load_mcp_config(path)
    message = str(caught.value)
    assert str(path) in message
    assert SECRET not in message
    return message


def test_a_good_file_gives_both_kinds(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        {
            "local": stdio_entry(env={"TOKEN": SECRET}, timeout_s=5),
            "remote": {"url": "https://mcp.example/mcp", "headers": {"Authorization": SECRET}},
        },
    )
    local, remote = load_mcp_config(path)
    assert isinstance(local, McpStdioServer) and local.name == "local"
    assert local.command == sys.executable and local.timeout_s == 5.0
    assert isinstance(remote, McpHttpServer) and remote.timeout_s == DEFAULT_CALL_TIMEOUT_S
    assert remote.display_url == "https://mcp.example/mcp"
    assert SECRET not in repr(local) and SECRET not in repr(remote)


def test_malformed_json_names_the_file_and_the_place(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    path.write_text('{"servers": {"a": {"command": "x",}}}')
    with pytest.raises(McpConfigError, match=r"not valid JSON: .* line 1, column \d+") as caught:
        load_mcp_config(path)
    assert str(path) in str(caught.value)
    assert isinstance(caught.value, ToolSourceError)  # the worker refuses to start


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(McpConfigError, match="cannot be read") as caught:
        load_mcp_config(tmp_path / "absent.json")
    assert "absent.json" in str(caught.value)


@pytest.mark.parametrize("data", [[], {"servers": []}, {"mcpServers": {}}])
def test_the_wrong_shape_says_the_right_one(tmp_path: Path, data: Any) -> None:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps(data))
    with pytest.raises(McpConfigError, match=re.escape('expected an object {"servers"')):
        load_mcp_config(path)


def test_a_missing_command_names_the_entry(tmp_path: Path) -> None:
    message = _error(tmp_path, {"files": {"command": "no-such-mcp-server-here", "args": []}})
    assert "server 'files'" in message and "'no-such-mcp-server-here' not found" in message


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"args": ["x"]}, 'needs "command" (a stdio server) or "url"'),
        ({"command": ""}, '"command" must be a non-empty string'),
        ({"command": sys.executable, "args": "x"}, '"args" must be a list of strings'),
        ({"command": sys.executable, "url": "http://h/"}, 'has both "command" and "url"'),
        ({"command": sys.executable, "env": {"TOKEN": 5}}, "\"env\" entry 'TOKEN'"),
        ({"command": sys.executable, "envs": {}}, "unknown key 'envs'"),
        ({"command": sys.executable, "timeout_s": 0}, '"timeout_s" must be a number'),
        ({"command": sys.executable, "type": "http"}, 'does not fit a "command" entry'),
        ({"url": "ftp://h/mcp"}, '"url" must be an http:// or https:// URL'),
        ({"url": "http://h:99999/mcp"}, '"url" must be an http:// or https:// URL'),
        ({"url": "http://h/mcp", "headers": [SECRET]}, '"headers" must be an object'),
        ({"url": "http://h/mcp", "command_": 1}, "unknown key 'command_'"),
    ],
)
def test_a_bad_entry_is_named_with_its_fault(
    tmp_path: Path, entry: dict[str, Any], expected: str
) -> None:
    message = _error(tmp_path, {"srv": entry})
    assert "server 'srv'" in message and expected in message


def test_a_bad_server_name_is_refused(tmp_path: Path) -> None:
    assert "server name 'a.b'" in _error(tmp_path, {"a.b": stdio_entry()})
    assert "reserved" in _error(tmp_path, {"python": stdio_entry()})


def test_an_env_value_of_the_wrong_type_is_never_quoted(tmp_path: Path) -> None:
    message = _error(tmp_path, {"srv": {"command": sys.executable, "env": {"K": [SECRET]}}})
    assert "'K'" in message


def test_a_url_with_credentials_shows_without_them(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"r": {"url": f"https://u:{SECRET}@h:8443/mcp?key={SECRET}"}})
    (remote,) = load_mcp_config(path)
    assert isinstance(remote, McpHttpServer)
    assert remote.display_url == "https://h:8443/mcp"
    assert f"key={SECRET}" in remote.secrets and SECRET in remote.secrets


def test_requires_approval_is_true_false_or_a_list_of_tool_names(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        {
            "all": stdio_entry(requiresApproval=True),
            "some": stdio_entry(requiresApproval=["drop", "put"]),
            "none": stdio_entry(),
        },
    )
    every, some, none = load_mcp_config(path)
    assert every.requires_approval is True
    assert some.requires_approval == frozenset({"drop", "put"})
    assert none.requires_approval is False
    for bad in ("yes", ["drop", "drop"], [""], [3], {"drop": True}):
        message = _error(tmp_path, {"s": stdio_entry(requiresApproval=bad)})
        assert "server 's': \"requiresApproval\" must be true, false or a list" in message

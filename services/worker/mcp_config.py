"""The MCP config file (``TURNBUS_MCP_CONFIG``): which MCP servers the worker connects to.

The shape users know from other hosts::

    {"servers": {
        "files": {"command": "uvx", "args": ["mcp-server-files"], "env": {"TOKEN": "..."}},
        "search": {"url": "https://search.example/mcp", "headers": {"Authorization": "..."}}
    }}

An entry with ``command`` is a stdio server, one with ``url`` a streamable HTTP server.
Either may also set ``timeout_s`` (each call's bound), ``connect_timeout_s`` (the
connect, ``initialize`` and tool listing) and ``requiresApproval`` (``true``: every
tool of the server waits for a person's approval before it runs; a list of the
server's own tool names: those do). A stdio entry may set ``cwd``. Everything
wrong with the file is a :class:`McpConfigError` that names the file and the entry;
no message ever quotes a value of ``env`` or ``headers``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from turnbus.worker.toolsource import ToolSourceError

__all__ = [
    "DEFAULT_CALL_TIMEOUT_S",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "McpConfigError",
    "McpHttpServer",
    "McpServerConfig",
    "McpStdioServer",
    "load_mcp_config",
    "parse_mcp_config",
]

DEFAULT_CALL_TIMEOUT_S = 30.0
DEFAULT_CONNECT_TIMEOUT_S = 15.0

# A tool's name is "<server>__<tool>" and must fit the model APIs' 64 characters.
_SERVER_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,40}$")
_RESERVED_NAMES = frozenset({"python"})  # the Python tools' source
_COMMON_KEYS = frozenset({"type", "timeout_s", "connect_timeout_s", "requiresApproval"})
_STDIO_KEYS = _COMMON_KEYS | {"command", "args", "env", "cwd"}
_HTTP_KEYS = _COMMON_KEYS | {"url", "headers"}
_STDIO_TYPES = frozenset({"stdio"})
_HTTP_TYPES = frozenset({"http", "streamable-http", "streamable_http", "streamableHttp"})


class McpConfigError(ToolSourceError):
    """The MCP config file cannot be used; the message names the file and the entry."""


@dataclasses.dataclass(frozen=True, slots=True)
class McpStdioServer:
    name: str
    command: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False)
    cwd: str | None = None
    timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    # True: all the server's tools require approval; else the names (the server's own).
    requires_approval: bool | frozenset[str] = False

    @property
    def transport(self) -> str:
        return "stdio"

    @property
    def secrets(self) -> tuple[str, ...]:
        return tuple(v for v in self.env.values() if v)


@dataclasses.dataclass(frozen=True, slots=True)
class McpHttpServer:
    name: str
    url: str = dataclasses.field(repr=False)  # may carry a token in its query
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False)
    timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    # True: all the server's tools require approval; else the names (the server's own).
    requires_approval: bool | frozenset[str] = False

    @property
    def transport(self) -> str:
        return "http"

    @property
    def secrets(self) -> tuple[str, ...]:
        parts = urllib.parse.urlsplit(self.url)
        found = [v for v in self.headers.values() if v]
        found += [p for p in (parts.password, parts.query) if p]
        return tuple(found)

    @property
    def display_url(self) -> str:
        """The URL without credentials or query: what status output may show."""
        parts = urllib.parse.urlsplit(self.url)
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


McpServerConfig = McpStdioServer | McpHttpServer


def load_mcp_config(path: str | os.PathLike[str]) -> list[McpServerConfig]:
    """Read and check the config file at ``path``; raises :class:`McpConfigError`."""
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise McpConfigError(f"MCP config {where}: cannot be read ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise McpConfigError(
            f"MCP config {where}: not valid JSON: {exc.msg} at line {exc.lineno}, "
            f"column {exc.colno}"
        ) from None
    return parse_mcp_config(data, where=where)


def parse_mcp_config(data: Any, *, where: str) -> list[McpServerConfig]:
    """Check a decoded config; ``where`` (the file) starts every error message."""
    if not isinstance(data, dict) or not isinstance(data.get("servers"), dict):
        raise McpConfigError(
            f'MCP config {where}: expected an object {{"servers": {{<name>: {{...}}}}}}'
        )
    unknown = sorted(set(data) - {"servers"})
    if unknown:
        raise McpConfigError(f"MCP config {where}: unknown top-level key {unknown[0]!r}")
    return [_server(where, name, entry) for name, entry in data["servers"].items()]


def _server(where: str, name: Any, entry: Any) -> McpServerConfig:
    if not isinstance(name, str) or not _SERVER_NAME.match(name):
        raise McpConfigError(
            f"MCP config {where}: server name {name!r} must be 1 to 40 letters, digits, '_' or '-'"
        )
    at = f"MCP config {where}: server {name!r}"
    if name in _RESERVED_NAMES:
        raise McpConfigError(f"{at}: the name is reserved for the worker's Python tools")
    if not isinstance(entry, dict):
        raise McpConfigError(f"{at}: must be an object")
    kind = entry.get("type")
    if "command" in entry and "url" in entry:
        raise McpConfigError(f'{at}: has both "command" and "url"; give one')
    if "command" in entry or kind in _STDIO_TYPES:
        if kind is not None and kind not in _STDIO_TYPES:
            raise McpConfigError(f'{at}: "type" {kind!r} does not fit a "command" entry')
        return _stdio(at, name, entry)
    if "url" in entry or kind in _HTTP_TYPES:
        if kind is not None and kind not in _HTTP_TYPES:
            raise McpConfigError(f'{at}: "type" {kind!r} does not fit a "url" entry')
        return _http(at, name, entry)
    raise McpConfigError(f'{at}: needs "command" (a stdio server) or "url" (streamable HTTP)')


def _check_keys(at: str, entry: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise McpConfigError(f"{at}: unknown key {unknown[0]!r}")


def _seconds(at: str, entry: dict[str, Any], key: str, default: float) -> float:
    value = entry.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= 3600
    ):
        raise McpConfigError(f'{at}: "{key}" must be a number of seconds above 0, at most 3600')
    return float(value)


def _approval(at: str, entry: dict[str, Any]) -> bool | frozenset[str]:
    """``requiresApproval``: ``true``/``false``, or a list of the server's tool names."""
    value = entry.get("requiresApproval", False)
    if isinstance(value, bool):
        return value
    if (
        isinstance(value, list)
        and all(isinstance(v, str) and v for v in value)
        and len(set(value)) == len(value)
    ):
        return frozenset(value)
    raise McpConfigError(
        f'{at}: "requiresApproval" must be true, false or a list of distinct tool names'
    )


def _strings(at: str, entry: dict[str, Any], key: str) -> dict[str, str]:
    """An object of strings (``env``, ``headers``); an error names the key, never a value."""
    value = entry.get(key, {})
    if not isinstance(value, dict):
        raise McpConfigError(f'{at}: "{key}" must be an object of strings')
    for k, v in value.items():
        if not isinstance(v, str):
            raise McpConfigError(f'{at}: "{key}" entry {k!r} must be a string')
    return dict(value)


def _stdio(at: str, name: str, entry: dict[str, Any]) -> McpStdioServer:
    _check_keys(at, entry, _STDIO_KEYS)
    command = entry.get("command")
    if not isinstance(command, str) or not command.strip():
        raise McpConfigError(f'{at}: "command" must be a non-empty string')
    args = entry.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise McpConfigError(f'{at}: "args" must be a list of strings')
    cwd = entry.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not Path(cwd).is_dir()):
        raise McpConfigError(f'{at}: "cwd" must name a directory')
    env = _strings(at, entry, "env")
    if _find_command(command, cwd, env.get("PATH")) is None:
        raise McpConfigError(f"{at}: command {command!r} not found (or not executable)")
    return McpStdioServer(
        name=name,
        command=command,
        args=tuple(args),
        env=env,
        cwd=cwd,
        timeout_s=_seconds(at, entry, "timeout_s", DEFAULT_CALL_TIMEOUT_S),
        connect_timeout_s=_seconds(at, entry, "connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S),
        requires_approval=_approval(at, entry),
    )


def _find_command(command: str, cwd: str | None, path: str | None) -> str | None:
    if os.sep in command:
        candidate = Path(cwd or ".") / command
        return str(candidate) if candidate.is_file() and os.access(candidate, os.X_OK) else None
    return shutil.which(command, path=path or os.environ.get("PATH"))


def _is_http_url(url: str) -> bool:
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError on a port out of range
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _http(at: str, name: str, entry: dict[str, Any]) -> McpHttpServer:
    _check_keys(at, entry, _HTTP_KEYS)
    url = entry.get("url")
    if not isinstance(url, str) or not _is_http_url(url):
        raise McpConfigError(f'{at}: "url" must be an http:// or https:// URL')
    return McpHttpServer(
        name=name,
        url=str(url),
        headers=_strings(at, entry, "headers"),
        timeout_s=_seconds(at, entry, "timeout_s", DEFAULT_CALL_TIMEOUT_S),
        connect_timeout_s=_seconds(at, entry, "connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S),
        requires_approval=_approval(at, entry),
    )

"""Config entries for the test MCP server (tests/mcp_server.py), and that server over
streamable HTTP as a process of its own that a test can kill and start again."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.waits import poll
from turnbus.procs import free_port

__all__ = ["REPO", "HttpMcpServer", "stdio_entry", "write_config"]

REPO = Path(__file__).resolve().parent.parent


def stdio_entry(*extra_args: str, env: dict[str, str] | None = None, **keys: Any) -> dict[str, Any]:
    """A config entry that runs the test server over stdio."""
    entry: dict[str, Any] = {
        "command": sys.executable,
        "args": ["-m", "tests.mcp_server", "--transport", "stdio", *extra_args],
        "cwd": str(REPO),
    }
    if env is not None:
        entry["env"] = env
    entry.update(keys)
    return entry


def write_config(directory: Path, servers: dict[str, Any]) -> Path:
    path = directory / "mcp.json"
    path.write_text(json.dumps({"servers": servers}))
    return path


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class HttpMcpServer:
    """The test server over streamable HTTP on a fixed loopback port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self._process: subprocess.Popen[bytes] | None = None

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.mcp_server",
                "--transport",
                "http",
                "--port",
                str(self.port),
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    async def start(self) -> None:
        """Start the server (again, on the same port) and wait until it listens."""
        self._process = process = self._spawn()
        await poll(
            lambda: _listening(self.port) or process.poll() is not None,
            within=20,
            what="the HTTP MCP server to listen",
        )
        if process.poll() is not None:
            raise RuntimeError(f"the HTTP MCP server exited with {process.returncode}")

    def kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=10)
            self._process = None

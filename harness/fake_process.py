"""What the fake model APIs share: a uvicorn server that says when it listens, and the
helper that runs a fake in a process of its own and talks to its ``/_fake/*`` routes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import uvicorn

__all__ = ["FakeApiProcess", "ReadyServer"]

_ROOT = Path(__file__).resolve().parent.parent


class ReadyServer(uvicorn.Server):
    """uvicorn, telling the starting thread when it listens (or gave up starting)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets=sockets)
        finally:
            self.ready.set()


class FakeApiProcess:
    """A fake API run as ``python -m <module>`` (it prints ``{"url": ...}`` once it
    listens); a context manager. ``configure``, ``reset`` and ``stats`` are blocking
    HTTP calls of a few milliseconds."""

    module = ""

    def __init__(self, **config: Any) -> None:
        self._config = config
        self._proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.pid = 0

    def __enter__(self) -> Self:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_ROOT), str(_ROOT / "services")])}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", self.module], cwd=_ROOT, env=env, stdout=subprocess.PIPE
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            self.__exit__(None, None, None)
            raise RuntimeError(f"the fake API of {self.module} did not start")
        self.url = json.loads(line)["url"]
        self.pid = self._proc.pid
        if self._config:
            self.configure(**self._config)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            return json.loads(resp.read())

    def configure(self, **config: Any) -> None:
        self._call("POST", "/_fake/config", config)

    def reset(self) -> None:
        self._call("POST", "/_fake/reset", {})

    def stats(self) -> dict[str, Any]:
        return dict(self._call("GET", "/_fake/stats"))

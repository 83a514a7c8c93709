"""``turnbus up`` as a subprocess on a free port with its own data dir, for the tests
that run the whole stack the way a user starts it (tests/cli, tests/e2e)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from harness.redis_server import redis_binary
from harness.waits import poll
from turnbus.stackfile import read_stack_file

UNSET_ENV = (
    "TURNBUS_REDIS_URL",
    "REDIS_URL",
    "TURNBUS_JWT_SECRET",
    "ANTHROPIC_API_KEY",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "TURNBUS_PROVIDERS",
    "TURNBUS_MODEL",
)


async def wait_for(check: Callable[[], Any], what: str, deadline_s: float = 30.0) -> Any:
    return await poll(check, within=deadline_s, what=what, interval=0.05)


def redis_major(binary: str) -> int:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"v=(\d+)\.", out)
    assert match is not None, out
    return int(match.group(1))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class UpProcess:
    def __init__(self, data_dir: Path, port: int, out: Path, **extra_env: str) -> None:
        self.data_dir, self.port, self.out = data_dir, port, out
        env = {k: v for k, v in os.environ.items() if k not in UNSET_ENV}
        env["TURNBUS_SHUTDOWN_GRACE_MS"] = "5000"
        # The pointer to the last stack started goes beside the data dir, not in ~.
        env["XDG_STATE_HOME"] = str(data_dir.parent / "state")
        env.update(extra_env)
        with out.open("wb") as sink:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "turnbus", "up",
                    "--port", str(port),
                    "--workers", "2",
                    "--data-dir", str(data_dir),
                    "--redis-server", redis_binary(),
                ],
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )  # fmt: skip

    def output(self) -> str:
        return self.out.read_text(encoding="utf-8", errors="replace")

    def diagnostics(self) -> str:
        parts = [f"--- up output ---\n{self.output()}"]
        for log in sorted((self.data_dir / "logs").glob("*.log")):
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            parts.append(f"--- {log.name} ---\n{tail}")
        return "\n".join(parts)

    async def ready(self) -> dict[str, Any]:
        def check() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"up exited with {self.proc.returncode}\n{self.diagnostics()}")
            return "\nready: " in self.output()

        await wait_for(check, "turnbus up to print ready", deadline_s=60)
        stack = read_stack_file(self.data_dir)
        assert stack is not None
        return stack

    async def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        await wait_for(lambda: self.proc.poll() is not None, "turnbus up to exit", deadline_s=45)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()


@contextlib.asynccontextmanager
async def running_up(
    data_dir: Path, port: int, out: Path, **extra_env: str
) -> AsyncIterator[UpProcess]:
    up = UpProcess(data_dir, port, out, **extra_env)
    try:
        yield up
    except BaseException:
        print(up.diagnostics())
        raise
    finally:
        up.kill()

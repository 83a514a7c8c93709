"""What a ``turnbus up`` leaves in its data dir for the other commands to find.

``<data-dir>/jwt-secret`` (mode 0600) is the stack's signing secret, kept across runs;
``<data-dir>/stack.json`` is written once the stack is ready (its URL, its children,
its private Redis) and removed when it stops.

A ready ``up`` also leaves a pointer to its data dir in the user's state folder
(``$XDG_STATE_HOME/turnbus/last-stack``, else ``~/.local/state/turnbus/last-stack``),
so :func:`find_data_dir` finds the running stack from any folder.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_DATA_DIR",
    "JWT_SECRET_FILE",
    "STACK_FILE",
    "NoStack",
    "find_data_dir",
    "forget_stack",
    "load_or_create_secret",
    "read_secret",
    "read_stack_file",
    "remember_stack",
    "remove_stack_file",
    "write_stack_file",
]

DEFAULT_DATA_DIR = ".turnbus"
JWT_SECRET_FILE = "jwt-secret"
STACK_FILE = "stack.json"


def read_secret(data_dir: Path) -> str | None:
    """The up stack's JWT secret from ``<data-dir>/jwt-secret``, if there is one."""
    try:
        secret = (data_dir / JWT_SECRET_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return secret or None


def load_or_create_secret(data_dir: Path) -> str:
    """Read ``<data-dir>/jwt-secret``, creating it (mode 0600) on first use."""
    path = data_dir / JWT_SECRET_FILE
    existing = read_secret(data_dir)
    if existing is not None:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        return existing
    secret = secrets.token_urlsafe(48)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secret + "\n")
    return secret


def read_stack_file(data_dir: Path) -> dict[str, Any] | None:
    """What a running ``up`` on ``data_dir`` wrote when it became ready (None if not running)."""
    try:
        data = json.loads((data_dir / STACK_FILE).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def write_stack_file(data_dir: Path, data: Mapping[str, Any]) -> None:
    """Replace ``stack.json`` atomically: a reader sees the old file or the new one."""
    path = data_dir / STACK_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def remove_stack_file(data_dir: Path) -> None:
    (data_dir / STACK_FILE).unlink(missing_ok=True)


class NoStack(LookupError):
    """No running ``turnbus up`` was found; the message says where it was looked for."""


def _pointer(env: Mapping[str, str]) -> Path:
    state = (env.get("XDG_STATE_HOME") or "").strip()
    base = Path(state) if state else Path(env.get("HOME") or Path.home()) / ".local" / "state"
    return base / "turnbus" / "last-stack"


def remember_stack(data_dir: Path, env: Mapping[str, str] | None = None) -> None:
    """Point the user's state folder at ``data_dir``, the stack that just became ready.
    Best effort: a state folder that cannot be written loses only the pointer."""
    path = _pointer(os.environ if env is None else env)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(str(data_dir.resolve()) + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass


def forget_stack(data_dir: Path, env: Mapping[str, str] | None = None) -> None:
    """Remove the pointer if it still names ``data_dir`` (a later stack's stays)."""
    path = _pointer(os.environ if env is None else env)
    try:
        if path.read_text(encoding="utf-8").strip() == str(data_dir.resolve()):
            path.unlink()
    except OSError:
        pass


def find_data_dir(data_dir: str | Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The data dir of a running ``turnbus up``: ``data_dir`` when given; else the first
    ``.turnbus`` holding a ``stack.json`` in the working directory or one of its parents;
    else the stack the user's state folder points at. :class:`NoStack` when none runs."""
    if data_dir is not None:
        path = Path(data_dir)
        if read_stack_file(path) is None:
            raise NoStack(f"no running `turnbus up` in {path} (no {path / STACK_FILE})")
        return path
    here = Path.cwd()
    for folder in (here, *here.parents):
        if read_stack_file(folder / DEFAULT_DATA_DIR) is not None:
            return folder / DEFAULT_DATA_DIR
    pointer = _pointer(os.environ if env is None else env)
    try:
        pointed = Path(pointer.read_text(encoding="utf-8").strip())
    except OSError:
        pointed = None
    if pointed is not None and read_stack_file(pointed) is not None:
        return pointed
    raise NoStack(
        f"no running `turnbus up` found: no {DEFAULT_DATA_DIR}/{STACK_FILE} in {here} or "
        f"its parents, and {pointer} names no running stack; start one (make run), "
        "or pass its --data-dir"
    )

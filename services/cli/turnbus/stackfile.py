"""What a ``turnbus up`` leaves in its data dir for the other commands to find.

``<data-dir>/jwt-secret`` (mode 0600) is the stack's signing secret, kept across runs;
``<data-dir>/stack.json`` is written once the stack is ready (its URL, its children,
its private Redis) and removed when it stops.
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
    "load_or_create_secret",
    "read_secret",
    "read_stack_file",
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

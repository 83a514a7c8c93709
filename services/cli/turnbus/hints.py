"""How the printed hints name the ``turnbus`` command and paths, so that what is
printed runs when pasted into the same shell."""

from __future__ import annotations

import contextlib
import shlex
import shutil
import sys
from pathlib import Path

__all__ = ["show_path", "turnbus_command"]


def show_path(path: Path) -> str:
    """``path`` relative to the working directory when it is under it, else absolute."""
    with contextlib.suppress(ValueError):
        return str(path.absolute().relative_to(Path.cwd()))
    return str(path)


def turnbus_command() -> str:
    """How the user runs this ``turnbus`` from here: bare when the PATH finds this one,
    else its path (``.venv/bin/turnbus`` after ``make run``), else ``python -m turnbus``."""
    script = Path(sys.executable).parent / "turnbus"
    if not script.exists():
        return f"{shlex.quote(sys.executable)} -m turnbus"
    found = shutil.which("turnbus")
    if found and Path(found).resolve() == script.resolve():
        return "turnbus"
    return shlex.quote(show_path(script))

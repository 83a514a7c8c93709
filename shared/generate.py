"""The files generated from :mod:`turnbus.shared.contracts` and the events' structs.

``python -m turnbus.shared.generate`` (``make generate``) writes them; a test fails when
one differs from what this module makes:

- ``shared/lua/contracts.lua``, included by the scripts (``-- include: contracts.lua``):
  the statuses, the end reasons, the fields of the events the scripts write and the
  session keys a lifetime expires (from :mod:`turnbus.shared.keys`);
- ``gateway/console/statuses.js``, read by the console: the statuses.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from importlib.resources.abc import Traversable

import msgspec

from turnbus.shared.contracts import (
    ACTIVE_STATUSES,
    END_REASONS,
    TERMINAL_STATUSES,
    TURN_STATUSES,
)
from turnbus.shared.events import EnvelopePatched, RoundStarted, TurnStarted
from turnbus.shared.keys import Keys

__all__ = ["LUA_EVENTS", "contracts_lua", "generated_files", "statuses_js"]

# The events a script writes itself (the others come from Python, encoded).
LUA_EVENTS: tuple[type[msgspec.Struct], ...] = (EnvelopePatched, TurnStarted, RoundStarted)

_HEADER = "Generated from turnbus.shared.contracts by `make generate`; do not edit."


def _lua_set(names: tuple[str, ...] | list[str]) -> str:
    return "{" + ", ".join(f"{name} = {json.dumps(name)}" for name in names) + "}"


def _lifetime_suffixes() -> list[str]:
    """What follows a session's key base in each of its fixed keys but the lease (which
    keeps its own, shorter expiry), as :class:`Keys` builds them."""
    k = Keys()
    base = k.session_tag("u", "s")
    lease = k.lease("u", "s")
    return [key.removeprefix(base) for key in k.session_keys("u", "s") if key != lease]


_LUA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LUA_KEYWORDS = frozenset(
    {
        "and", "break", "do", "else", "elseif", "end", "false", "for", "function", "if",
        "in", "local", "nil", "not", "or", "repeat", "return", "then", "true", "until",
        "while",
    }
)  # fmt: skip


def _event_writer(struct: type[msgspec.Struct]) -> list[str]:
    """The branch of ``event_json`` for one event: the fields' JSON texts (``v``) in one
    concatenation that puts each field present (its name's piece and its text, two
    strings already made) after the type, in the struct's order."""
    tag = json.dumps(struct.__struct_config__.tag)
    lines = [f"  if kind == {tag} then", f"    return '{{\"type\":{tag}'"]
    for name in struct.__struct_fields__:
        if not _LUA_NAME.fullmatch(name) or name in _LUA_KEYWORDS:
            raise ValueError(f"{name!r} is not a Lua field name")
        lines.append(f"      .. (v.{name} and ',{json.dumps(name)}:' or '') .. (v.{name} or '')")
    return [*lines, "      .. '}'", "  end"]


def contracts_lua() -> str:
    """The text of ``lua/contracts.lua``."""
    terminal = [s for s in TURN_STATUSES if s in TERMINAL_STATUSES]
    writers = [line for struct in LUA_EVENTS for line in _event_writer(struct)]
    return "\n".join(
        [
            f"-- {_HEADER}",
            "-- Included by the scripts that read or write a turn's status or an event",
            "-- (`-- include: contracts.lua`); not a script of its own.",
            "",
            "-- A turn's statuses (STATUS.queued is 'queued'), and those that end a turn: a",
            "-- turn in one of them never changes again.",
            f"local STATUS = {_lua_set(TURN_STATUSES)}",
            f"local TERMINAL_STATUSES = {{{', '.join(f'{s} = true' for s in terminal)}}}",
            "-- The reasons a turn ends with (the record's and the terminal event's).",
            f"local REASON = {_lua_set(END_REASONS)}",
            "-- The fixed keys of a session, after its base (`<prefix>:{<user>:<session>}`),",
            "-- that its lifetime sets to expire (turnbus.shared.keys; the lease keeps its own).",
            f"local SESSION_LIFETIME_SUFFIXES = {{{', '.join(json.dumps(x) for x in _lifetime_suffixes())}}}",
            "",
            "-- The JSON of an event of type `kind`, one of those a script writes: `v` holds",
            "-- each field's JSON text by name (a field without one is left out); the fields go",
            "-- in the struct's order, the type first, as every writer puts it (a reader may",
            "-- read it off without decoding the event). One concatenation of strings already",
            "-- made (a table grown piece by piece, or a string per field, costs several times",
            "-- more in Redis's Lua); one function, not a table of them (a script builds its",
            "-- definitions anew at every call).",
            "local function event_json(kind, v)",
            *writers,
            "  error('no writer for the event ' .. tostring(kind))",
            "end",
            "",
        ]
    )


def statuses_js() -> str:
    """The text of the console's ``statuses.js``."""
    terminal = [s for s in TURN_STATUSES if s in TERMINAL_STATUSES]
    status = ", ".join(f"{name}: {json.dumps(name)}" for name in TURN_STATUSES)
    reason = ", ".join(f"{name}: {json.dumps(name)}" for name in END_REASONS)
    return (
        f"// {_HEADER}\n"
        "// A turn's statuses, those of a turn not yet over and those that end one\n"
        "// (console.js reads them).\n"
        '"use strict";\n'
        f"const STATUS = Object.freeze({{{status}}});\n"
        f"const ACTIVE_STATUSES = Object.freeze({json.dumps(list(ACTIVE_STATUSES))});\n"
        f"const TERMINAL_STATUSES = Object.freeze({json.dumps(terminal)});\n"
        "// The reasons a turn ends with (the record's and the terminal event's).\n"
        f"const REASON = Object.freeze({{{reason}}});\n"
    )


def generated_files() -> dict[Traversable, str]:
    """Each generated file (in the installed package's tree) and the text it must hold."""
    return {
        resources.files("turnbus.shared").joinpath("lua", "contracts.lua"): contracts_lua(),
        resources.files("turnbus.gateway").joinpath("console", "statuses.js"): statuses_js(),
    }


if __name__ == "__main__":
    # `make generate` (from the source tree of an editable install).
    for target, text in generated_files().items():
        with resources.as_file(target) as path:
            path.write_text(text, encoding="utf-8")

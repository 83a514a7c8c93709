"""The generated files: each is what turnbus.shared.generate makes, and no script or
console script spells a status or a reason of its own."""

from __future__ import annotations

import re
from importlib import resources

import msgspec
import pytest
import redis.asyncio as aioredis

from turnbus.shared.contracts import END_REASONS, TURN_STATUSES
from turnbus.shared.events import (
    EnvelopePatched,
    NotesDigest,
    RoundStarted,
    TurnStarted,
    encode_event,
)
from turnbus.shared.generate import LUA_EVENTS, contracts_lua, generated_files
from turnbus.shared.scripts import _split, load_lua

pytestmark = pytest.mark.timeout(30)

_LUA = resources.files("turnbus.shared").joinpath("lua")
_CONSOLE = resources.files("turnbus.gateway").joinpath("console")
_WORDS = "|".join(sorted({*TURN_STATUSES, *END_REASONS}, key=len, reverse=True))
_LUA_LITERAL = re.compile(rf"""(['"])({_WORDS})\1""")
# A JS string naming a status or a reason, unless it is a CSS class (a tool's box).
_JS_LITERAL = re.compile(rf"""(?<!classList\.add\()(["'`])({_WORDS})\1""")


def test_every_generated_file_is_current() -> None:
    for target, text in generated_files().items():
        assert target.read_text(encoding="utf-8") == text, (
            f"{target.name} is stale: run `make generate`"
        )


def _lua_code(text: str) -> str:
    """A script's code without its comments (a ``--`` outside a string starts one)."""
    return "\n".join(re.sub(r"--(?!\[).*$", "", line) for line in text.splitlines())


def test_no_script_spells_a_status_or_a_reason() -> None:
    """Every status and reason in a script comes from the generated lua/contracts.lua."""
    scripts = [f for f in _LUA.iterdir() if f.name.endswith(".lua") and f.name != "contracts.lua"]
    assert len(scripts) > 10
    for script in scripts:
        stray = _LUA_LITERAL.findall(_lua_code(script.read_text(encoding="utf-8")))
        assert not stray, f"{script.name} spells {[w for _, w in stray]}: use STATUS/REASON"


def test_no_console_script_spells_a_status_or_a_reason() -> None:
    scripts = [f for f in _CONSOLE.iterdir() if f.name.endswith(".js")]
    for script in scripts:
        if script.name == "statuses.js":
            continue
        code = re.sub(r"//.*$", "", script.read_text(encoding="utf-8"), flags=re.MULTILINE)
        stray = _JS_LITERAL.findall(code)
        assert not stray, f"{script.name} spells {[w for _, w in stray]}: use STATUS/REASON"


def test_scripts_that_use_the_contracts_include_them_once() -> None:
    """A script keeps, of the contracts it includes, the definitions it uses (each
    once, as generated) and no other."""
    text = contracts_lua()
    starts = [m.start() for m in re.finditer(r"^local (?:function )?(\w+)", text, re.M)]
    definitions = {
        re.match(r"local (?:function )?(\w+)", text[a:]).group(1): text[a:b]  # type: ignore[union-attr]
        for a, b in zip(starts, [*starts[1:], len(text)], strict=True)
    }
    assert {"STATUS", "REASON", "TERMINAL_STATUSES", "event_json"} <= set(definitions)
    for script in _LUA.iterdir():
        name = script.name
        if not name.endswith(".lua") or name == "contracts.lua":
            continue
        body = load_lua(name)
        for defined, definition in definitions.items():
            used = re.search(rf"\b{defined}\b", _lua_code(body.replace(definition, "")))
            assert body.count(definition) == (1 if used else 0), (name, defined)


@pytest.mark.parametrize(
    "text",
    ["local a, b = 1, 2\n", "local a = {}\nredis.setresp(3)\n", "local a = 1\nb = 2\n"],
)
def test_an_included_file_with_more_than_one_name_a_definition_is_refused(text: str) -> None:
    """Only whole definitions are dropped from an include: a second name or a statement
    of its own would go with a definition the script does not use, so it is refused."""
    with pytest.raises(ValueError, match="only define one local"):
        _split(text, False)
    assert _split(text, True) == [("", text)]  # a script's own text is kept whole


async def _lua_event(redis: aioredis.Redis, kind: str, values: str) -> bytes:
    script = contracts_lua() + f"return event_json({kind!r}, {values})"
    reply = await redis.execute_command("EVAL", script, 0)
    return reply.encode() if isinstance(reply, str) else bytes(reply)


async def test_the_events_a_script_writes_are_their_structs_json(redis: aioredis.Redis) -> None:
    """event_json writes each event a script writes as msgspec encodes its struct: the
    same fields in the same order, the type first; a field without a value is left out."""
    assert {s.__struct_config__.tag for s in LUA_EVENTS} == {
        "envelope.patched",
        "turn.started",
        "round.started",
    }
    started = TurnStarted(
        turnId="t1", attempt=2, worker="w", at=5, after="redis_lost", redisLostMs=9
    )
    lua = await _lua_event(
        redis,
        "turn.started",
        """{turnId = '"t1"', attempt = '2', worker = '"w"', at = '5', after = '"redis_lost"',
            redisLostMs = '9'}""",
    )
    assert lua == encode_event(started)
    assert await _lua_event(
        redis, "round.started", """{turnId = '"t1"', round = '1', at = '5'}"""
    ) == encode_event(RoundStarted(turnId="t1", round=1, at=5))
    patched = await _lua_event(
        redis,
        "envelope.patched",
        """{origin = '"worker"', updatedAt = '7', sessionId = '"s1"', keys = '["workingNotes"]',
            set = '{}', unset = '[]', notes = '{"bytes":1,"sha256":"ab"}'}""",
    )
    assert patched == encode_event(
        EnvelopePatched(
            origin="worker",
            updatedAt=7,
            sessionId="s1",
            keys=["workingNotes"],
            notes=NotesDigest(bytes=1, sha256="ab"),
        )
    )
    assert msgspec.json.decode(patched)["type"] == "envelope.patched"

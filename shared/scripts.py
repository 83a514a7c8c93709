"""Lua scripts: loaded from ``shared/lua``, run by SHA, reloaded on NOSCRIPT.

Replies are read undecoded whatever the client's ``decode_responses``, so a value
that is not UTF-8 (poison written around the API) can never break a read.
"""

from __future__ import annotations

import functools
import hashlib
import re
import weakref
from collections.abc import Awaitable, Sequence
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

from turnbus.shared.redispy import UNDECODED

__all__ = ["LuaScript", "load_lua", "pairs", "text"]


@functools.cache
def load_lua(name: str) -> str:
    """A script's text, with each ``-- include: NAME.lua`` line replaced by that file's
    text, once per script (Redis runs one self-contained body; code the scripts share,
    such as the clock, is written once). An included file may include others. Of an
    included file only the top-level definitions (``local NAME``, ``local function
    NAME``) the script uses, itself or through another one it keeps, are kept: Redis runs
    a script's whole body at every call, and a table the script never reads (the
    contracts' REASON, say) would be built each time for nothing. Read once per process."""
    pieces = _pieces(name, set(), own=True)
    kept = {i for i, (defined, _) in enumerate(pieces) if not defined}
    while True:
        code = _COMMENT.sub("", "".join(pieces[i][1] for i in sorted(kept)))
        words = set(_WORD.findall(code))
        more = kept | {i for i, (defined, _) in enumerate(pieces) if defined in words}
        if more == kept:
            return "".join(pieces[i][1] for i in sorted(kept))
        kept = more


def _pieces(name: str, included: set[str], *, own: bool = False) -> list[tuple[str, str]]:
    """A script's text in pieces, in order: ``("", text)`` to keep whatever it holds (the
    script's own text, an included file's comments before its first definition), or
    ``(NAME, text)``, an included file's top-level definition of NAME (with any comment
    after it), kept when used."""
    included.add(name)
    body = _LUA.joinpath(name).read_text(encoding="utf-8")
    pieces: list[tuple[str, str]] = []
    at = 0
    for match in _INCLUDE.finditer(body):
        pieces += _split(body[at : match.start()], own)
        if match.group(1) not in included:
            pieces += _pieces(match.group(1), included)
        at = match.end()
    return pieces + _split(body[at:], own)


def _split(text: str, own: bool) -> list[tuple[str, str]]:
    if own:
        return [("", text)]
    # An included file holds only definitions, one name each: a statement of its own, or
    # a second name, would be dropped with a definition the script does not use.
    for line in text.splitlines():
        if _STRAY.match(line) or _MULTI.match(line):
            raise ValueError(f"an included Lua file may only define one local a line: {line!r}")
    starts = [m.start() for m in _DEFINITION.finditer(text)]
    pieces = [("", text[: starts[0] if starts else len(text)])]
    for start, end in zip(starts, [*starts[1:], len(text)], strict=False):  # none: no end
        defined = _DEFINITION.match(text, start)
        assert defined is not None
        pieces.append((defined.group(1), text[start:end]))
    return pieces


_LUA = resources.files("turnbus.shared").joinpath("lua")
_INCLUDE = re.compile(r"^-- include: ([a-z_]+\.lua)\n", re.MULTILINE)
_DEFINITION = re.compile(r"^local (?:function )?([A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)
# A top-level line of an included file that neither defines, closes nor comments.
_STRAY = re.compile(r"^(?!local |end\b|\}|\)|--|\s|$)")
_MULTI = re.compile(r"^local (?!function )[A-Za-z_][A-Za-z0-9_]*\s*,")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_COMMENT = re.compile(r"^\s*--.*$", re.MULTILINE)  # a comment line: its words use nothing
# Clients whose server cannot read a ``#!lua`` line (Redis 6.2): a script made later for
# one starts with its plain text (a lease's scripts are made anew for each attempt).
_UNMARKED: weakref.WeakSet[aioredis.Redis] = weakref.WeakSet()


def text(value: Any, errors: str = "surrogateescape") -> str:
    """A reply value as ``str`` (``None`` as ""). Bytes that are not UTF-8 keep their
    bytes as surrogates, so a value written around the API reads back, and counts, as
    the bytes it is; ``errors="replace"`` is for text that goes on to a client as UTF-8
    (U+FFFD in their place), which a kept surrogate could not be."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors)
    return "" if value is None else str(value)


def pairs(flat: Any) -> dict[str, str]:
    """A flat ``[field, value, ...]`` reply (HGETALL inside a script) as a dict."""
    return {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}


class LuaScript:
    """One script of ``shared/lua``, bound to a client.

    On Redis 7 the script is sent with a ``#!lua`` first line: a script so marked may
    touch the keys of one cluster slot only (Redis refuses any other access), where an
    unmarked one may touch any key its node holds. Redis 6.2 cannot read that line: on a
    server that refuses it the unmarked text is used. ``read_only`` scripts are marked
    ``no-writes`` (they still run when the server is out of memory)."""

    def __init__(self, redis: aioredis.Redis, name: str, *, read_only: bool = False) -> None:
        self.redis = redis
        self.name = name
        self.plain = load_lua(name)
        marked = ("#!lua flags=no-writes\n" if read_only else "#!lua\n") + self.plain
        self.body = self.plain if redis in _UNMARKED else marked
        self.sha = hashlib.sha1(self.body.encode()).hexdigest()

    async def __call__(
        self,
        keys: Sequence[str],
        args: Sequence[str | bytes | int],
        *,
        on: aioredis.Redis | None = None,
    ) -> Any:
        """Run the script (on the client ``on``, else the one it is bound to)."""
        client = on or self.redis
        try:
            return await self._run(client, keys, args)
        except NoScriptError:
            # A restarted or flushed server forgot the script: load it and run once more.
            await self._load(client)
            return await self._run(client, keys, args)

    async def load(self, client: aioredis.Redis | None = None) -> None:
        """Load the script (on every master of a cluster) before calls that run it by SHA
        alone, such as a pipeline's."""
        await self._load(client or self.redis)

    def _run(
        self, client: aioredis.Redis, keys: Sequence[str], args: Sequence[str | bytes | int]
    ) -> Awaitable[Any]:
        command = ("EVALSHA", self.sha, len(keys), *keys, *args)
        return client.execute_command(*command, **UNDECODED)  # type: ignore[no-untyped-call]

    async def _load(self, client: aioredis.Redis) -> None:
        body = self.body  # another call may switch it meanwhile
        try:
            await client.script_load(body)
        except ResponseError as exc:
            if body == self.plain or "compiling" not in str(exc):
                raise
            # Redis 6.2: no "#!" line; the slot check is 7's alone.
            _UNMARKED.add(self.redis)
            self.body = self.plain
            self.sha = hashlib.sha1(self.body.encode()).hexdigest()
            await client.script_load(self.body)

"""The worker's tools: the always-on notes tools and those of its tool sources.

:func:`build_tool_sources` makes the sources the settings name (the Python tools of
``TURNBUS_TOOLS`` and the entry points; the MCP servers of ``TURNBUS_MCP_CONFIG``).
:class:`ToolRegistry` starts them, merges their tools (a name taken twice, or a notes
tool's name, stops the start with both origins named) and answers what a round offers:
the three notes tools, then the session's allowed tools sorted by name, so the same
session always sends the same bytes and the prompt cache holds. With no
``allowedTools`` on the session every registered tool is allowed; an ``allowedTools``
that does not parse allows none beyond the notes tools.

The registered specs are published in Redis (``keys.tools()``, one field per worker)
so the gateway, which shares nothing else with the worker, can list them
(``GET /v1/tools``) and check a host's ``allowedTools`` against them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from turnbus.shared.keys import Keys
from turnbus.shared.meta import allowed_tools
from turnbus.shared.records import ClientTool
from turnbus.shared.settings import Settings
from turnbus.shared.tool_specs import PublishedTool, encode_published
from turnbus.worker.models.base import ToolSpec
from turnbus.worker.python_tools import PythonToolSource
from turnbus.worker.tools import NOTES_TOOL_NAMES, NOTES_TOOL_SPECS
from turnbus.worker.toolsource import RegisteredTool, ToolSource, ToolSourceError

__all__ = [
    "ToolRegistry",
    "ToolRegistryError",
    "build_tool_sources",
]

log = logging.getLogger(__name__)


class ToolRegistryError(ToolSourceError):
    """The sources' tools cannot be merged (a name taken twice)."""


def build_tool_sources(settings: Settings) -> list[ToolSource]:
    """The sources of the deployment's tools, as the settings name them (not started)."""
    sources: list[ToolSource] = [PythonToolSource(settings.tools)]
    if settings.mcp_config:
        from turnbus.worker.mcp_source import mcp_sources  # the SDK loads only when used

        sources.extend(mcp_sources(settings.mcp_config))
    return sources


class ToolRegistry:
    """The notes tools and the sources' tools, by name; shared by all turns of a worker."""

    def __init__(self, sources: Sequence[ToolSource] = ()) -> None:
        self.sources = list(sources)
        self._tools: dict[str, tuple[RegisteredTool, ToolSource]] = {}
        self._specs: dict[str, ToolSpec] = {}
        self._names: tuple[str, ...] = ()
        self._offers: dict[
            tuple[str | None, str | None], tuple[list[ToolSpec], frozenset[str]]
        ] = {}

    async def start(self) -> None:
        """Start every source (its error, naming what is wrong, stops the worker's start)."""
        for source in self.sources:
            try:
                await source.start()
            except ToolSourceError:
                raise
            except Exception as exc:
                raise ToolSourceError(
                    f"tool source {source.name!r} did not start: {type(exc).__name__}: {exc}"
                ) from exc
        self.refresh()

    def refresh(self) -> None:
        """Merge the sources' tools again (a source's list changed)."""
        tools: dict[str, tuple[RegisteredTool, ToolSource]] = {}
        for source in self.sources:
            for registered in source.tools():
                name = registered.name
                if name in NOTES_TOOL_NAMES:
                    raise ToolRegistryError(
                        f"tool {name!r} of source {source.name!r}: the name is a notes tool's"
                    )
                if name in tools:
                    raise ToolRegistryError(
                        f"two tools are named {name!r}: of source {tools[name][1].name!r} "
                        f"and of source {source.name!r}"
                    )
                tools[name] = (registered, source)
        self._tools = tools
        self._specs = {
            name: {
                "name": name,
                "description": registered.description,
                "input_schema": registered.input_schema,
            }
            for name, (registered, _) in sorted(tools.items())
        }
        self._names = tuple(sorted(tools))
        self._offers.clear()

    @property
    def names(self) -> tuple[str, ...]:
        """The registered tools' names, sorted (the notes tools not among them)."""
        return self._names

    def get(self, name: str) -> tuple[RegisteredTool, ToolSource] | None:
        return self._tools.get(name)

    def offer(
        self, allowed: str | None, claim: str | None = None
    ) -> tuple[list[ToolSpec], frozenset[str]]:
        """What a round of a session whose ``meta.allowedTools`` is ``allowed`` is
        offered, for a turn whose token's ``tools`` claim is ``claim``: the tool specs
        (notes tools first, then the tools both allow, by name) and the names it may
        call. Built once per distinct pair."""
        key = (allowed, claim)
        offer = self._offers.get(key)
        if offer is not None:
            return offer
        names: Sequence[str] = self._names
        for narrowing in (allowed, claim):
            if narrowing is not None:
                wanted = set(allowed_tools(narrowing) or ())
                names = [name for name in names if name in wanted]
        specs = [*NOTES_TOOL_SPECS, *(self._specs[name] for name in names)]
        offer = (specs, frozenset(NOTES_TOOL_NAMES | set(names)))
        if len(self._offers) >= 1024:
            self._offers.clear()
        self._offers[key] = offer
        return offer

    def offer_to_turn(
        self, allowed: str | None, claim: str | None, client: Sequence[ClientTool] | None
    ) -> tuple[list[ToolSpec], frozenset[str], frozenset[str]]:
        """:meth:`offer`, with the turn's client tools among the session's tools, by
        name (a client tool named like a registered one is left out: the registered one
        holds); the third item: the client tools' names."""
        specs, names = self.offer(allowed, claim)
        if not client:
            return specs, names, frozenset()
        kept = [t for t in client if t.name not in names and self.get(t.name) is None]
        if not kept:
            return specs, names, frozenset()
        notes = len(NOTES_TOOL_SPECS)
        merged = [
            *specs[notes:],
            *(
                ToolSpec(name=t.name, description=t.description, input_schema=t.inputSchema)
                for t in kept
            ),
        ]
        merged.sort(key=lambda spec: spec["name"])
        client_names = frozenset(t.name for t in kept)
        return [*specs[:notes], *merged], names | client_names, client_names

    def published(self) -> list[PublishedTool]:
        """The notes tools and the registered ones, as ``GET /v1/tools`` lists them."""
        notes = [
            PublishedTool(
                name=spec["name"],
                description=spec["description"],
                inputSchema=spec["input_schema"],
                source="notes",
            )
            for spec in NOTES_TOOL_SPECS
        ]
        return notes + [
            PublishedTool(
                name=t.name,
                description=t.description,
                inputSchema=t.input_schema,
                source=t.source,
                idempotent=t.idempotent,
                timeoutS=t.timeout_s,
                maxResultBytes=t.max_result_bytes,
                requiresApproval=t.requires_approval,
            )
            for t, _ in (self._tools[name] for name in self._names)
        ]

    def published_json(self) -> bytes:
        """:meth:`published` as the worker writes it under its name in ``keys.tools()``,
        with each heartbeat (its leave, or its being forgotten as dead, removes it)."""
        return encode_published(self.published())

    async def publish(self, redis: aioredis.Redis, keys: Keys, worker: str) -> None:
        """Write this worker's tools under its name in ``keys.tools()`` (one call)."""
        await redis.hset(keys.tools(), worker, self.published_json())

    def status(self) -> dict[str, Any]:
        """Each source's state, for ``/readyz`` and ``turnbus status`` (no secrets)."""
        return {source.name: source.status() for source in self.sources}

    async def aclose(self) -> None:
        for source in self.sources:
            try:
                await source.aclose()
            except Exception:
                log.warning("tool source %s did not close cleanly", source.name, exc_info=True)

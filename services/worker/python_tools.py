"""The deployment's Python tools as one :class:`~turnbus.worker.toolsource.ToolSource`.

The tools are the ``@tool`` functions (:mod:`turnbus.tools`) of the modules named in
``TURNBUS_TOOLS`` (comma-separated module names, or paths to ``.py`` files) and of the
``turnbus.tools`` entry points (each naming a module, a tool, or a list of tools). They
are loaded once, at the worker's start; a module that does not import, or two tools of
one name, stop the start with a message naming the module and the tool.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from turnbus.tools import ToolFunction, tool_of
from turnbus.worker.toolsource import (
    RegisteredTool,
    ToolCallResult,
    ToolContext,
    ToolSourceError,
)

__all__ = ["ENTRY_POINT_GROUP", "PythonToolSource", "ToolLoadError", "result_text"]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "turnbus.tools"

_json = msgspec.json.Encoder()


class ToolLoadError(ToolSourceError):
    """A tool module or entry point that cannot be loaded (the message names it)."""


def result_text(value: Any) -> ToolCallResult:
    """A tool's return value as the model reads it: a string as it is, ``None`` as "",
    a :class:`ToolCallResult` as given, anything else as JSON."""
    if isinstance(value, ToolCallResult):
        return value
    if value is None:
        return ToolCallResult("")
    if isinstance(value, str):
        return ToolCallResult(value)
    if isinstance(value, bytes):
        return ToolCallResult(value.decode("utf-8", "replace"))
    try:
        return ToolCallResult(_json.encode(value).decode())
    except TypeError:
        return ToolCallResult(str(value))


def _import(spec: str) -> types.ModuleType:
    """A module by its dotted name, or a ``.py`` file by its path (imported under the
    file's stem, so that a path like ``examples/tools.py`` works from the checkout)."""
    if spec.endswith(".py") or os.sep in spec:
        path = os.path.abspath(spec)
        name = "turnbus_tools_" + os.path.splitext(os.path.basename(path))[0]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None or loader_spec.loader is None or not os.path.exists(path):
            raise ToolLoadError(f"TURNBUS_TOOLS: no such file {spec!r}")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        loader_spec.loader.exec_module(module)
        return module
    return importlib.import_module(spec)


def _tools_in(obj: object) -> list[ToolFunction]:
    found = tool_of(obj)
    if found is not None:
        return [found]
    if isinstance(obj, types.ModuleType):
        names = getattr(obj, "__all__", None) or sorted(vars(obj))
        return [t for n in names if (t := tool_of(getattr(obj, n, None))) is not None]
    if isinstance(obj, list | tuple):
        return [t for item in obj if (t := tool_of(item)) is not None]
    return []


class PythonToolSource:
    """The ``@tool`` functions of the given modules and of the entry points."""

    name = "python"

    def __init__(self, modules: Sequence[str], *, entry_points: bool = True) -> None:
        self.modules = [m.strip() for m in modules if m.strip()]
        self.entry_points = entry_points
        self._functions: dict[str, ToolFunction] = {}
        self._tools: list[RegisteredTool] = []
        self._origins: dict[str, str] = {}

    async def start(self) -> None:
        found: list[tuple[str, ToolFunction]] = []
        for spec in self.modules:
            try:
                module = _import(spec)
            except ToolLoadError:
                raise
            except Exception as exc:
                raise ToolLoadError(
                    f"TURNBUS_TOOLS: module {spec!r} does not import: {type(exc).__name__}: {exc}"
                ) from exc
            tools = _tools_in(module)
            if not tools:
                log.warning("TURNBUS_TOOLS: module %r holds no @tool function", spec)
            found.extend((f"module {spec!r}", t) for t in tools)
        if self.entry_points:
            found.extend(self._from_entry_points())
        for origin, fn in found:
            if fn.name in self._functions:
                if self._functions[fn.name] is fn:
                    continue  # the same function reached twice (a module and its entry point)
                raise ToolLoadError(
                    f"two tools are named {fn.name!r}: in {self._origins[fn.name]} and in {origin}"
                )
            self._functions[fn.name] = fn
            self._origins[fn.name] = origin
        self._tools = [
            RegisteredTool(
                name=fn.name,
                description=fn.description,
                input_schema=fn.input_schema,
                source=self.name,
                idempotent=fn.idempotent,
                timeout_s=fn.timeout_s,
                max_result_bytes=fn.max_result_bytes,
                requires_approval=fn.requires_approval,
            )
            for fn in self._functions.values()
        ]
        if self._tools:
            log.info("python tools: %s", ", ".join(sorted(self._functions)))

    def _from_entry_points(self) -> Iterable[tuple[str, ToolFunction]]:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                obj = ep.load()
            except Exception as exc:
                raise ToolLoadError(
                    f"entry point {ep.name!r} ({ep.value}) of group {ENTRY_POINT_GROUP!r} "
                    f"does not load: {type(exc).__name__}: {exc}"
                ) from exc
            for fn in _tools_in(obj):
                yield f"entry point {ep.name!r}", fn

    def tools(self) -> list[RegisteredTool]:
        return list(self._tools)

    async def call(
        self, tool: RegisteredTool, arguments: dict[str, Any], context: ToolContext
    ) -> ToolCallResult:
        fn = self._functions.get(tool.name)
        if fn is None:
            return ToolCallResult(f"ERROR tool {tool.name!r} is not loaded", is_error=True)
        try:
            parsed = fn.parse(arguments)
        except msgspec.ValidationError as exc:
            return ToolCallResult(f"ERROR invalid input for {tool.name}: {exc}", is_error=True)
        return result_text(await fn.invoke(parsed, context))

    def status(self) -> dict[str, Any]:
        return {"tools": len(self._tools), "modules": list(self.modules)}

    async def aclose(self) -> None:
        return None

"""Tools for the agent, written as plain async functions::

    from turnbus.tools import ToolContext, tool

    @tool(idempotent=True, timeout_s=5)
    async def lookup(term: str, limit: int = 3) -> str:
        \"\"\"Look a term up in the team glossary.\"\"\"
        ...

    @tool
    async def file_ticket(title: str, body: str, ctx: ToolContext) -> str:
        \"\"\"Open a ticket (side-effecting: never rerun after a crash without saying so).\"\"\"
        ...

The input schema comes from the type hints (``msgspec.json.schema``), the description
from the docstring. A parameter annotated :class:`ToolContext` receives the turn's
identity (from the turn record, never from the model's input) and is left out of the
schema; its ``call_id`` is the call's idempotency key. A worker loads the modules named
in ``TURNBUS_TOOLS`` and the ``turnbus.tools`` entry points (docs/tools.md).

This module imports no Redis client: a tool module can be imported anywhere.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Awaitable, Callable
from typing import Any, overload

import msgspec

from turnbus.worker.toolsource import ToolCallResult, ToolContext

__all__ = [
    "DEFAULT_MAX_RESULT_BYTES",
    "DEFAULT_TIMEOUT_S",
    "ToolCallResult",
    "ToolContext",
    "ToolDefinitionError",
    "ToolFunction",
    "tool",
    "tool_of",
]

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_RESULT_BYTES = 16 * 1024

_ATTR = "__turnbus_tool__"


class ToolDefinitionError(TypeError):
    """A function that cannot be a tool (not async, a parameter the schema cannot hold)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ToolFunction:
    """What ``@tool`` learned from a function: its name, description, schema and rules."""

    name: str
    description: str
    input_schema: dict[str, Any]
    function: Callable[..., Awaitable[Any]]
    arguments: type[msgspec.Struct]  # the input's type, built from the signature
    context_param: str | None  # the parameter that receives the ToolContext
    idempotent: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    requires_approval: bool = False

    def parse(self, arguments: dict[str, Any]) -> msgspec.Struct:
        """The model's input as the function's arguments; raises
        ``msgspec.ValidationError`` naming the field when it does not fit."""
        return msgspec.convert(arguments, self.arguments)

    async def invoke(self, parsed: msgspec.Struct, context: ToolContext) -> Any:
        """Run the function on arguments from :meth:`parse` and the turn's context."""
        kwargs = {f: getattr(parsed, f) for f in self.arguments.__struct_fields__}
        if self.context_param is not None:
            kwargs[self.context_param] = context
        return await self.function(**kwargs)


def _schema_of(arguments: type[msgspec.Struct]) -> dict[str, Any]:
    """A self-contained JSON Schema object for the arguments' struct: its own schema at
    the top, any nested types under ``$defs``."""
    (ref,), components = msgspec.json.schema_components([arguments], ref_template="#/$defs/{name}")
    name = ref["$ref"].rsplit("/", 1)[-1]
    schema = dict(components.pop(name))
    schema.pop("title", None)
    schema.setdefault("properties", {})
    if components:
        schema["$defs"] = components
    return schema


_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _describe(fn: Callable[..., Any], name: str, rules: dict[str, Any]) -> ToolFunction:
    if not _NAME_RE.fullmatch(name):
        raise ToolDefinitionError(
            f"tool {name!r}: a name is 1 to 64 letters, digits, '_' or '-' (what models accept)"
        )
    if not inspect.iscoroutinefunction(fn):
        raise ToolDefinitionError(f"tool {name!r}: a tool must be an async function")
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:  # a hint naming a type the module cannot resolve
        raise ToolDefinitionError(f"tool {name!r}: its type hints do not resolve: {exc}") from exc
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    context_param: str | None = None
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolDefinitionError(f"tool {name!r}: *args and **kwargs cannot be described")
        hint = hints.get(param.name, Any)
        if hint is ToolContext:
            context_param = param.name
            continue
        if param.default is param.empty:
            fields.append((param.name, hint))
        else:
            fields.append((param.name, hint, param.default))
    struct_name = "".join(part.capitalize() for part in name.split("_")) + "Input"
    try:
        arguments = msgspec.defstruct(struct_name, fields, forbid_unknown_fields=True)
        schema = _schema_of(arguments)
    except (TypeError, ValueError) as exc:
        raise ToolDefinitionError(f"tool {name!r}: {exc}") from exc
    return ToolFunction(
        name=name,
        description=inspect.getdoc(fn) or "",
        input_schema=schema,
        function=fn,
        arguments=arguments,
        context_param=context_param,
        **rules,
    )


_F = typing.TypeVar("_F", bound=Callable[..., Awaitable[Any]])


@overload
def tool(fn: _F, /) -> _F: ...


@overload
def tool(
    *,
    name: str | None = None,
    idempotent: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    requires_approval: bool = False,
) -> Callable[[_F], _F]: ...


def tool(
    fn: _F | None = None,
    /,
    *,
    name: str | None = None,
    idempotent: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    requires_approval: bool = False,
) -> _F | Callable[[_F], _F]:
    """Mark an async function as a tool, bare (``@tool``) or with arguments.

    - ``idempotent``: running it again with the same ``ToolContext.call_id`` is safe, so
      after a lost worker it is rerun; the default is side-effecting (never rerun: the
      model is told the outcome is unknown);
    - ``timeout_s``, ``max_result_bytes``: this tool's bounds (a longer result is cut
      with a ``[truncated: …]`` marker);
    - ``requires_approval``: reserved for calls a person must approve first.

    The function is returned unchanged (it can still be called directly, in tests)."""
    if timeout_s <= 0:
        raise ToolDefinitionError("timeout_s must be positive")
    if max_result_bytes < 256:
        raise ToolDefinitionError("max_result_bytes must be at least 256")
    rules = {
        "idempotent": idempotent,
        "timeout_s": float(timeout_s),
        "max_result_bytes": max_result_bytes,
        "requires_approval": requires_approval,
    }

    def mark(f: _F) -> _F:
        setattr(f, _ATTR, _describe(f, name or f.__name__, rules))
        return f

    return mark if fn is None else mark(fn)


def tool_of(obj: object) -> ToolFunction | None:
    """The tool ``@tool`` made of ``obj``, or ``None`` when it is not one."""
    found = getattr(obj, _ATTR, None)
    return found if isinstance(found, ToolFunction) else None

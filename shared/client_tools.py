"""The caller's tools (a submit's ``clientTools``): their checks and their specs.

A client tool is offered to the model beside the session's tools; a call to it pauses
the turn (``requires_action``) until the caller answers it. The gateway checks the
declared tools once, at submit (:func:`check_client_tools`); the worker offers them
(``ToolRegistry.offer_to_turn``) and checks each call's input against its schema.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Sequence
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import msgspec

from turnbus.shared import caps
from turnbus.shared.records import ClientTool

__all__ = [
    "NOTES_TOOL_NAMES",
    "ClientToolsInvalid",
    "check_client_tools",
]

# The always-on tools' names (the worker's ``tools.NOTES_TOOL_SPECS`` define them):
# a client tool may not take one.
NOTES_TOOL_NAMES = frozenset({"working_notes_get", "working_notes_update", "working_notes_clear"})
# The Messages API's rule for a tool's name.
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_encoder = msgspec.json.Encoder()
# A caller sends the same tools with every turn: each distinct schema is checked once
# per process (its canonical bytes are the key; each at most CLIENT_TOOLS_MAX_BYTES).
_SCHEMA_VERDICTS = 256
_canonical = msgspec.json.Encoder(order="sorted")


class ClientToolsInvalid(ValueError):
    """A declared client tool is refused (HTTP 422 naming ``field``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_client_tools(tools: Sequence[ClientTool], taken: Collection[str]) -> None:
    """Refuse a list of client tools that is too long or too large, or a tool whose name
    is malformed, repeated or ``taken`` (a notes tool's, a registered tool's), whose
    description is too long, or whose ``inputSchema`` is not a JSON Schema of an object.
    Raises :class:`ClientToolsInvalid` naming the field."""
    if len(tools) > caps.CLIENT_TOOLS_MAX:
        raise ClientToolsInvalid(
            "clientTools", f"{len(tools)} client tools; the limit is {caps.CLIENT_TOOLS_MAX}"
        )
    size = len(_encoder.encode(tools))
    if size > caps.CLIENT_TOOLS_MAX_BYTES:
        raise ClientToolsInvalid(
            "clientTools",
            f"the client tools take {size} bytes; the limit is {caps.CLIENT_TOOLS_MAX_BYTES}",
        )
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"clientTools[{i}]"
        if not _NAME.match(tool.name):
            raise ClientToolsInvalid(
                f"{at}.name", f"{tool.name!r} is not a tool name (1 to 64 of a-z A-Z 0-9 _ -)"
            )
        if tool.name in seen:
            raise ClientToolsInvalid(f"{at}.name", f"{tool.name!r} is declared twice")
        if tool.name in NOTES_TOOL_NAMES or tool.name in taken:
            raise ClientToolsInvalid(
                f"{at}.name", f"{tool.name!r} is the name of a tool the session already has"
            )
        seen.add(tool.name)
        if len(tool.description.encode("utf-8", "surrogatepass")) > (
            caps.CLIENT_TOOL_DESCRIPTION_MAX_BYTES
        ):
            raise ClientToolsInvalid(
                f"{at}.description",
                f"the description is over {caps.CLIENT_TOOL_DESCRIPTION_MAX_BYTES} bytes",
            )
        _check_schema(f"{at}.inputSchema", tool.inputSchema)


def _check_schema(field: str, schema: dict[str, Any]) -> None:
    if schema.get("type") != "object":
        raise ClientToolsInvalid(field, 'must be a JSON Schema with "type": "object"')
    problem = _schema_problem(_canonical.encode(schema))
    if problem is not None:
        raise ClientToolsInvalid(field, f"is not a valid JSON Schema: {problem}")


@functools.lru_cache(maxsize=_SCHEMA_VERDICTS)
def _schema_problem(canonical: bytes) -> str | None:
    """What is wrong with the schema whose canonical JSON is ``canonical`` (``None``:
    nothing), remembered for the next submit declaring it."""
    schema = msgspec.json.decode(canonical)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        return str(exc.message)
    return None

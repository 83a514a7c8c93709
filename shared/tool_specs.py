"""The tools the workers registered, as they publish them in Redis for the gateway.

The gateway and the worker share only Redis: each worker writes the specs of its tools
under its name in ``keys.tools()`` (a hash) when it starts and removes them when it
leaves; the gateway reads them to list what a caller may use (``GET /v1/tools``) and
to check a host's ``meta.allowedTools``. Here too: the cut every tool result gets, on
either side (:func:`truncate_tool_result`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from turnbus.shared import caps
from turnbus.shared.keys import Keys

if TYPE_CHECKING:  # the client reads PublishedTool without pulling in redis-py
    import redis.asyncio as aioredis

__all__ = [
    "PublishedTool",
    "decode_published",
    "encode_published",
    "read_published_tools",
    "truncate_tool_result",
]

_TRUNCATED_MARKER = "\n[truncated: kept {kept} of {total} bytes]"


class PublishedTool(msgspec.Struct, kw_only=True):
    """A registered tool as the workers publish it and ``GET /v1/tools`` lists it:
    ``source`` is "notes", "python" or an MCP server's name; an ``idempotent`` tool is
    rerun after a lost worker, the others never without the model being told."""

    name: str
    description: str = ""
    inputSchema: dict[str, Any] = msgspec.field(default_factory=dict)
    source: str = ""
    idempotent: bool = False
    timeoutS: float = 30.0
    maxResultBytes: int = 16 * 1024
    requiresApproval: bool = False


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(list[PublishedTool])


def encode_published(tools: list[PublishedTool]) -> bytes:
    return _encoder.encode(tools)


def decode_published(data: bytes | str) -> list[PublishedTool]:
    """One worker's published list; ``[]`` when it does not decode (a newer writer)."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError:
        return []


async def read_published_tools(redis: aioredis.Redis, keys: Keys) -> dict[str, PublishedTool]:
    """Every tool some live worker published, by name (one call): the notes tools
    (``source`` "notes") first, then the others, each group sorted by name."""
    raw: dict[Any, Any] = await redis.hgetall(keys.tools())
    tools: dict[str, PublishedTool] = {}
    for value in raw.values():
        for tool in decode_published(value):
            tools.setdefault(tool.name, tool)
    return dict(sorted(tools.items(), key=lambda kv: (kv[1].source != "notes", kv[0])))


def truncate_tool_result(output: str, limit: int = caps.TOOL_RESULT_MAX_BYTES) -> tuple[str, bool]:
    """``(output, False)`` when within ``limit`` UTF-8 bytes, else a prefix cut on a
    character boundary plus ``[truncated: kept N of M bytes]``, the whole within ``limit``."""
    raw = output.encode("utf-8", "surrogatepass")
    total = len(raw)
    if total <= limit:
        return output, False
    room = limit - len(_TRUNCATED_MARKER.format(kept=total, total=total).encode())
    kept = raw[: max(room, 0)].decode("utf-8", "ignore")
    kept_bytes = len(kept.encode("utf-8", "surrogatepass"))
    return kept + _TRUNCATED_MARKER.format(kept=kept_bytes, total=total), True

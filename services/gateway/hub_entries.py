"""Stream entries as the SSE hub reads them (see services/gateway/hub.py).

Replies are read undecoded and entry data decoded leniently, so bytes that are not
UTF-8 in an entry cannot stop the hub.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from turnbus.shared.events import peek_type
from turnbus.shared.scripts import text

__all__ = ["StreamEntry", "entries_of"]


class StreamEntry(NamedTuple):
    id: str
    type: str
    data: str


def _to_entry(entry_id: Any, fields: Any) -> StreamEntry:
    # The "data" field: first, as every writer stores it (the worker's own writes add
    # their write number after it), else looked for in the flat [field, value, ...] list.
    flat: Any = fields or ()
    if len(flat) >= 2 and flat[0] == b"data":
        raw = flat[1]
    else:
        raw = next(
            (flat[i + 1] for i in range(0, len(flat) - 1, 2) if text(flat[i]) == "data"), None
        )
    # The data goes on to clients as UTF-8: bytes that are not UTF-8 become U+FFFD.
    data = text(raw, "replace")
    return StreamEntry(text(entry_id), peek_type(data, "unknown"), data)


def entries_of(raw: Any) -> list[StreamEntry]:
    """Entries of an XRANGE/XREVRANGE reply (or one stream of an XREAD reply)."""
    return [_to_entry(entry_id, fields) for entry_id, fields in raw or ()]

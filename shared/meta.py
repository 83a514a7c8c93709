"""The envelope's meta: which keys exist, who owns them, and how each is sanitized.

Every meta value is a string scalar. Host-owned keys are written by the host's full
replace (``PUT /v1/sessions/{id}/meta``); worker-owned keys (``WORKER_META_KEYS``)
are written by the worker overlay and only copied forward by a host replace.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Annotated

import msgspec

from turnbus.shared import caps
from turnbus.shared.records import TURN_STATUSES

__all__ = [
    "AUTO_TITLE_MAX_CHARS",
    "HOST_META_KEYS",
    "META_KEYS",
    "TURN_STATUSES",
    "WORKER_META_KEYS",
    "JsonText",
    "Meta",
    "MetaInvalid",
    "MetaTooLarge",
    "UpdatedAt",
    "allowed_tools",
    "approval_tools",
    "check_updated_at",
    "meta_bytes",
    "sanitize_meta",
    "sanitize_working_notes",
    "title_from_message",
    "trim_notes",
    "utf8_len",
    "validate_host_meta",
    "validate_worker_patch",
]


# The LWW clock a host sends: an integer a JSON client holds exactly (422 beyond).
UpdatedAt = Annotated[int, msgspec.Meta(ge=0, le=caps.UPDATED_AT_MAX)]

# attachedSkills: a JSON document carried in a string (422 when it does not parse);
# the schema says so with contentMediaType. Empty clears the key.
JsonText = Annotated[
    str,
    msgspec.Meta(
        extra_json_schema={
            "contentMediaType": "application/json",
            "description": "a JSON document encoded as a string (empty clears)",
        }
    ),
]


def check_updated_at(value: int) -> None:
    """Refuse a host clock outside ``0 .. caps.UPDATED_AT_MAX`` (:class:`MetaInvalid`)."""
    if not 0 <= value <= caps.UPDATED_AT_MAX:
        raise MetaInvalid(
            "updatedAt", f"must be an integer from 0 to {caps.UPDATED_AT_MAX} (2^53 - 1)"
        )


class Meta(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The reserved meta keys. ``None`` (absent) means unset."""

    # Host-owned.
    personaId: str | None = None
    personaSnapshot: str | None = None
    attachedSkills: JsonText | None = None
    allowedTools: JsonText | None = None
    selectedModel: str | None = None
    reasoningEffort: str | None = None
    title: str | None = None
    # Worker-owned.
    workingNotes: str | None = None
    turnRunId: str | None = None
    turnStatus: str | None = None
    turnCursor: str | None = None
    usage: str | None = None
    statusSlot: str | None = None


HOST_META_KEYS: tuple[str, ...] = (
    "personaId",
    "personaSnapshot",
    "attachedSkills",
    "allowedTools",
    "selectedModel",
    "reasoningEffort",
    "title",
)
WORKER_META_KEYS: tuple[str, ...] = (
    "workingNotes",
    "turnRunId",
    "turnStatus",
    "turnCursor",
    "usage",
    "statusSlot",
)
META_KEYS: tuple[str, ...] = HOST_META_KEYS + WORKER_META_KEYS
assert set(META_KEYS) == set(Meta.__struct_fields__)

REASONING_EFFORTS = ("low", "medium", "high")

# Per-key byte caps; keys not listed are bounded only by the whole-meta budget
# and this generic ceiling for short identifiers.
_SHORT_MAX_BYTES = 1024
_KEY_MAX_BYTES: dict[str, int] = {
    "personaSnapshot": caps.PERSONA_SNAPSHOT_MAX_BYTES,
    "attachedSkills": caps.PERSONA_SNAPSHOT_MAX_BYTES,
    "allowedTools": 64 * 1024,
    "workingNotes": caps.WORKING_NOTES_MAX_BYTES,
    "statusSlot": caps.STATUS_SLOT_MAX_BYTES,
    "usage": 4096,
    "title": 1024,
}


AUTO_TITLE_MAX_CHARS = 60


def title_from_message(message: str) -> str:
    """The title a session's first turn gives it when it has none: the message's first
    non-blank line, whitespace folded, cut at a word to at most 60 characters (with
    ``…`` when cut); a single word longer than that is cut at 59. ``""`` for a
    message with no text."""
    line = next((ln for ln in message.splitlines() if ln.strip()), "")
    words = " ".join(line.split())
    if len(words) <= AUTO_TITLE_MAX_CHARS:
        return words
    cut = words[: AUTO_TITLE_MAX_CHARS - 1]
    if words[AUTO_TITLE_MAX_CHARS - 1] != " " and " " in cut:
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,.;:-") + "…"


class MetaInvalid(ValueError):
    """A meta key or value that the schema refuses (HTTP 422)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


class MetaTooLarge(ValueError):
    """The whole meta would exceed ``HARNESS_SESSION_MAX_META_BYTES`` (HTTP 413)."""

    def __init__(self, size: int, limit: int = caps.HARNESS_SESSION_MAX_META_BYTES) -> None:
        super().__init__(f"session meta would be {size} bytes; the limit is {limit} bytes")
        self.size = size
        self.limit = limit


def utf8_len(value: str) -> int | None:
    """UTF-8 byte length, or ``None`` when the string cannot be encoded (lone surrogates)."""
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return None


def trim_notes(value: str) -> str:
    """``value`` without leading and trailing ``caps.NOTES_WHITESPACE`` (JavaScript's ``trim()``)."""
    return value.strip(caps.NOTES_WHITESPACE)


def sanitize_working_notes(value: object) -> str | None:
    """The original design's sanitizer: not a str → None; trim; empty → None; over 32 KiB → None."""
    if not isinstance(value, str):
        return None
    value = trim_notes(value)
    if not value:
        return None
    size = utf8_len(value)
    if size is None or size > caps.WORKING_NOTES_MAX_BYTES:
        return None
    return value


def _tool_entries(value: str | None) -> list[tuple[str, bool]] | None:
    """The entries of an ``allowedTools`` value as ``(name, requires approval)``; ``None``
    when absent or not a JSON array of names and ``{"name", "requiresApproval"}`` objects."""
    if not value:
        return None
    try:
        items = json.loads(value)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    entries: list[tuple[str, bool]] = []
    for item in items:
        if isinstance(item, str):
            entries.append((item, False))
        elif (
            isinstance(item, dict)
            and isinstance(item.get("name"), str)
            and isinstance(item.get("requiresApproval", False), bool)
            and set(item) <= {"name", "requiresApproval"}
        ):
            entries.append((item["name"], bool(item.get("requiresApproval", False))))
        else:
            return None
    return entries


def allowed_tools(value: str | None) -> tuple[str, ...] | None:
    """The tool names of an ``allowedTools`` value (a JSON array in a string, of names
    and of ``{"name", "requiresApproval"}`` objects), in their order, without repeats;
    ``None`` when the value is absent or not such an array (a worker then offers only
    the notes tools: an unreadable list allows nothing more)."""
    entries = _tool_entries(value)
    if entries is None:
        return None
    return tuple(dict.fromkeys(name for name, _ in entries))


def approval_tools(value: str | None) -> frozenset[str]:
    """The names an ``allowedTools`` value marks ``"requiresApproval": true``: their
    calls in the session wait for a person's approval."""
    return frozenset(name for name, approval in _tool_entries(value) or () if approval)


def _bounded(limit: int) -> Callable[[object], str | None]:
    def sanitize(value: object) -> str | None:
        if not isinstance(value, str) or value == "":
            return None
        size = utf8_len(value)
        if size is None or size > limit:
            return None
        return value

    return sanitize


_SANITIZERS: dict[str, Callable[[object], str | None]] = {
    key: _bounded(_KEY_MAX_BYTES.get(key, _SHORT_MAX_BYTES)) for key in META_KEYS
}
_SANITIZERS["workingNotes"] = sanitize_working_notes


def sanitize_meta(raw: Mapping[str, object]) -> Meta:
    """Build :class:`Meta` from raw stored fields: unknown fields ignored, poison dropped to unset."""
    values: dict[str, str] = {}
    for key in META_KEYS:
        if key in raw:
            clean = _SANITIZERS[key](raw[key])
            if clean is not None:
                values[key] = clean
    return Meta(**values)


def meta_bytes(values: Mapping[str, str]) -> int:
    """The budgeted size of a meta: the UTF-8 bytes of every key and value (an envelope
    read back keeps bytes that are not UTF-8 as surrogates, in a field's name too)."""
    return sum(
        len(k.encode("utf-8", "surrogateescape")) + len(v.encode("utf-8", "surrogateescape"))
        for k, v in values.items()
    )


def _check_value(key: str, value: str) -> None:
    size = utf8_len(value)
    if size is None:
        raise MetaInvalid(key, "is not valid UTF-8 text")
    limit = _KEY_MAX_BYTES.get(key, _SHORT_MAX_BYTES)
    if size > limit:
        raise MetaInvalid(key, f"is {size} bytes; the limit is {limit} bytes")
    if key == "attachedSkills" and value:
        try:
            json.loads(value)
        except ValueError:
            raise MetaInvalid(key, "must be a JSON document encoded as a string") from None
    if key == "allowedTools" and value and allowed_tools(value) is None:
        raise MetaInvalid(
            key,
            "must be a JSON array, encoded as a string, of tool names and of "
            '{"name": ..., "requiresApproval": true|false} objects',
        )
    if key == "reasoningEffort" and value and value not in REASONING_EFFORTS:
        raise MetaInvalid(key, f"must be one of {', '.join(REASONING_EFFORTS)}")
    if key == "turnStatus" and value and value not in TURN_STATUSES:
        raise MetaInvalid(key, f"must be one of {', '.join(TURN_STATUSES)}")


def validate_host_meta(meta: Meta) -> tuple[dict[str, str], dict[str, str]]:
    """Split a host replace into (host keys to set, worker keys present).

    Host keys absent or empty are cleared by the replace; worker keys absent are
    copied forward, so only present ones are returned (an empty string clears).
    """
    host: dict[str, str] = {}
    worker: dict[str, str] = {}
    for key in HOST_META_KEYS:
        value = getattr(meta, key)
        if value is not None and value != "":
            _check_value(key, value)
            host[key] = value
    for key in WORKER_META_KEYS:
        value = getattr(meta, key)
        if value is not None:
            if key == "workingNotes":
                value = trim_notes(value)
            _check_value(key, value)
            worker[key] = value
    return host, worker


def validate_worker_patch(patch: Mapping[str, str]) -> dict[str, str]:
    """Check a worker overlay: worker-owned keys only; an empty string clears."""
    clean: dict[str, str] = {}
    for key, value in patch.items():
        if key not in WORKER_META_KEYS:
            raise MetaInvalid(key, "is not a worker-owned key")
        if not isinstance(value, str):
            raise MetaInvalid(key, "must be a string")
        if key == "workingNotes":
            value = trim_notes(value)
        _check_value(key, value)
        clean[key] = value
    return clean

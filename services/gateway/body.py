"""Reading request bodies under a cap, and decoding them strictly."""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request

from turnbus.gateway.errors import bad_request, payload_too_large, unprocessable

__all__ = ["JSON_ESCAPE_FACTOR", "decode_json_body", "read_body"]

T = TypeVar("T")

# A JSON string can be up to 6x its content (every byte a \u00XX escape), so a
# route's body cap is its content cap times this plus room for the envelope.
JSON_ESCAPE_FACTOR = 6

_PATH_RE = re.compile(r"at `\$\.?([^`]*)`")
_NAMED_RE = re.compile(r"(?:unknown|missing required) field `([^`]*)`")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it is known to exceed ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise bad_request("Content-Length is not an integer") from None
        if size > limit:
            raise payload_too_large(f"the request body is {size} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise payload_too_large(f"the request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        # The client's fault, not the server's: no 500, no traceback in the log.
        raise bad_request("the client went away before sending the whole body") from None
    return b"".join(chunks)


def _field_of(message: str) -> str | None:
    """The dotted path a msgspec validation message names, when it names one."""
    at = _PATH_RE.search(message)
    path = at.group(1) if at is not None else ""
    named = _NAMED_RE.search(message)
    if named is not None:
        return f"{path}.{named.group(1)}" if path else named.group(1)
    return path or None


def decode_json_body(raw: bytes, decoder: msgspec.json.Decoder[T]) -> T:
    """Decode strictly: malformed JSON is 400, a schema mismatch 422 naming the field."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        message = str(exc)
        raise unprocessable(message, field=_field_of(message)) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None

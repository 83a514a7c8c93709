"""The one ``text/event-stream`` parser of the project (the client, ``turnbus chat`` and the
tests all use it).

It follows the WHATWG rules a browser's ``EventSource`` follows: lines end in CRLF, LF
or CR; a blank line dispatches the message; ``:`` starts a comment (the gateway's
keep-alive pings); one leading space after the field's colon is dropped; ``data``
lines join with ``\\n``; a message with no ``data`` is not dispatched; an ``id`` with
a NUL is ignored. Unlike ``EventSource`` the message's ``id`` is its own (None when
the event carried none), so a caller can tell control events, which the gateway
sends without an id, from stream entries.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = ["SseMessage", "SseParser", "aiter_sse", "iter_sse"]

_json = msgspec.json.Decoder()
_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True, slots=True)
class SseMessage:
    """One dispatched message: ``event`` defaults to ``"message"``, ``id`` to None."""

    data: str
    event: str = "message"
    id: str | None = None

    def json(self) -> Any:
        return _json.decode(self.data)


class SseParser:
    """Feed it lines, with or without their line ending (:meth:`feed_lines`,
    :meth:`feed_line`), or chunks of the stream cut anywhere (:meth:`feed`); it returns
    what they complete."""

    __slots__ = ("_data", "_decoder", "_event", "_id", "_partial", "_skip_lf")

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._partial = ""
        self._skip_lf = False
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, chunk: bytes | str) -> list[SseMessage]:
        """The messages a chunk of the stream completes. Chunks may cut a line, a line
        ending (CR, then LF in the next chunk) or, as bytes, a UTF-8 character anywhere."""
        text = self._decoder.decode(chunk) if isinstance(chunk, bytes) else chunk
        if not text:
            return []
        if self._skip_lf and text.startswith("\n"):
            text = text[1:]
        self._skip_lf = text.endswith("\r")
        lines = _LINE_END.split(self._partial + text)
        self._partial = lines.pop()
        return self._feed_all(lines)

    def feed_lines(self, item: str) -> list[SseMessage]:
        """The messages one item of a line iterator (e.g. ``httpx.Response.iter_lines()``)
        completes: a line with or without its ending, or several lines at once (CRLF, LF
        or CR each end a line)."""
        return self._feed_all(_split(item))

    def _feed_all(self, lines: list[str]) -> list[SseMessage]:
        messages = (self.feed_line(line) for line in lines)
        return [message for message in messages if message is not None]

    def feed_line(self, raw: str) -> SseMessage | None:
        line = raw.rstrip("\r\n")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, colon, value = line.partition(":")
        if colon:
            value = value.removeprefix(" ")
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id" and "\0" not in value:
            self._id = value
        return None

    def _dispatch(self) -> SseMessage | None:
        data, event, ident = self._data, self._event, self._id
        self._data, self._event, self._id = [], "", None
        if not data:
            return None
        return SseMessage(data="\n".join(data), event=event or "message", id=ident)


def _split(chunk: str) -> list[str]:
    for ending in ("\r\n", "\n", "\r"):
        if chunk.endswith(ending):
            chunk = chunk[: -len(ending)]
            break
    return chunk.replace("\r\n", "\n").replace("\r", "\n").split("\n")


def iter_sse(lines: Iterable[str]) -> Iterator[SseMessage]:
    """Messages from an iterable of lines, e.g. ``httpx.Response.iter_lines()``."""
    parser = SseParser()
    for item in lines:
        yield from parser.feed_lines(item)


async def aiter_sse(lines: AsyncIterable[str]) -> AsyncIterator[SseMessage]:
    """Messages from an async iterable of lines, e.g. ``httpx.Response.aiter_lines()``."""
    parser = SseParser()
    async for item in lines:
        for message in parser.feed_lines(item):
            yield message

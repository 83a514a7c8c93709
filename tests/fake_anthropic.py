"""A local fake of the Anthropic Messages API, for tests that run the real ``anthropic`` SDK.

A real HTTP server (Starlette on uvicorn, in a background thread with its own event
loop, on a free port of 127.0.0.1) that answers ``POST /v1/messages``. With
``"stream": true`` it streams real server-sent events in the API's order —
``message_start``, ``ping``, then per content block ``content_block_start``,
``content_block_delta`` (``text_delta`` / ``input_json_delta``), ``content_block_stop``,
then ``message_delta`` (stop_reason and usage) and ``message_stop``. Without it, it
answers the whole message as JSON.

Replies are scripted per test as a FIFO queue; each request takes the next one. A request
that finds the queue empty gets ``default_text`` as an ``end_turn`` reply when it is set
(``FakeAnthropic(default_text="ok")`` or the attribute), else a
``400 invalid_request_error`` saying so (never retried, so a missing script fails fast).
Every request body is recorded.

Use it from sync or async tests, or point a worker subprocess at it::

    with FakeAnthropic() as fake:
        fake.enqueue_tool_use("working_notes_update", {"notes": "- x"}, text="Saving.")
        fake.enqueue_text("Done.")
        fake.enqueue_error(529, retry_after=0)       # retry-after: 0 keeps retries instant
        client = fake.client()                       # AsyncAnthropic(base_url=fake.url, max_retries=0)
        # ... or env ANTHROPIC_BASE_URL=fake.url, ANTHROPIC_API_KEY=fake.api_key
        fake.requests[0]["system"]                   # the recorded request bodies (dicts)
        fake.headers[0]["authorization"]             # the recorded request headers
        fake.reset()                                 # empty the queue and the records

Starting the server costs ~0.2 s; a module- or session-scoped fixture that calls
``reset()`` per test avoids paying it per test.

Scripting:

- ``enqueue_text(text, stop_reason="end_turn", usage=None, chunk_size=8, delay_s=0)``
- ``enqueue_tool_use(name, input, text=None, tool_id=None, stop_reason="tool_use", ...)``
- ``enqueue_message(blocks, stop_reason=..., ...)``: any ``text`` / ``tool_use`` /
  ``thinking`` blocks, in order; a tool_use block's optional ``partial_json`` is streamed
  instead of its ``input`` (e.g. an input cut off by ``max_tokens``).
- ``enqueue_error(status, error_type=None, message=..., retry_after=None, headers=None)``:
  an HTTP error with the API's JSON error body.
- ``enqueue_stream_error(text, error_type="overloaded_error")``: streams ``text``, then
  an SSE ``error`` event, as the API does when it fails mid-stream.
- ``enqueue_truncated(text)``: streams ``text`` and ends the response without
  ``message_delta`` / ``message_stop`` (a dropped connection, as the client sees it).

``usage`` overrides the counts reported (``input_tokens``, ``output_tokens``,
``cache_read_input_tokens``, ``cache_creation_input_tokens``); by default input tokens
are the request's bytes / 4 and output tokens the reply's bytes / 4. ``delay_s`` sleeps
between streamed events (for tests that cancel mid-stream). ``gate`` (a
``threading.Event``) holds the stream after its first delta until the test sets it, so
a test can observe the client mid-stream without timing anything. ``finished_streams``
and ``aborted_streams`` count streamed responses sent to the end and ones the client
closed early.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import socket
import threading
import uuid
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import anthropic
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

__all__ = ["FakeAnthropic"]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


@dataclasses.dataclass
class _Message:
    blocks: list[dict[str, Any]]
    stop_reason: str | None
    usage: dict[str, int] | None
    chunk_size: int
    delay_s: float
    stream_error: str | None = None  # an SSE error event type, sent after the blocks
    truncated: bool = False
    gate: threading.Event | None = None  # held after the first delta until set


@dataclasses.dataclass
class _Error:
    status: int
    error_type: str
    message: str
    headers: dict[str, str]


class _Server(uvicorn.Server):
    """uvicorn, telling the starting thread when it listens (or gave up starting)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets=sockets)
        finally:
            self.ready.set()


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


class FakeAnthropic:
    """The fake Messages API server; a context manager. See the module docstring."""

    api_key = "sk-ant-test-fake"

    def __init__(self, *, model: str = "claude-fake", default_text: str | None = None) -> None:
        self._model = model
        self.default_text = default_text
        self._queue: collections.deque[_Message | _Error] = collections.deque()
        self._lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        # Streamed responses sent to the end, and ones the client closed before the end.
        self.finished_streams = 0
        self.aborted_streams = 0
        self._sock: socket.socket | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # -- scripting -------------------------------------------------------------

    def enqueue_message(
        self,
        blocks: list[dict[str, Any]],
        *,
        stop_reason: str | None = "end_turn",
        usage: dict[str, int] | None = None,
        chunk_size: int = 8,
        delay_s: float = 0.0,
        gate: threading.Event | None = None,
    ) -> None:
        self._push(_Message(blocks, stop_reason, usage, chunk_size, delay_s, gate=gate))

    def enqueue_text(
        self,
        text: str,
        *,
        stop_reason: str | None = "end_turn",
        usage: dict[str, int] | None = None,
        chunk_size: int = 8,
        delay_s: float = 0.0,
        gate: threading.Event | None = None,
    ) -> None:
        self.enqueue_message(
            [{"type": "text", "text": text}],
            stop_reason=stop_reason,
            usage=usage,
            chunk_size=chunk_size,
            delay_s=delay_s,
            gate=gate,
        )

    def enqueue_tool_use(
        self,
        name: str,
        tool_input: dict[str, Any],
        *,
        text: str | None = None,
        tool_id: str | None = None,
        stop_reason: str | None = "tool_use",
        usage: dict[str, int] | None = None,
        chunk_size: int = 8,
        delay_s: float = 0.0,
    ) -> str:
        """Queue a reply calling one tool; returns the tool_use id."""
        tool_id = tool_id or "toolu_fake_" + uuid.uuid4().hex[:16]
        blocks: list[dict[str, Any]] = []
        if text:
            blocks.append({"type": "text", "text": text})
        blocks.append({"type": "tool_use", "id": tool_id, "name": name, "input": tool_input})
        self.enqueue_message(
            blocks, stop_reason=stop_reason, usage=usage, chunk_size=chunk_size, delay_s=delay_s
        )
        return tool_id

    def enqueue_error(
        self,
        status: int,
        *,
        error_type: str | None = None,
        message: str = "scripted failure",
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        all_headers = dict(headers or {})
        if retry_after is not None:
            all_headers["retry-after"] = f"{retry_after:g}"
        kind = error_type or _ERROR_TYPES.get(status, "api_error")
        self._push(_Error(status, kind, message, all_headers))

    def enqueue_stream_error(
        self, text: str, *, error_type: str = "overloaded_error", chunk_size: int = 8
    ) -> None:
        self._push(
            _Message(
                [{"type": "text", "text": text}],
                None,
                None,
                chunk_size,
                0.0,
                stream_error=error_type,
            )
        )

    def enqueue_truncated(self, text: str, *, chunk_size: int = 8) -> None:
        self._push(
            _Message([{"type": "text", "text": text}], None, None, chunk_size, 0.0, truncated=True)
        )

    def reset(self) -> None:
        """Forget the queued replies, the default reply and the records (a shared server)."""
        self.default_text = None
        with self._lock:
            self._queue.clear()
            self.requests.clear()
            self.headers.clear()
            self.finished_streams = 0
            self.aborted_streams = 0

    @property
    def pending(self) -> int:
        """Replies queued and not yet taken."""
        with self._lock:
            return len(self._queue)

    def client(self, **options: Any) -> anthropic.AsyncAnthropic:
        """An SDK client aimed at this server, without SDK retries; the caller closes it."""
        options.setdefault("max_retries", 0)
        return anthropic.AsyncAnthropic(api_key=self.api_key, base_url=self.url, **options)

    def _push(self, reply: _Message | _Error) -> None:
        with self._lock:
            self._queue.append(reply)

    def _pop(self) -> _Message | _Error | None:
        with self._lock:
            return self._queue.popleft() if self._queue else None

    # -- the server ------------------------------------------------------------

    def __enter__(self) -> FakeAnthropic:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        app = Starlette(routes=[Route("/v1/messages", self._messages, methods=["POST"])])
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", loop="asyncio"
        )
        self._server = _Server(config)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self._sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="fake-anthropic", daemon=True
        )
        self._thread.start()
        if not self._server.ready.wait(10) or not self._server.started:
            self.stop()
            raise RuntimeError("the fake Anthropic server did not start")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._sock is not None:
            self._sock.close()
        self._server = self._thread = self._sock = None

    async def _messages(self, request: Request) -> Response:
        body = await request.json()
        with self._lock:
            self.requests.append(body)
            self.headers.append(dict(request.headers))
        reply = self._pop()
        if reply is None and self.default_text is not None:
            reply = _Message(
                [{"type": "text", "text": self.default_text}], "end_turn", None, 8, 0.0
            )
        if reply is None:
            reply = _Error(400, "invalid_request_error", "fake anthropic: no reply queued", {})
        if isinstance(reply, _Error):
            return JSONResponse(
                {"type": "error", "error": {"type": reply.error_type, "message": reply.message}},
                status_code=reply.status,
                headers={"request-id": "req_fake", **reply.headers},
            )
        usage = self._usage(body, reply)
        message_id = "msg_fake_" + uuid.uuid4().hex[:16]
        if not body.get("stream"):
            return JSONResponse(
                {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": body.get("model", self._model),
                    "content": reply.blocks,
                    "stop_reason": reply.stop_reason,
                    "stop_sequence": None,
                    "usage": usage,
                }
            )
        return StreamingResponse(
            self._events(body, reply, usage, message_id),
            media_type="text/event-stream",
            headers={"request-id": "req_fake", "cache-control": "no-cache"},
        )

    def _usage(self, body: dict[str, Any], reply: _Message) -> dict[str, int]:
        out_bytes = sum(
            len(b.get("text", "").encode()) + len(json.dumps(b.get("input", "")).encode())
            for b in reply.blocks
        )
        usage = {
            "input_tokens": max(len(json.dumps(body).encode()) // 4, 1),
            "output_tokens": max(out_bytes // 4, 1),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        usage.update(reply.usage or {})
        return usage

    async def _events(
        self, body: dict[str, Any], reply: _Message, usage: dict[str, int], message_id: str
    ) -> AsyncIterator[bytes]:
        finished = False
        try:
            async for chunk in self._event_chunks(body, reply, usage, message_id):
                yield chunk
            finished = True
        finally:
            with self._lock:
                if finished:
                    self.finished_streams += 1
                else:
                    self.aborted_streams += 1

    async def _event_chunks(
        self, body: dict[str, Any], reply: _Message, usage: dict[str, int], message_id: str
    ) -> AsyncIterator[bytes]:
        async def pause() -> None:
            if reply.delay_s > 0:
                await asyncio.sleep(reply.delay_s)

        start_usage = {**usage, "output_tokens": 1}
        yield _sse(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": body.get("model", self._model),
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": start_usage,
                },
            },
        )
        yield _sse("ping", {"type": "ping"})
        for index, block in enumerate(reply.blocks):
            await pause()
            kind = block["type"]
            if kind == "text":
                start: dict[str, Any] = {"type": "text", "text": ""}
                deltas = [
                    {"type": "text_delta", "text": piece}
                    for piece in _pieces(block["text"], reply.chunk_size)
                ]
            elif kind == "tool_use":
                start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                deltas = [
                    {"type": "input_json_delta", "partial_json": piece}
                    for piece in _pieces(
                        block.get("partial_json", json.dumps(block["input"])), reply.chunk_size
                    )
                ]
            elif kind == "thinking":
                start = {"type": "thinking", "thinking": "", "signature": ""}
                deltas = [
                    {"type": "thinking_delta", "thinking": piece}
                    for piece in _pieces(block["thinking"], reply.chunk_size)
                ] + [{"type": "signature_delta", "signature": block.get("signature", "sig")}]
            else:
                raise ValueError(f"the fake cannot stream a {kind!r} block")
            yield _sse(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": start},
            )
            for delta in deltas:
                await pause()
                yield _sse(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": delta},
                )
                if reply.gate is not None:
                    gate, reply.gate = reply.gate, None
                    await asyncio.to_thread(gate.wait, 30)
            if reply.stream_error is None and not reply.truncated:
                yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
        if reply.stream_error is not None:
            yield _sse(
                "error",
                {
                    "type": "error",
                    "error": {"type": reply.stream_error, "message": "scripted mid-stream failure"},
                },
            )
            return
        if reply.truncated:
            return
        await pause()
        yield _sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reply.stop_reason, "stop_sequence": None},
                "usage": usage,
            },
        )
        yield _sse("message_stop", {"type": "message_stop"})

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
``cache_read_input_tokens``, ``cache_creation_input_tokens``). By default output tokens
are the reply's bytes / 4 and the input is counted as the API counts it with its prompt
cache (:class:`PromptCache`): a token is 4 bytes of a block's JSON; the blocks go in the
order tools, system, messages; more than 4 ``cache_control`` breakpoints (the top-level
one counted) get a ``400 invalid_request_error``, as from the API; each breakpoint (the
top-level one marks the last block) caches the prefix that ends there, for 5 minutes, if it is at
least ``min_cache_tokens`` (1,024) long; a request reads the longest cached prefix that
ends at a breakpoint or at one of the 20 block boundaries before one
(``cache_read_input_tokens``), writes the rest up to its last breakpoint
(``cache_creation_input_tokens``), and ``input_tokens`` is what follows. ``delay_s`` sleeps
between streamed events (for tests that cancel mid-stream). ``gate`` (a
``threading.Event``) holds the stream after its first delta until the test sets it, so
a test can observe the client mid-stream without timing anything. ``finished_streams``
and ``aborted_streams`` count streamed responses sent to the end and ones the client
closed early.

Traffic like the API's at load, for the gate tests and the benchmarks (attributes, or
``configure(...)``):

- ``responder = "remember"`` answers from the request instead of a queue, as the
  scripted model does: a prompt ``remember X`` gets a ``working_notes_update`` round,
  then a text round; ``check your notes N times`` gets N ``working_notes_get`` rounds,
  then a text round; anything else one text round.
- ``ttft_s`` / ``tokens_per_s``: the pace of those replies (a word is a token; a text
  delta carries 3 words and goes when its last word is due; a tool's input follows its
  text at once, in pieces of a few tokens).
- ``limit_for_s`` (with ``limit_retry_after``): every request gets ``429`` for that long
  from now; ``overload_share``: that share of requests gets ``529``, at random (seeded).

``python -m harness.fake_anthropic`` runs it as a process of its own (uvloop); the
:class:`FakeAnthropicProcess` helper starts one, configures it and reads its ``stats()``
over HTTP (``POST /_fake/config``, ``GET /_fake/stats``, ``POST /_fake/reset``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import hashlib
import json
import random
import re
import signal
import socket
import threading
import time
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

from harness.fake_process import FakeApiProcess, ReadyServer

__all__ = ["FakeAnthropic", "FakeAnthropicProcess", "PromptCache"]

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
    pace: tuple[float, float] | None = None  # (ttft_s, tokens_per_s): paced by words


@dataclasses.dataclass
class _Error:
    status: int
    error_type: str
    message: str
    headers: dict[str, str]


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


class PromptCache:
    """Anthropic's prompt cache, as its docs describe it (see the module docstring)."""

    TTL_S = 300.0
    LOOKBACK_BLOCKS = 20

    def __init__(self, min_tokens: int = 1024) -> None:
        self.min_tokens = min_tokens
        self._seen: dict[bytes, float] = {}
        self._lock = threading.Lock()

    MAX_BREAKPOINTS = 4

    @staticmethod
    def breakpoints(body: dict[str, Any]) -> int:
        """The request's ``cache_control`` breakpoints, the top-level one included: the
        API refuses more than :attr:`MAX_BREAKPOINTS` with a 400."""
        blocks: list[Any] = list(body.get("tools") or [])
        system = body.get("system")
        if isinstance(system, list):
            blocks += system
        for message in body.get("messages") or []:
            content = message.get("content")
            if isinstance(content, list):
                blocks += content
        marked = sum(1 for b in blocks if isinstance(b, dict) and "cache_control" in b)
        return marked + (1 if body.get("cache_control") else 0)

    @staticmethod
    def _blocks(body: dict[str, Any]) -> list[tuple[bytes, bool]]:
        """The request's blocks in cache order, each as (its JSON, a breakpoint on it)."""
        out: list[tuple[bytes, bool]] = []

        def add(block: Any) -> None:
            marked = isinstance(block, dict) and "cache_control" in block
            if marked:
                block = {k: v for k, v in block.items() if k != "cache_control"}
            out.append((json.dumps(block, sort_keys=True).encode(), marked))

        for tool in body.get("tools") or []:
            add(tool)
        system = body.get("system")
        for block in [system] if isinstance(system, str) else system or []:
            add(block)
        for message in body.get("messages") or []:
            content = message.get("content")
            role = {"role": message.get("role")}
            if isinstance(content, str):
                add({**role, "text": content})
            else:
                for block in content or []:
                    add({**role, **block} if isinstance(block, dict) else block)
        if body.get("cache_control") and out:
            out[-1] = (out[-1][0], True)
        return out

    def usage(self, body: dict[str, Any], now: float | None = None) -> dict[str, int]:
        """``input_tokens``, ``cache_read_input_tokens``, ``cache_creation_input_tokens``."""
        now = time.monotonic() if now is None else now
        blocks = self._blocks(body)
        digests: list[bytes] = []
        ends = [0]  # tokens up to each block boundary
        running = hashlib.sha256()
        for raw, _ in blocks:
            running.update(len(raw).to_bytes(8, "big") + raw)
            digests.append(running.copy().digest())
            ends.append(ends[-1] + max(len(raw) // 4, 1))
        marks = [i for i, (_, marked) in enumerate(blocks) if marked]
        with self._lock:
            read_at = -1  # the last block of the longest prefix found in the cache
            for mark in marks:
                for i in range(mark, max(mark - self.LOOKBACK_BLOCKS, -1), -1):
                    seen = self._seen.get(digests[i])
                    if seen is not None and now - seen < self.TTL_S:
                        read_at = max(read_at, i)
                        break
            read = ends[read_at + 1]
            if read_at >= 0:
                self._seen[digests[read_at]] = now  # a hit refreshes its entry
            written_to = read_at
            for mark in marks:
                if ends[mark + 1] >= self.min_tokens and mark > read_at:
                    self._seen[digests[mark]] = now
                    written_to = max(written_to, mark)
        write = ends[written_to + 1] - read
        return {
            "input_tokens": max(ends[-1] - read - write, 0),
            "cache_read_input_tokens": read,
            "cache_creation_input_tokens": write,
        }


_REMEMBER = re.compile(r"\bremember\s+(\S.*)", re.IGNORECASE)
_CHECK = re.compile(r"\bcheck (?:your|my) notes (\d+) times\b", re.IGNORECASE)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(
        str(b.get("text", ""))
        for b in content or []
        if isinstance(b, dict) and b.get("type") == "text"
    )


def _respond(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The "remember" responder's reply blocks for a request (module docstring)."""
    from turnbus.worker.models.scripted import notes_in_system

    messages = body.get("messages") or []
    prompt_at = max(
        (
            i
            for i, m in enumerate(messages)
            if m.get("role") == "user" and _text_of(m.get("content")).strip()
        ),
        default=-1,
    )
    prompt = _text_of(messages[prompt_at]["content"]) if prompt_at >= 0 else ""
    since = messages[prompt_at + 1 :]
    step = 1 + sum(1 for m in since if m.get("role") == "assistant")
    results = [
        _text_of(b.get("content", ""))
        for m in since
        if m.get("role") == "user" and isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, dict) and b.get("type") == "tool_result"
    ]
    last_result = results[-1] if results else ""
    tool_id = f"toolu_fake_{uuid.uuid4().hex[:16]}"
    remember = _REMEMBER.search(prompt)
    if remember is not None:
        item = remember.group(1).strip()
        if step == 1:
            system = body.get("system") or ""
            text = system if isinstance(system, str) else "".join(b["text"] for b in system)
            notes = notes_in_system(text)
            updated = f"{notes}\n- {item}" if notes else f"- {item}"
            return [
                {"type": "text", "text": "Saving that to my working notes."},
                {
                    "type": "tool_use",
                    "id": tool_id,
                    "name": "working_notes_update",
                    "input": {"notes": updated},
                },
            ]
        return [{"type": "text", "text": f"Noted: {item}. The tool said: {last_result}"}]
    check = _CHECK.search(prompt)
    if check is not None and step <= int(check.group(1)):
        return [
            {"type": "text", "text": f"Checking my working notes, step {step}."},
            {"type": "tool_use", "id": tool_id, "name": "working_notes_get", "input": {}},
        ]
    return [{"type": "text", "text": f"A reply to your message of {len(prompt.split())} words."}]


def _words(text: str, per_delta: int = 3) -> list[str]:
    words = re.findall(r"\S+\s*", text)
    return ["".join(words[i : i + per_delta]) for i in range(0, len(words), per_delta)] or [""]


class _Script:
    """The fake's half the tests drive: the queued replies, the traffic knobs, what it
    was sent and its counts (:class:`FakeAnthropic` serves them)."""

    api_key = "sk-ant-test-fake"

    def __init__(self, *, default_text: str | None) -> None:
        self.default_text = default_text
        self.responder: str | None = None
        self.ttft_s = 0.0
        self.tokens_per_s = 0.0
        self.limit_until = 0.0  # time.monotonic(): every request gets 429 until then
        self.limit_retry_after = 1.0
        self.overload_share = 0.0
        self._rng = random.Random(0)
        self.cache = PromptCache()
        self.stats_since = time.monotonic()
        self.statuses: collections.Counter[int] = collections.Counter()
        self.request_times: list[float] = []  # since stats_since
        self.events_sent = 0
        self.usage_totals: collections.Counter[str] = collections.Counter()
        self._queue: collections.deque[_Message | _Error] = collections.deque()
        self._lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        # Streamed responses sent to the end, and ones the client closed before the end.
        self.finished_streams = 0
        self.aborted_streams = 0
        self.url = ""

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
        self.responder = None
        self.ttft_s = self.tokens_per_s = self.overload_share = 0.0
        self.limit_until = 0.0
        self.cache = PromptCache()
        with self._lock:
            self._queue.clear()
            self.requests.clear()
            self.headers.clear()
            self.finished_streams = 0
            self.aborted_streams = 0
            self._reset_stats()

    def _reset_stats(self) -> None:
        self.stats_since = time.monotonic()
        self.statuses.clear()
        self.request_times.clear()
        self.events_sent = 0
        self.usage_totals.clear()

    def configure(
        self,
        *,
        responder: str | None = None,
        default_text: str | None = None,
        ttft_s: float | None = None,
        tokens_per_s: float | None = None,
        limit_for_s: float | None = None,
        limit_retry_after: float | None = None,
        overload_share: float | None = None,
        min_cache_tokens: int | None = None,
        seed: int | None = None,
        reset_stats: bool = True,
    ) -> None:
        """Set the traffic knobs (module docstring); unnamed ones stay as they are."""
        if responder is not None:
            self.responder = responder or None
        if default_text is not None:
            self.default_text = default_text
        if ttft_s is not None:
            self.ttft_s = ttft_s
        if tokens_per_s is not None:
            self.tokens_per_s = tokens_per_s
        if limit_retry_after is not None:
            self.limit_retry_after = limit_retry_after
        if limit_for_s is not None:
            self.limit_until = time.monotonic() + limit_for_s
        if overload_share is not None:
            self.overload_share = overload_share
        if min_cache_tokens is not None:
            self.cache = PromptCache(min_cache_tokens)
        if seed is not None:
            self._rng = random.Random(seed)
        if reset_stats:
            with self._lock:
                self._reset_stats()

    def stats(self) -> dict[str, Any]:
        """Requests answered by status, their times (seconds since the stats began),
        streamed events sent, and the usage reported, summed."""
        with self._lock:
            return {
                "requests": sum(self.statuses.values()),
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "request_times": list(self.request_times),
                "events_sent": self.events_sent,
                "usage": dict(self.usage_totals),
                "finished_streams": self.finished_streams,
                "aborted_streams": self.aborted_streams,
                "cpu_s": time.process_time(),
            }

    @property
    def pending(self) -> int:
        """Replies queued and not yet taken."""
        with self._lock:
            return len(self._queue)

    def client(self, **options: Any) -> anthropic.AsyncAnthropic:
        """An SDK client aimed at this server, built as the worker builds its own
        (no SDK retries, the aiohttp transport); the caller closes it."""
        from turnbus.worker.models.anthropic import sdk_client

        return sdk_client(api_key=self.api_key, base_url=self.url, **options)

    def _push(self, reply: _Message | _Error) -> None:
        with self._lock:
            self._queue.append(reply)

    def _pop(self) -> _Message | _Error | None:
        with self._lock:
            return self._queue.popleft() if self._queue else None


class FakeAnthropic(_Script):
    """The fake Messages API server; a context manager. See the module docstring."""

    def __init__(
        self,
        *,
        model: str = "claude-fake",
        default_text: str | None = None,
        loop: str = "asyncio",
        port: int = 0,
    ) -> None:
        super().__init__(default_text=default_text)
        self._model = model
        self._loop = loop
        self._port = port
        self._sock: socket.socket | None = None
        self._server: ReadyServer | None = None
        self._thread: threading.Thread | None = None

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
        app = Starlette(
            routes=[
                Route("/v1/messages", self._messages, methods=["POST"]),
                Route("/_fake/config", self._control_config, methods=["POST"]),
                Route("/_fake/stats", self._control_stats, methods=["GET"]),
                Route("/_fake/reset", self._control_reset, methods=["POST"]),
                Route("/_fake/requests", self._control_requests, methods=["GET"]),
            ]
        )
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            loop=self._loop,
            backlog=4096,
            # As an API's front end keeps an idle connection (uvicorn's 5 s would race a
            # client reusing one between a benchmark's steps).
            timeout_keep_alive=75,
        )
        self._server = ReadyServer(config)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self._port))
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

    async def _control_config(self, request: Request) -> Response:
        self.configure(**(await request.json()))
        return JSONResponse({"ok": True})

    async def _control_stats(self, request: Request) -> Response:
        return JSONResponse(self.stats())

    async def _control_requests(self, request: Request) -> Response:
        with self._lock:
            return JSONResponse(list(self.requests))

    async def _control_reset(self, request: Request) -> Response:
        self.reset()
        return JSONResponse({"ok": True})

    def _answer(self, status: int) -> None:
        with self._lock:
            self.statuses[status] += 1
            self.request_times.append(round(time.monotonic() - self.stats_since, 4))

    async def _messages(self, request: Request) -> Response:
        body = await request.json()
        if self.responder is None:
            # A scripted queue: the tests read every request back. The traffic modes
            # serve thousands, and keep only counts.
            with self._lock:
                self.requests.append(body)
                self.headers.append(dict(request.headers))
        reply: _Message | _Error | None
        breakpoints = PromptCache.breakpoints(body)
        if breakpoints > PromptCache.MAX_BREAKPOINTS:
            reply = _Error(
                400,
                "invalid_request_error",
                f"A maximum of {PromptCache.MAX_BREAKPOINTS} blocks with cache_control may "
                f"be provided. Found {breakpoints}.",
                {},
            )
        elif time.monotonic() < self.limit_until:
            reply = _Error(
                429,
                "rate_limit_error",
                "fake anthropic: rate limited",
                {"retry-after": f"{self.limit_retry_after:g}"},
            )
        elif self.overload_share and self._rng.random() < self.overload_share:
            reply = _Error(529, "overloaded_error", "Overloaded", {"x-should-retry": "true"})
        elif self.responder == "remember":
            blocks = _respond(body)
            stop = "tool_use" if blocks[-1]["type"] == "tool_use" else "end_turn"
            pace = (self.ttft_s, self.tokens_per_s) if self.ttft_s or self.tokens_per_s else None
            reply = _Message(blocks, stop, None, 12, 0.0, pace=pace)
        else:
            reply = self._pop()
        if reply is None and self.default_text is not None:
            reply = _Message(
                [{"type": "text", "text": self.default_text}], "end_turn", None, 8, 0.0
            )
        if reply is None:
            reply = _Error(400, "invalid_request_error", "fake anthropic: no reply queued", {})
        self._answer(reply.status if isinstance(reply, _Error) else 200)
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
        usage = {**self.cache.usage(body), "output_tokens": max(out_bytes // 4, 1)}
        usage.update(reply.usage or {})
        with self._lock:
            self.usage_totals.update(usage)
        return usage

    async def _events(
        self, body: dict[str, Any], reply: _Message, usage: dict[str, int], message_id: str
    ) -> AsyncIterator[bytes]:
        finished = False
        sent = 0
        try:
            async for chunk in self._event_chunks(body, reply, usage, message_id):
                sent += 1
                yield chunk
            finished = True
        finally:
            with self._lock:
                self.events_sent += sent
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

        loop = asyncio.get_running_loop()
        started = loop.time()
        words_out = 0

        async def paced(text: str) -> None:
            """Wait until the last word of a paced text delta is due."""
            nonlocal words_out
            if reply.pace is None:
                return
            ttft_s, rate = reply.pace
            words_out += len(text.split())
            due = started + ttft_s + (max(words_out - 1, 0) / rate if rate > 0 else 0.0)
            if due > loop.time():
                await asyncio.sleep(due - loop.time())

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
                pieces = (
                    _words(block["text"])
                    if reply.pace is not None
                    else _pieces(block["text"], reply.chunk_size)
                )
                deltas = [{"type": "text_delta", "text": piece} for piece in pieces]
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
                if delta["type"] == "text_delta":
                    await paced(delta["text"])
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


class FakeAnthropicProcess(FakeApiProcess):
    """The fake in a process of its own (``python -m harness.fake_anthropic``), so its work
    is not the measured process's."""

    module = "harness.fake_anthropic"
    api_key = FakeAnthropic.api_key

    def requests(self) -> list[dict[str, Any]]:
        """The request bodies, in order (kept while no responder answers)."""
        return list(self._call("GET", "/_fake/requests"))


def main() -> None:
    parser = argparse.ArgumentParser(description="the fake Messages API, as a process")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    fake = FakeAnthropic(loop="uvloop", port=args.port)
    fake.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(json.dumps({"url": fake.url}), flush=True)
    stop.wait()
    fake.stop()


if __name__ == "__main__":
    main()

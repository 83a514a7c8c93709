"""A local fake of OpenAI's Chat Completions API, in a process of its own, for tests that
run the real ``openai`` SDK (through the worker's client) against it.

``python -m harness.fake_openai`` serves ``POST /v1/chat/completions`` (Starlette on
uvicorn, 127.0.0.1, a free port) and prints ``{"url": ...}``; :class:`FakeOpenAI`
starts one, scripts it and reads it back over HTTP (blocking calls of a few ms):

    with FakeOpenAI() as fake:
        fake.enqueue(text="Saving.", tool_calls=[{"name": "working_notes_get", "arguments": {}}])
        fake.enqueue(text="Done.")
        fake.enqueue_error(429, retry_after=0)
        env = {"OPENAI_API_KEY": fake.api_key, "OPENAI_BASE_URL": fake.base_url}
        fake.requests()            # the request bodies, in order (the request log)
        fake.stats()               # statuses, request times, usage, streams finished/aborted
        fake.reset()

A reply streams as the API streams: a first chunk with ``role``, then ``content``
deltas, then per tool call a first delta with ``index``, ``id``, ``type`` and the
function's ``name``, then its ``arguments`` in pieces; then a chunk with the
``finish_reason`` and, when the request asks (``stream_options.include_usage``), a last
chunk with empty ``choices`` and the ``usage``; then ``data: [DONE]``.

Scripting (:meth:`FakeOpenAI.enqueue`) for the stream quirks servers have:
``arg_chunk`` (the size of an argument piece: 1 for 1-character pieces), a call's own
``index`` (two calls at index 0 with different ids, as one popular server sends them),
``whole=True`` (the arguments sent once, as a JSON object when they are a dict),
``usage=False`` (no usage chunk although asked), ``truncate=True`` (the stream ends
before its ``finish_reason``), ``hold=True`` (the stream waits after
its first delta until :meth:`FakeOpenAI.release` or the client goes away).

Traffic (:meth:`FakeOpenAI.configure`): ``responder="remember"`` answers from the
request as the scripted model does (``remember X`` → ``working_notes_update``;
``what did we conclude?`` / ``recall`` → ``working_notes_get``; ``forget everything``
→ ``working_notes_clear``; ``check your notes N times`` → N rounds of
``working_notes_get``; then a text round that quotes the last tool result);
``ttft_s`` / ``tokens_per_s`` pace it like a real API; ``limit_for_s`` answers every
request ``429`` (``Retry-After: limit_retry_after``) for that long from now;
``error_share`` answers that share of requests ``500`` (seeded).

Usage is counted the way OpenAI documents its prompt cache: a token is 4 bytes of the
request's tools and messages (in that order); a prompt of at least ``min_cache_tokens``
(1,024) tokens reads the longest prefix seen before, in steps of 128 tokens, as
``prompt_tokens_details.cached_tokens``, and is cached itself. The count is 0 or at
least ``min_cache_tokens`` (1,024, 1,152, 1,280, …): a shorter shared prefix reads
nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
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
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from harness.fake_process import FakeApiProcess, ReadyServer

__all__ = ["FakeOpenAI", "PrefixCache"]

_ROOT = Path(__file__).resolve().parent.parent


class PrefixCache:
    """OpenAI's automatic prompt cache, as its docs describe it (module docstring)."""

    STEP_TOKENS = 128
    TOKEN_BYTES = 4

    def __init__(self, min_tokens: int = 1024) -> None:
        self.min_tokens = min_tokens
        self._seen: set[bytes] = set()

    @staticmethod
    def prompt_bytes(body: dict[str, Any]) -> bytes:
        parts = [json.dumps(t, sort_keys=True) for t in body.get("tools") or []]
        parts += [json.dumps(m, sort_keys=True) for m in body.get("messages") or []]
        return "".join(parts).encode()

    def usage(self, body: dict[str, Any]) -> tuple[int, int]:
        """``(prompt_tokens, cached_tokens)`` of a request; caches its prefixes."""
        raw = self.prompt_bytes(body)
        tokens = len(raw) // self.TOKEN_BYTES
        if tokens < self.min_tokens:
            return tokens, 0
        step = self.STEP_TOKENS * self.TOKEN_BYTES
        digests = [hashlib.sha256(raw[:end]).digest() for end in range(step, len(raw) + 1, step)]
        cached = 0
        for i, digest in enumerate(digests):
            if digest in self._seen:
                cached = (i + 1) * self.STEP_TOKENS
        self._seen.update(digests)
        return tokens, cached if cached >= self.min_tokens else 0


_REMEMBER = re.compile(r"\bremember\s+(\S.*)", re.IGNORECASE)
_CHECK = re.compile(r"\bcheck (?:your|my) notes (\d+) times\b", re.IGNORECASE)
_RECALL = re.compile(r"\b(what did we conclude|recall)\b", re.IGNORECASE)
_FORGET = re.compile(r"\bforget everything\b", re.IGNORECASE)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content or [] if isinstance(p, dict))


def respond(body: dict[str, Any]) -> dict[str, Any]:
    """The "remember" responder's reply to a request (module docstring)."""
    from turnbus.worker.models.scripted import notes_in_system

    messages = body.get("messages") or []
    prompt_at = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    prompt = _text(messages[prompt_at].get("content")) if prompt_at >= 0 else ""
    since = messages[prompt_at + 1 :]
    step = 1 + sum(1 for m in since if m.get("role") == "assistant")
    results = [_text(m.get("content")) for m in since if m.get("role") == "tool"]
    last = results[-1] if results else ""
    system = next((_text(m["content"]) for m in messages if m.get("role") == "system"), "")

    def call(name: str, arguments: dict[str, Any], text: str) -> dict[str, Any]:
        return {"text": text, "tool_calls": [{"name": name, "arguments": arguments}]}

    remember = _REMEMBER.search(prompt)
    if remember is not None:
        item = remember.group(1).strip()
        if step == 1:
            notes = notes_in_system(system)
            updated = f"{notes}\n- {item}" if notes else f"- {item}"
            return call("working_notes_update", {"notes": updated}, "Saving that.")
        return {"text": f"Noted: {item}. The tool said: {last}"}
    if _FORGET.search(prompt):
        if step == 1:
            return call("working_notes_clear", {}, "Clearing my notes.")
        return {"text": f"Forgotten. The tool said: {last}"}
    if _RECALL.search(prompt):
        if step == 1:
            return call("working_notes_get", {}, "Checking my notes.")
        return {"text": f"We concluded: {last}"}
    check = _CHECK.search(prompt)
    if check is not None and step <= int(check.group(1)):
        return call("working_notes_get", {}, f"Checking my working notes, step {step}.")
    return {"text": f"A reply to your message of {len(prompt.split())} words."}


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), max(size, 1))] or [""]


class _App:
    """The server's state and routes (runs in the fake's own process)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.queue: collections.deque[dict[str, Any]] = collections.deque()
        self.log: list[dict[str, Any]] = []
        self.responder: str | None = None
        self.ttft_s = 0.0
        self.tokens_per_s = 0.0
        self.limit_until = 0.0
        self.limit_retry_after = 1.0
        self.error_share = 0.0
        self.rng = random.Random(0)
        self.cache = PrefixCache()
        self.release_event: asyncio.Event | None = None
        self.reset_stats()

    def reset_stats(self) -> None:
        self.since = time.monotonic()
        self.statuses: collections.Counter[int] = collections.Counter()
        self.times: list[float] = []
        self.usage: collections.Counter[str] = collections.Counter()
        self.finished = 0
        self.aborted = 0
        self.chunks_sent = 0

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.completions, methods=["POST"]),
            Route("/_fake/enqueue", self.enqueue, methods=["POST"]),
            Route("/_fake/config", self.config, methods=["POST"]),
            Route("/_fake/reset", self.reset_route, methods=["POST"]),
            Route("/_fake/release", self.release, methods=["POST"]),
            Route("/_fake/requests", self.requests, methods=["GET"]),
            Route("/_fake/stats", self.stats, methods=["GET"]),
        ]

    async def enqueue(self, request: Request) -> Response:
        self.queue.append(await request.json())
        return JSONResponse({"ok": True})

    async def config(self, request: Request) -> Response:
        body = await request.json()
        for name in ("responder", "ttft_s", "tokens_per_s", "limit_retry_after", "error_share"):
            if name in body:
                setattr(self, name, body[name])
        if "limit_for_s" in body:
            self.limit_until = time.monotonic() + body["limit_for_s"]
        if "min_cache_tokens" in body:
            self.cache = PrefixCache(body["min_cache_tokens"])
        if "seed" in body:
            self.rng = random.Random(body["seed"])
        self.reset_stats()
        return JSONResponse({"ok": True})

    async def reset_route(self, request: Request) -> Response:
        self.reset()
        return JSONResponse({"ok": True})

    async def release(self, request: Request) -> Response:
        if self.release_event is None:
            self.release_event = asyncio.Event()
        self.release_event.set()
        return JSONResponse({"ok": True})

    async def requests(self, request: Request) -> Response:
        return JSONResponse(self.log)

    async def stats(self, request: Request) -> Response:
        return JSONResponse(
            {
                "requests": sum(self.statuses.values()),
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "request_times": self.times,
                "usage": dict(self.usage),
                "finished_streams": self.finished,
                "aborted_streams": self.aborted,
                "events_sent": self.chunks_sent,
                "cpu_s": time.process_time(),
            }
        )

    def _error(
        self, status: int, message: str, headers: dict[str, str], code: str | None
    ) -> Response:
        self.statuses[status] += 1
        kinds = {400: "invalid_request_error", 401: "invalid_api_key", 429: "rate_limit_exceeded"}
        body = {
            "error": {
                "message": message,
                "type": kinds.get(status, "server_error"),
                "param": None,
                "code": code or kinds.get(status, "server_error"),
            }
        }
        return JSONResponse(body, status_code=status, headers=headers)

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        if self.responder is None:
            self.log.append(
                {"body": body, "authorization": request.headers.get("authorization", "")}
            )
        self.times.append(round(time.monotonic() - self.since, 4))
        if time.monotonic() < self.limit_until:
            headers = {"retry-after": f"{self.limit_retry_after:g}"}
            return self._error(429, "fake openai: rate limited", headers, None)
        if self.error_share and self.rng.random() < self.error_share:
            return self._error(500, "fake openai: server error", {}, None)
        if self.responder == "remember":
            reply: dict[str, Any] | None = respond(body)
        else:
            reply = self.queue.popleft() if self.queue else None
        if reply is None:
            return self._error(400, "fake openai: no reply queued", {}, None)
        if "status" in reply:
            headers = dict(reply.get("headers") or {})
            if reply.get("retry_after") is not None:
                headers["retry-after"] = f"{reply['retry_after']:g}"
            return self._error(
                reply["status"],
                reply.get("message", "scripted failure"),
                headers,
                reply.get("code"),
            )
        self.statuses[200] += 1
        return StreamingResponse(
            self._counted(body, reply),
            media_type="text/event-stream",
            headers={"x-request-id": "req_fake"},
        )

    async def _counted(self, body: dict[str, Any], reply: dict[str, Any]) -> AsyncIterator[bytes]:
        finished = False
        try:
            async for chunk in self._chunks(body, reply):
                self.chunks_sent += 1
                yield chunk
            finished = True
        finally:
            if finished:
                self.finished += 1
            else:
                self.aborted += 1

    async def _chunks(self, body: dict[str, Any], reply: dict[str, Any]) -> AsyncIterator[bytes]:
        completion_id = "chatcmpl-fake" + uuid.uuid4().hex[:12]
        model = body.get("model", "gpt-fake")
        base = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        loop = asyncio.get_running_loop()
        started = loop.time()
        words = 0
        pace = self.responder is not None and (self.ttft_s or self.tokens_per_s)
        delay_s = float(reply.get("delay_s", 0.0))
        held = bool(reply.get("hold"))

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return _sse({**base, "choices": [choice]})

        async def due(text: str) -> None:
            nonlocal words
            if delay_s:
                await asyncio.sleep(delay_s)
            if pace:
                words += len(text.split())
                rate = self.tokens_per_s
                at = started + self.ttft_s + (max(words - 1, 0) / rate if rate > 0 else 0.0)
                if at > loop.time():
                    await asyncio.sleep(at - loop.time())

        yield chunk({"role": "assistant", "content": ""})
        text = reply.get("text") or ""
        pieces = (
            re.findall(r"\S+\s*", text) if pace else _pieces(text, int(reply.get("chunk_size", 8)))
        )
        if pace:
            pieces = ["".join(pieces[i : i + 3]) for i in range(0, len(pieces), 3)]
        for piece in pieces if text else []:
            await due(piece)
            yield chunk({"content": piece})
            if held:
                held = False
                if self.release_event is None:
                    self.release_event = asyncio.Event()
                await asyncio.wait_for(self.release_event.wait(), 30)
                self.release_event = None
        out_bytes = len(text.encode())
        for n, call in enumerate(reply.get("tool_calls") or []):
            index = call.get("index", n)
            call_id = call.get("id") or "call_" + uuid.uuid4().hex[:20]
            arguments = call.get("arguments", {})
            head = {
                "index": index,
                "id": call_id,
                "type": "function",
                "function": {"name": call["name"], "arguments": ""},
            }
            yield chunk({"tool_calls": [head]})
            if call.get("whole"):
                pieces_of: list[Any] = [arguments]
            else:
                raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
                out_bytes += len(raw)
                pieces_of = _pieces(raw, int(reply.get("arg_chunk", 8))) if raw else []
            for piece in pieces_of:
                yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        if reply.get("truncate"):
            return  # cut before the finish_reason, as a dropped connection looks
        finish = reply.get("finish_reason") or ("tool_calls" if reply.get("tool_calls") else "stop")
        yield chunk({}, finish)
        include = (body.get("stream_options") or {}).get("include_usage")
        if include and reply.get("usage", True) is not False:
            prompt, cached = self.cache.usage(body)
            usage: dict[str, Any] = {
                "prompt_tokens": prompt,
                "completion_tokens": max(out_bytes // 4, 1),
                "total_tokens": prompt + max(out_bytes // 4, 1),
                "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0},
            }
            if isinstance(reply.get("usage"), dict):
                usage.update(reply["usage"])
            self.usage.update(
                {k: v for k, v in usage.items() if isinstance(v, int)}
                | {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}
            )
            yield _sse({**base, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description="the fake Chat Completions API, as a process")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    app = _App()
    config = uvicorn.Config(
        Starlette(routes=app.routes()),
        log_level="warning",
        access_log=False,
        lifespan="off",
        loop="uvloop",
        backlog=4096,
        timeout_keep_alive=75,
    )
    server = ReadyServer(config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    if not server.ready.wait(10) or not server.started:
        raise SystemExit("the fake OpenAI server did not start")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(json.dumps({"url": f"http://127.0.0.1:{sock.getsockname()[1]}"}), flush=True)
    stop.wait()
    server.should_exit = server.force_exit = True
    thread.join(10)


class FakeOpenAI(FakeApiProcess):
    """The fake in its own process; a context manager. See the module docstring."""

    module = "harness.fake_openai"
    api_key = "sk-openai-test-fake"

    @property
    def base_url(self) -> str:
        """What ``OPENAI_BASE_URL`` takes: the API's root, ``/v1`` included."""
        return self.url + "/v1"

    def enqueue(
        self,
        text: str | None = None,
        *,
        tool_calls: list[dict[str, Any]] | None = None,
        **options: Any,
    ) -> None:
        """Queue one streamed reply (module docstring for ``options``)."""
        self._call("POST", "/_fake/enqueue", {"text": text, "tool_calls": tool_calls, **options})

    def enqueue_error(
        self,
        status: int,
        *,
        message: str = "scripted failure",
        retry_after: float | None = None,
        code: str | None = None,
    ) -> None:
        reply = {"status": status, "message": message, "retry_after": retry_after, "code": code}
        self._call("POST", "/_fake/enqueue", reply)

    def release(self) -> None:
        """Let a held stream go on."""
        self._call("POST", "/_fake/release", {})

    def requests(self) -> list[dict[str, Any]]:
        """The request bodies, in order (not kept while a responder answers)."""
        return [entry["body"] for entry in self._call("GET", "/_fake/requests")]

    def authorizations(self) -> list[str]:
        return [entry["authorization"] for entry in self._call("GET", "/_fake/requests")]


if __name__ == "__main__":
    main()

"""CPU per streamed Chat Completions chunk: the ``openai`` SDK's stream parser against the
worker's lean reader (msgspec), on the same bytes, in one process.

The SDK's way is what ``AsyncStream[ChatCompletionChunk]`` does per event: its SSE
decoder, ``json.loads`` of the data and a ``ChatCompletionChunk`` built by
``construct_type``. The lean way is the worker's: ``SseSplitter``, one msgspec decode
into the client's structs and the round's assembler. A typical stream: text deltas of
a few words, then two tool calls in pieces, the finish chunk and the usage chunk.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_openai_parse.py`; figures go to
benchmarks/results/bench_openai_parse.json.
"""

from __future__ import annotations

import asyncio
import json
import platform
import time
from pathlib import Path
from typing import Any

from openai._models import construct_type
from openai._streaming import SSEDecoder
from openai.types.chat import ChatCompletionChunk

from turnbus.worker.models.openai import ChatRoundAssembler
from turnbus.worker.models.transport import SseSplitter

RESULTS = Path(__file__).resolve().parent / "results" / "bench_openai_parse.json"


def _stream() -> tuple[list[bytes], int]:
    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return b"data: " + json.dumps({**base, "choices": [choice]}).encode() + b"\n\n"

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": "three words here "}) for _ in range(60)]
    for index in (0, 1):
        head = {"index": index, "id": f"call_{index}", "type": "function"}
        events.append(chunk({"tool_calls": [{**head, "function": {"name": "f", "arguments": ""}}]}))
        for piece in ('{"notes', '": "- a', " note", '"}'):
            events.append(
                chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
            )
    events.append(chunk({}, "tool_calls"))
    usage = {
        "prompt_tokens": 900,
        "completion_tokens": 80,
        "prompt_tokens_details": {"cached_tokens": 512},
    }
    events.append(
        b"data: " + json.dumps({**base, "choices": [], "usage": usage}).encode() + b"\n\n"
    )
    events.append(b"data: [DONE]\n\n")
    # As a socket hands them over: a few events per read.
    reads = [b"".join(events[i : i + 3]) for i in range(0, len(events), 3)]
    return reads, len(events)


async def _sdk(reads: list[bytes]) -> None:
    async def body():  # type: ignore[no-untyped-def]
        for read in reads:
            yield read

    async for sse in SSEDecoder().aiter_bytes(body()):
        if sse.data.startswith("[DONE]"):
            continue  # the body's end follows
        construct_type(type_=ChatCompletionChunk, value=sse.json())


def _lean(reads: list[bytes]) -> None:
    splitter = SseSplitter()
    assembler = ChatRoundAssembler()
    for read in reads:
        for data in splitter.feed(read):
            assembler.feed_data(data)
    assembler.result()


def main() -> None:
    reads, events = _stream()
    streams = 400
    for _ in range(20):  # warm up
        asyncio.run(_sdk(reads))
        _lean(reads)
    start = time.process_time()
    loop = asyncio.new_event_loop()
    for _ in range(streams):
        loop.run_until_complete(_sdk(reads))
    loop.close()
    sdk_us = (time.process_time() - start) * 1e6 / (streams * events)
    start = time.process_time()
    for _ in range(streams):
        _lean(reads)
    lean_us = (time.process_time() - start) * 1e6 / (streams * events)
    figures = {
        "name": "bench_openai_parse",
        "python": platform.python_version(),
        "events_per_stream": events,
        "streams": streams,
        "sdk_parser_cpu_us_per_event": round(sdk_us, 2),
        "lean_reader_cpu_us_per_event": round(lean_us, 2),
        "sdk_over_lean": round(sdk_us / lean_us, 1),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(json.dumps(figures, indent=1))
    RESULTS.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()

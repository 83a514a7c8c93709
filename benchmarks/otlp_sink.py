"""An OTLP/HTTP sink for `bench_load.py --otel`: a process of its own on loopback that
takes ``POST /v1/traces`` (protobuf, as the stack's exporter sends it), answers at once
and counts requests, bytes and spans (by ``service.name``); ``GET /_fake/stats`` gives
the counts and the seconds since the last export. It keeps nothing else.

Run: `PYTHONPATH=. .venv/bin/python -m benchmarks.otlp_sink [--port N]` (it prints
``{"url": ...}`` once it listens; SIGTERM stops it). :class:`OtlpSinkProcess` runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections import Counter
from typing import Any

import uvloop
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from harness.fake_process import FakeApiProcess

__all__ = ["OtlpSinkProcess"]


class OtlpSinkProcess(FakeApiProcess):
    """The sink in a process of its own: its CPU is not the load generator's."""

    module = "benchmarks.otlp_sink"


class _Counts:
    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        self.spans: Counter[str] = Counter()
        self.last_export = time.monotonic()

    async def traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        self.requests += 1
        self.bytes += len(body)
        for resource in message.resource_spans:
            service = next(
                (
                    a.value.string_value
                    for a in resource.resource.attributes
                    if a.key == "service.name"
                ),
                "",
            )
            self.spans[service] += sum(len(scope.spans) for scope in resource.scope_spans)
        self.last_export = time.monotonic()
        # An empty ExportTraceServiceResponse: full success.
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def stats(self, request: web.Request) -> web.Response:
        figures: dict[str, Any] = {
            "requests": self.requests,
            "bytes": self.bytes,
            "spans": sum(self.spans.values()),
            "spans_by_service": dict(self.spans),
            "idle_s": round(time.monotonic() - self.last_export, 3),
        }
        return web.json_response(figures)


async def _serve(port: int) -> None:
    counts = _Counts()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", counts.traces)
    app.router.add_get("/_fake/stats", counts.stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = runner.addresses[0][1]
    print(json.dumps({"url": f"http://127.0.0.1:{bound}"}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description="an OTLP/HTTP sink that counts spans")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    uvloop.run(_serve(args.port))


if __name__ == "__main__":
    main()

"""Traces (shared/tracing.py): a turn is one trace, from the gateway's submit through the
worker's attempt to its model rounds and tool calls, with the GenAI attributes and no
message text; spans reach an OTLP/HTTP receiver from a worker process; off, nothing of
OpenTelemetry's tracing is loaded."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from harness.redis_server import free_port
from harness.waits import poll
from tests.gateway_server import LiveGateway, live_gateway, signed_in
from tests.worker_kit import WorkerProcess, running_worker, wait_terminal
from turnbus.shared import tracing
from turnbus.shared._otel import OtelTracer
from turnbus.shared.events import TurnCompleted
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.scripted import ScriptedModel
from turnbus.worker.python_tools import PythonToolSource
from turnbus.worker.registry import ToolRegistry

SAMPLE_TOOLS = str(Path(__file__).parents[1] / "worker" / "sample_tools.py")
# A client's trace: the submit joins it.
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
# The turn's message: one round calls the tool, the next answers with its result.
SECRET = "octarine-lease"
MESSAGE = f'call lookup {{"term": "{SECRET}"}}'


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.install(OtelTracer.to(exporter))
    try:
        yield exporter
    finally:
        tracing.stop()


@pytest.fixture
async def traced_gw(settings: Settings, redis: aioredis.Redis) -> AsyncIterator[LiveGateway]:
    async with live_gateway(settings) as live:
        yield live


async def _one_turn(gw: LiveGateway, settings: Settings, redis: aioredis.Redis) -> str:
    registry = ToolRegistry([PythonToolSource([SAMPLE_TOOLS], entry_points=False)])
    async with (
        running_worker(settings, ScriptedModel(settings), tools=registry),
        signed_in(gw, settings) as http,
    ):
        created = await http.post("/v1/sessions", json={})
        session = created.json()["sessionId"]
        accepted = await http.post(
            f"/v1/sessions/{session}/turns",
            json={"message": MESSAGE},
            headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1"},
        )
        assert accepted.status_code == 202, accepted.text
        turn_id = accepted.json()["turnId"]
        keys = Keys(settings.prefix)
        events = await wait_terminal(redis, keys, "alice", session, turn_id, within=20)
        assert isinstance(events[-1], TurnCompleted), events[-1]
        return turn_id


def _by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def _attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_a_turn_is_one_trace_with_the_genai_attributes_and_no_text(
    spans: InMemorySpanExporter,
    traced_gw: LiveGateway,
    settings: Settings,
    redis: aioredis.Redis,
) -> None:
    turn_id = await _one_turn(traced_gw, settings, redis)
    finished = list(spans.get_finished_spans())
    assert {format(s.context.trace_id, "032x") for s in finished} == {CLIENT_TRACE}

    (submit,) = _by_name(finished, "POST /v1/sessions/{session_id}/turns")
    assert submit.parent is not None and format(submit.parent.span_id, "016x") == CLIENT_SPAN
    assert _attributes(submit)["turnbus.turn.id"] == turn_id
    assert _attributes(submit)["http.response.status_code"] == 202

    (turn,) = _by_name(finished, "invoke_agent turnbus")
    assert turn.parent is not None and turn.parent.span_id == submit.context.span_id
    t = _attributes(turn)
    assert t["turnbus.turn.id"] == turn_id
    assert t["gen_ai.conversation.id"] == _attributes(submit)["gen_ai.conversation.id"]
    assert t["turnbus.turn.status"] == "completed"
    assert t["turnbus.turn.attempt"] == 1

    rounds = sorted(_by_name(finished, "chat scripted"), key=lambda s: s.start_time or 0)
    assert len(rounds) == 2
    for rnd in rounds:
        assert rnd.parent is not None and rnd.parent.span_id == turn.context.span_id
        a = _attributes(rnd)
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.provider.name"] == "scripted"
        assert a["gen_ai.request.model"] == "scripted"
        assert a["gen_ai.usage.input_tokens"] > 0
        assert a["gen_ai.usage.output_tokens"] > 0
        assert a["gen_ai.usage.cache_read.input_tokens"] == 0
        assert "gen_ai.usage.cache_creation.input_tokens" in a
    assert _attributes(rounds[0])["gen_ai.response.finish_reasons"] == ("tool_use",)
    assert _attributes(rounds[1])["gen_ai.response.finish_reasons"] == ("end_turn",)
    assert t["gen_ai.usage.input_tokens"] == sum(
        _attributes(r)["gen_ai.usage.input_tokens"] for r in rounds
    )

    (tool,) = _by_name(finished, "execute_tool lookup")
    assert tool.parent is not None and tool.parent.span_id == turn.context.span_id
    a = _attributes(tool)
    assert a["gen_ai.tool.name"] == "lookup"
    assert a["gen_ai.tool.call.id"]
    assert a["turnbus.tool.outcome"] == "ok"

    # Neither the message, nor the tool's arguments or result, nor any text is kept.
    for span in finished:
        for value in _attributes(span).values():
            assert SECRET not in str(value), (span.name, value)


async def test_content_is_captured_only_when_asked(
    traced_gw: LiveGateway, settings: Settings, redis: aioredis.Redis
) -> None:
    exporter = InMemorySpanExporter()
    tracing.install(OtelTracer.to(exporter, capture_content=True))
    try:
        await _one_turn(traced_gw, settings, redis)
    finally:
        tracing.stop()
    finished = list(exporter.get_finished_spans())
    (tool,) = _by_name(finished, "execute_tool lookup")
    assert json.loads(_attributes(tool)["gen_ai.tool.call.arguments"]) == {"term": SECRET}
    assert SECRET in _attributes(tool)["gen_ai.tool.call.result"]
    first = min(_by_name(finished, "chat scripted"), key=lambda s: s.start_time or 0)
    assert SECRET in _attributes(first)["gen_ai.input.messages"]


def test_the_settings_turn_it_on_and_capture_stays_off_by_default() -> None:
    assert not Settings.from_env({}).otel
    on = Settings.from_env({"TURNBUS_OTEL": "1"})
    assert on.otel and not on.otel_capture_content
    assert Settings.from_env({"TURNBUS_OTEL_CAPTURE_CONTENT": "1"}).otel_capture_content


def test_off_a_span_is_one_constant_that_does_nothing() -> None:
    tracing.stop()
    first = tracing.span("a", parent={"traceparent": TRACEPARENT})
    assert first is tracing.span("b")
    with first as span:
        assert not span.recording
        assert not span.carrier()
        span.set("x", 1)
        span.failed("e")


# --- over OTLP/HTTP, from a worker process --------------------------------------------


class OtlpReceiver:
    """An OTLP/HTTP receiver: POST /v1/traces, protobuf bodies, each request decoded."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.port = free_port()
        self._runner: web.AppRunner | None = None

    async def _traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        self.requests.append(message)
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def __aenter__(self) -> OtlpReceiver:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    def spans(self) -> list[Any]:
        return [
            span
            for request in self.requests
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]

    def service_names(self) -> set[str]:
        return {
            attr.value.string_value
            for request in self.requests
            for resource in request.resource_spans
            for attr in resource.resource.attributes
            if attr.key == "service.name"
        }


@pytest.mark.slow
async def test_spans_reach_an_otlp_receiver_from_a_worker_process(
    settings: Settings, redis: aioredis.Redis, store: Any, tmp_path: Path
) -> None:
    async with OtlpReceiver() as receiver:
        worker = WorkerProcess(
            settings,
            "traced",
            tmp_path / "worker.log",
            TURNBUS_OTEL="1",
            TURNBUS_TOOLS=SAMPLE_TOOLS,
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.port}",
            OTEL_BSP_SCHEDULE_DELAY="100",
        )
        try:
            await store.create("u1", "s1")
            turns = TurnStore(redis, Keys(settings.prefix), settings)
            record, _, _ = await turns.submit_queued(
                "u1", "s1", MESSAGE, trace={"traceparent": TRACEPARENT}
            )
            events = await wait_terminal(
                redis, Keys(settings.prefix), "u1", "s1", record.turnId, within=30
            )
            assert isinstance(events[-1], TurnCompleted), worker.output()

            def arrived() -> bool:
                names = {span.name for span in receiver.spans()}
                return {"invoke_agent turnbus", "execute_tool lookup"} <= names

            await poll(arrived, within=10, what="the worker's spans at the receiver")
        finally:
            worker.proc.terminate()
            await asyncio.to_thread(worker.proc.wait, 20)
    assert receiver.requests
    assert receiver.service_names() == {"turnbus-worker"}
    received = receiver.spans()
    assert {span.trace_id.hex() for span in received} == {CLIENT_TRACE}
    (turn,) = [s for s in received if s.name == "invoke_agent turnbus"]
    assert turn.parent_span_id.hex() == CLIENT_SPAN
    assert sum(1 for s in received if s.name == "chat scripted") == 2
    assert worker.proc.returncode == 0, worker.output()


# --- off: nothing of OpenTelemetry's tracing is loaded --------------------------------

_OFF_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys

    if sys.argv[2] == "blocked":
        # As if the otel extra were not installed.
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "opentelemetry" or name.startswith("opentelemetry."):
                    raise ImportError(f"blocked: {name}")
                return None

        sys.meta_path.insert(0, Block())

    from turnbus.gateway.app import create_app
    from turnbus.shared.envelope import EnvelopeStore
    from turnbus.shared.keys import Keys
    from turnbus.shared.settings import Settings
    from turnbus.shared.turns import TurnStore
    from turnbus.worker.consumer import Worker
    from turnbus.worker.models.scripted import ScriptedModel
    import redis.asyncio as aioredis


    async def main():
        settings = Settings(redis_url=sys.argv[1], prefix=sys.argv[3], jwt_secret="s" * 32)
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            worker = Worker(settings, name="off", model=ScriptedModel(settings))
            task = asyncio.create_task(worker.run())
            redis = aioredis.Redis.from_url(settings.redis_url)
            keys = Keys(settings.prefix)
            await EnvelopeStore(redis, keys).create("u", "s")
            record, _, _ = await TurnStore(redis, keys, settings).submit_queued("u", "s", "hi")
            for _ in range(200):
                status = await redis.hget(keys.turn("u", "s", record.turnId), "status")
                if status == b"completed":
                    break
                await asyncio.sleep(0.05)
            else:
                raise SystemExit(f"the turn did not complete: {status!r}")
            worker.request_stop()
            await task
            await worker.aclose()
            await redis.aclose()
        loaded = sorted(
            m for m in sys.modules
            if m == "turnbus.shared._otel"
            or m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter"))
        )
        print("LOADED", loaded)


    asyncio.run(main())
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("otel", ["installed", "blocked"])
def test_off_a_gateway_and_a_worker_load_no_tracing(
    otel: str, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    script = tmp_path / "off.py"
    script.write_text(_OFF_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TURNBUS_", "OTEL_"))}
    done = subprocess.run(
        [sys.executable, str(script), redis_url, otel, prefix],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "LOADED []" in done.stdout, done.stdout


async def test_a_submit_without_tracing_writes_no_trace_context(
    gw: LiveGateway, http: httpx.AsyncClient, redis: aioredis.Redis, settings: Settings
) -> None:
    created = await http.post("/v1/sessions", json={})
    session = created.json()["sessionId"]
    accepted = await http.post(
        f"/v1/sessions/{session}/turns",
        json={"message": "hi"},
        headers={"traceparent": TRACEPARENT},
    )
    assert accepted.status_code == 202
    keys = Keys(settings.prefix)
    entries = await redis.xrange(keys.work(Keys.shard_for("alice", session, settings.shards)))
    assert [sorted(fields) for _, fields in entries] == [["session", "turn", "user"]]

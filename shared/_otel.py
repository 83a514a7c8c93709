"""The OpenTelemetry side of :mod:`turnbus.shared.tracing`: the only module that
imports the SDK, loaded only when tracing is turned on."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from turnbus.shared.tracing import AttributeValue

__all__ = ["OtelTracer"]

_PROPAGATOR = TraceContextTextMapPropagator()
_KINDS = {
    "internal": SpanKind.INTERNAL,
    "server": SpanKind.SERVER,
    "client": SpanKind.CLIENT,
    "producer": SpanKind.PRODUCER,
    "consumer": SpanKind.CONSUMER,
}


class _LiveSpan:
    __slots__ = ("_failed", "_span")

    recording = True

    def __init__(self, span: Span) -> None:
        self._span = span
        self._failed = False

    def set(self, key: str, value: AttributeValue | None) -> None:
        if value is not None:
            self._span.set_attribute(key, value)

    def rename(self, name: str) -> None:
        self._span.update_name(name)

    def failed(self, error_type: str) -> None:
        self._failed = True
        self._span.set_attribute("error.type", error_type)
        self._span.set_status(Status(StatusCode.ERROR))

    def carrier(self) -> dict[str, str]:
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, context=set_span_in_context(self._span))
        return out


class OtelTracer:
    """Spans of one process, on a tracer provider of its own (the global one is left to
    the application embedding turnbus)."""

    def __init__(self, provider: TracerProvider, *, capture_content: bool = False) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("turnbus")
        self.capture_content = capture_content

    @classmethod
    def exporting(cls, service: str, *, capture_content: bool) -> OtelTracer:
        """Spans batched to OTLP/HTTP, where the ``OTEL_EXPORTER_OTLP_*`` variables say."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls.to(
            OTLPSpanExporter(), service=service, capture_content=capture_content, batch=True
        )

    @classmethod
    def to(
        cls,
        exporter: SpanExporter,
        *,
        service: str = "turnbus",
        capture_content: bool = False,
        batch: bool = False,
    ) -> OtelTracer:
        """Spans to this exporter: each as it ends, or in batches."""
        # OTEL_SERVICE_NAME, when set, names the service instead.
        named = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
        provider = TracerProvider(resource=Resource.create(named))
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
        return cls(provider, capture_content=capture_content)

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        attributes: Mapping[str, AttributeValue | None] | None,
        *,
        parent: Mapping[str, str] | None,
        kind: str,
    ) -> Iterator[_LiveSpan]:
        context = _PROPAGATOR.extract(parent) if parent is not None else None
        attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
        # Exceptions are not recorded: their messages may hold a model's or a tool's text.
        with self._tracer.start_as_current_span(
            name,
            context=context,
            kind=_KINDS[kind],
            attributes=attrs,
            record_exception=False,
            set_status_on_exception=False,
        ) as otel_span:
            live = _LiveSpan(otel_span)
            try:
                yield live
            except BaseException as exc:
                if not live._failed:
                    live.failed(type(exc).__qualname__)
                raise

    def shutdown(self) -> None:
        self._provider.shutdown()

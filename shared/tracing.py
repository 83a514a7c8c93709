"""Traces: one per turn, off unless ``TURNBUS_OTEL=1`` (docs/operations.md, *Tracing*).

Every span of the services is opened here, with :func:`span`. While tracing is off it
returns one constant no-op context manager, and nothing here imports OpenTelemetry: the
SDK and its exporter are loaded by :func:`start` (from :mod:`turnbus.shared._otel`),
only when the setting is on, so they are an optional extra (``turnbus[otel]``).

A span's trace context crosses Redis in the work entry (:meth:`Span.carrier`: the W3C
``traceparent`` and ``tracestate``), so the gateway's submit and the worker's turn are
one trace.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Literal, Protocol

from turnbus.shared.settings import Settings

if TYPE_CHECKING:
    from turnbus.shared._otel import OtelTracer

__all__ = [
    "CARRIER_FIELDS",
    "AttributeValue",
    "Span",
    "TracingUnavailable",
    "capture_content",
    "enabled",
    "install",
    "span",
    "start",
    "stop",
]

AttributeValue = str | bool | int | float | Sequence[str]
SpanKind = Literal["internal", "server", "client", "producer", "consumer"]
# The fields of a trace context (W3C Trace Context), in a work entry and an HTTP request.
CARRIER_FIELDS = ("traceparent", "tracestate")


class TracingUnavailable(RuntimeError):
    """``TURNBUS_OTEL=1`` without the OpenTelemetry packages installed."""


class Span(Protocol):
    """What a caller does with an open span."""

    @property
    def recording(self) -> bool:
        """Whether attributes are kept: build costly ones only when this is true."""
        ...

    def set(self, key: str, value: AttributeValue | None) -> None:
        """Set an attribute (``None`` sets nothing)."""
        ...

    def rename(self, name: str) -> None:
        """Name the span once what names it is known."""
        ...

    def failed(self, error_type: str) -> None:
        """Mark the span failed, ``error.type`` being a code, never a message."""
        ...

    def carrier(self) -> Mapping[str, str]:
        """The span's trace context as ``traceparent`` (and ``tracestate``), to carry
        to another process; empty when off."""
        ...


class _NoSpan:
    """The span while tracing is off: one instance, every method does nothing."""

    __slots__ = ()

    recording = False

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def set(self, key: str, value: AttributeValue | None) -> None:
        return None

    def rename(self, name: str) -> None:
        return None

    def failed(self, error_type: str) -> None:
        return None

    def carrier(self) -> Mapping[str, str]:
        return _NO_CARRIER


_NO_SPAN = _NoSpan()
_NO_CARRIER: Mapping[str, str] = MappingProxyType({})
_tracer: OtelTracer | None = None


def span(
    name: str,
    attributes: Mapping[str, AttributeValue | None] | None = None,
    *,
    parent: Mapping[str, str] | None = None,
    kind: SpanKind = "internal",
) -> AbstractContextManager[Span]:
    """A span around a ``with`` block, the child of the current one, or of ``parent``
    (a trace context carried from another process) when given. Off, the no-op span."""
    tracer = _tracer
    if tracer is None:
        return _NO_SPAN
    return tracer.span(name, attributes, parent=parent, kind=kind)


def enabled() -> bool:
    """Whether spans are recorded (checked before reading a trace context to carry)."""
    return _tracer is not None


def capture_content() -> bool:
    """Whether spans may carry message text, tool arguments and results (never without
    ``TURNBUS_OTEL_CAPTURE_CONTENT=1``)."""
    tracer = _tracer
    return tracer is not None and tracer.capture_content


def start(settings: Settings, service: str) -> bool:
    """Turn tracing on for this process when the settings ask for it and nobody did yet:
    spans are exported over OTLP/HTTP, configured by the standard ``OTEL_*`` variables.
    Returns whether this call turned it on (its caller then calls :func:`stop`).
    Raises :class:`TracingUnavailable` when the packages are missing."""
    global _tracer
    if not settings.otel or _tracer is not None:
        return False
    try:
        from turnbus.shared import _otel
    except ImportError as exc:
        raise TracingUnavailable(
            f"TURNBUS_OTEL=1 needs the OpenTelemetry packages: pip install 'turnbus[otel]' ({exc})"
        ) from None
    _tracer = _otel.OtelTracer.exporting(service, capture_content=settings.otel_capture_content)
    return True


def install(tracer: OtelTracer | None) -> None:
    """Use this tracer (tests: one writing to an in-memory exporter); ``None``: off."""
    global _tracer
    _tracer = tracer


def stop() -> None:
    """Export the spans still held and turn tracing off."""
    global _tracer
    tracer, _tracer = _tracer, None
    if tracer is not None:
        tracer.shutdown()

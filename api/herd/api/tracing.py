"""OpenTelemetry tracing for herd's processes: W3C ``traceparent`` across every hop, OTLP export off
by default.

Every process creates its spans through the OpenTelemetry API (``tracer``). Until
``configure_tracing`` is given an OTLP endpoint (``--otlp-traces-endpoint``, or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), the API's tracer records nothing and a span costs a few
attribute writes on a no-op object. With one, spans go through a batching processor to an OTLP/HTTP
collector, tagged with the process's ``service.name``. A span's context travels to the next process
in the W3C ``traceparent`` / ``tracestate`` headers (``trace_headers``), and the receiving process
parents its spans on what it reads (``context_from``), never on whatever span happens to be current:
herd's gateway passes it to its workers, and the vLLM sidecar passes it on to vLLM untouched.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "ENDPOINT_ENV",
    "TRACE_HEADERS",
    "client_trace_headers",
    "configure_tracing",
    "context_from",
    "trace_headers",
    "tracer",
]

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
TRACE_HEADERS = ("traceparent", "tracestate")
_PROPAGATOR = TraceContextTextMapPropagator()


def configure_tracing(service: str, endpoint: str | None) -> bool:
    """Export this process's spans over OTLP/HTTP to ``endpoint`` (default: ``ENDPOINT_ENV``, and
    none: tracing stays off); whether it is on. Imports the SDK only when it is."""
    endpoint = endpoint or os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    return True


def tracer(name: str) -> Tracer:
    """The tracer of module ``name`` (it follows the provider set later, if any)."""
    return trace.get_tracer(name)


def client_trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The request's ``traceparent`` and ``tracestate`` as a next hop may be sent them: printable
    ASCII, what a header line may carry (a client's other bytes are dropped, never passed on)."""
    return {
        name: value
        for name in TRACE_HEADERS
        if (value := headers.get(name)) is not None and value.isascii() and value.isprintable()
    }


def context_from(headers: Mapping[str, str]) -> Context:
    """The trace context a request's ``traceparent`` carries (an empty one without it)."""
    carrier = client_trace_headers(headers)
    return _PROPAGATOR.extract(carrier) if carrier else Context()


def trace_headers(span: Span) -> dict[str, str]:
    """The ``traceparent`` (and ``tracestate``) naming ``span`` as the next hop's parent; empty while
    tracing is off."""
    carrier: dict[str, str] = {}
    if span.get_span_context().is_valid:
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier

"""OpenTelemetry traces of the control plane: W3C `traceparent` in, spans out.

A caller's `traceparent` (and `tracestate`) in the gRPC metadata is continued: the
request's span is its child, and each worker attempt passes its own span on to the
worker (`GenerateRequest.traceparent`), whose engine continues it (vLLM's own
`llm_request` span, when the worker's engine exports traces). Spans:

    switchyard.Generate (server)        the RPC, child of the caller's span
    ├── switchyard.admission            waiting for a slot
    ├── switchyard.route                the policy choosing a worker
    └── switchyard.worker_attempt       one per worker tried (client); a failover is
        └── (worker) llm_request        an event on the attempt it ends

They are exported over OTLP/gRPC when an endpoint is configured (`tracing:
{otlp_endpoint: host:port}`, or OpenTelemetry's own `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
or `OTEL_EXPORTER_OTLP_ENDPOINT`). Without one the API's no-op tracer runs: nothing is
recorded, but the caller's trace still reaches the worker unchanged and every log line
of the request carries its `trace_id`.

Spans are started and ended explicitly with their parent passed along, never made
"current": the generators that hold them are suspended and resumed, and closed, from
other contexts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

SERVICE_NAME = "switchyard-control"
_PROPAGATOR = TraceContextTextMapPropagator()
_HEADERS = ("traceparent", "tracestate")
_provider: Any = None

tracer = trace.get_tracer("switchyard.control")

__all__ = [
    "Context",
    "Span",
    "SpanKind",
    "configure",
    "endpoint_from_env",
    "extract",
    "headers_of",
    "shutdown",
    "trace_id_of",
    "tracer",
    "with_span",
]


def endpoint_from_env() -> str | None:
    return (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or None
    )


def configure(endpoint: str | None, service_name: str = SERVICE_NAME) -> bool:
    """Export spans to `endpoint` (OTLP over gRPC, plaintext) from now on; with None,
    keep the no-op tracer. Returns whether spans are exported."""
    global _provider
    if endpoint is None or _provider is not None:
        return _provider is not None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint, insecure=True)))
    trace.set_tracer_provider(provider)
    _provider = provider  # the module's tracer (a proxy) now records through it
    return True


def shutdown() -> None:
    """Send what is buffered (at exit)."""
    if _provider is not None:
        _provider.shutdown()


def extract(metadata: Iterable[tuple[str, Any]] | None) -> Context:
    """The caller's trace context from gRPC metadata (empty if it sent none)."""
    carrier = {k: v for k, v in metadata or () if k in _HEADERS and isinstance(v, str)}
    return _PROPAGATOR.extract(carrier)


def with_span(span: Span, parent: Context | None = None) -> Context:
    return trace.set_span_in_context(span, parent)


def headers_of(span: Span) -> Mapping[str, str]:
    """`traceparent` (and `tracestate`) naming `span` as the parent, for the next hop.
    With the no-op tracer that is the caller's own, passed through."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def trace_id_of(span: Span) -> str | None:
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else None

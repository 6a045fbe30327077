"""OpenTelemetry tracing: OTLP export when configured, gRPC instrumentation, W3C traceparent.

Off unless an OTLP endpoint (`--otlp-endpoint` / `OTEL_EXPORTER_OTLP_ENDPOINT`)
or an exporter (tests) is given; then every gRPC server and client of the
process is instrumented by `opentelemetry-instrumentation-grpc`, so a
request's trace follows it frontend → router → worker (→ prefill worker) via
the `traceparent` metadata. Only entry points call `setup_tracing`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

__all__ = ["extract_context", "otel_active", "setup_tracing", "shutdown_tracing", "tracer", "tracing_enabled"]

log = logging.getLogger(__name__)
_provider: Any = None


def setup_tracing(service_name: str, *, otlp_endpoint: str | None = None, exporter: Any = None) -> bool:
    """Enable tracing for this process (idempotent); returns whether it is on."""
    global _provider
    if not otlp_endpoint and exporter is None:
        return _provider is not None
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    if _provider is None:
        _provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        trace.set_tracer_provider(_provider)
        GrpcAioInstrumentorServer().instrument()
        GrpcAioInstrumentorClient().instrument()
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)))
        log.info("tracing: exporting spans of %s to %s", service_name, otlp_endpoint)
    if exporter is not None:
        _provider.add_span_processor(SimpleSpanProcessor(exporter))
    return True


def shutdown_tracing() -> None:
    """Flush and stop span export (entry points call it last)."""
    if _provider is not None:
        _provider.shutdown()


def tracer() -> trace.Tracer:
    """meshllm's tracer (a no-op one when tracing is off)."""
    return trace.get_tracer("meshllm")


def tracing_enabled() -> bool:
    """Whether this process records spans at all (setup_tracing was given somewhere to send them)."""
    return _provider is not None


def otel_active() -> bool:
    """True when a recording span is current: instrumentation propagates traceparent itself."""
    return bool(trace.get_current_span().get_span_context().is_valid)


def extract_context(headers: Mapping[str, str]) -> otel_context.Context:
    """The parent context carried by W3C `traceparent` / `tracestate` headers."""
    return propagate.extract(headers)

"""OpenTelemetry tracing: OTLP or console export when configured, gRPC instrumentation, W3C traceparent.

Off unless an OTLP endpoint (`--otlp-endpoint` / `OTEL_EXPORTER_OTLP_ENDPOINT`),
the console (`--otlp-endpoint console` / `OTEL_TRACES_EXPORTER=console`: one
JSON line per span on stderr) or an exporter (tests) is given; then every
gRPC server and client of the process is instrumented by
`opentelemetry-instrumentation-grpc`, so a request's trace follows it
frontend → router → worker (→ prefill worker) via the `traceparent` metadata.

Plane and control calls are not instrumented (`PLANE_SERVICE_PREFIXES`, `PLANE_METHODS`): etcd's own gRPC
API (discovery, leases, watches), health checks, and the worker calls a
router or frontend makes to learn the mesh — otherwise every process start
would leave stray root traces; an idle worker's health canaries run
`untraced()` for the same reason. Each role names its spans with its own
`service.name` (`meshllm-frontend`, `meshllm-router`,
`meshllm-worker-prefill`, ...): `tracer(service)` gives a tracer of that
service sharing this process's exporters, so `meshllm run` (every role in
one process) tells them apart too. Only entry points call `setup_tracing`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from meshllm.logs import redact_url

__all__ = [
    "CONSOLE",
    "FRONTEND_SERVICE",
    "extract_context",
    "otel_active",
    "setup_tracing",
    "shutdown_tracing",
    "tracer",
    "tracing_enabled",
    "untraced",
    "worker_service_name",
]

log = logging.getLogger(__name__)
FRONTEND_SERVICE = "meshllm-frontend"
CONSOLE = "console"  # the `--otlp-endpoint` value (and `OTEL_TRACES_EXPORTER` value) that prints spans to stderr
# gRPC services and methods that are plumbing, not requests: never traced.
PLANE_SERVICE_PREFIXES = ("etcdserverpb.", "v3electionpb.", "v3lockpb.", "grpc.health.", "grpc.reflection.")
PLANE_METHODS = ("GetInfo", "GetKvSnapshot", "GetModelFiles", "GenerateSession")  # sessions trace each stream themselves
_provider: Any = None
_processor: Any = None  # the span processors every service's provider shares
_services: dict[str, Any] = {}


def worker_service_name(role: str) -> str:
    """`service.name` of a worker by disaggregation role: meshllm-worker (agg), meshllm-worker-prefill, -decode."""
    return "meshllm-worker" if role in ("agg", "aggregated") else f"meshllm-worker-{role}"


def _one_line(span: Any) -> str:
    """The console format: the SDK's JSON for one span, on one line."""
    return json.dumps(json.loads(span.to_json(indent=None)), separators=(",", ":")) + "\n"


def _rpc_filter() -> Any:
    """The instrumentation filter: True for calls that are traced (everything but the plane's own)."""
    from opentelemetry.instrumentation.grpc import filters

    plane = filters.any_of(
        *(filters.service_prefix(p) for p in PLANE_SERVICE_PREFIXES), *(filters.method_name(m) for m in PLANE_METHODS)
    )
    return filters.negate(plane)


def setup_tracing(service_name: str, *, otlp_endpoint: str | None = None, exporter: Any = None) -> bool:
    """Enable tracing for this process (idempotent); returns whether it is on.

    `otlp_endpoint` is an OTLP gRPC endpoint, or `CONSOLE` for one JSON line
    per span on stderr; `exporter` (tests) receives every span as it ends.
    """
    global _provider, _processor
    if not otlp_endpoint and exporter is None:
        return _provider is not None
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SynchronousMultiSpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    if _provider is None:
        _processor = SynchronousMultiSpanProcessor()
        _provider = TracerProvider(resource=Resource.create({"service.name": service_name}), active_span_processor=_processor)
        _services[service_name] = _provider
        trace.set_tracer_provider(_provider)
        GrpcAioInstrumentorServer(filter_=_rpc_filter()).instrument()
        GrpcAioInstrumentorClient(filter_=_rpc_filter()).instrument()
    if otlp_endpoint == CONSOLE:
        _processor.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr, formatter=_one_line)))
        log.info("tracing: printing spans of %s to stderr", service_name)
    elif otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        _processor.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)))
        log.info("tracing: exporting spans of %s to %s", service_name, redact_url(otlp_endpoint))
    if exporter is not None:
        _processor.add_span_processor(SimpleSpanProcessor(exporter))
    return True


def shutdown_tracing() -> None:
    """Flush and stop span export (entry points call it last)."""
    if _provider is not None:
        _provider.shutdown()


def untraced() -> AbstractContextManager[None]:
    """Work inside records no spans, ours or the gRPC instrumentation's (health canaries: not requests)."""
    if _provider is None:
        return contextlib.nullcontext()
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    return suppress_instrumentation()


def tracer(service: str | None = None) -> trace.Tracer:
    """meshllm's tracer (a no-op one when tracing is off or `untraced()`); `service` names the role its spans belong to."""
    if _provider is None:
        return trace.get_tracer("meshllm")
    from opentelemetry.instrumentation.utils import is_instrumentation_enabled  # loaded by setup_tracing already

    if not is_instrumentation_enabled():
        return trace.NoOpTracer()
    if service is None:
        return trace.get_tracer("meshllm")
    provider = _services.get(service)
    if provider is None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        resource = _provider.resource.merge(Resource({"service.name": service}))
        provider = TracerProvider(resource=resource, active_span_processor=_processor, shutdown_on_exit=False)
        _services[service] = provider
    return provider.get_tracer("meshllm")  # type: ignore[no-any-return]


def tracing_enabled() -> bool:
    """Whether this process records spans at all (setup_tracing was given somewhere to send them)."""
    return _provider is not None


def otel_active() -> bool:
    """True when a recording span is current: instrumentation propagates traceparent itself."""
    return bool(trace.get_current_span().get_span_context().is_valid)


def extract_context(headers: Mapping[str, str]) -> otel_context.Context:
    """The parent context carried by W3C `traceparent` / `tracestate` headers."""
    return propagate.extract(headers)

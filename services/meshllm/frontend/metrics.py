"""Prometheus metrics of one frontend (its own registry, so a `meshllm run` process can hold several)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

__all__ = ["FrontendMetrics", "ModelMetrics"]

disable_created_metrics()  # no `_created` series: nobody charts them, and they double every counter's series

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


@dataclass(frozen=True, slots=True)
class ModelMetrics:
    """The per-model children, labelled once (labels() on every token would cost more than the observation)."""

    ttft: Any
    itl: Any
    e2e: Any
    input_tokens: Any
    output_tokens: Any
    cached_tokens: Any


class FrontendMetrics:
    """Requests by route and status, TTFT / ITL / end-to-end latency, in-flight requests, token counts, API key use."""

    def __init__(self, *, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "meshllm_frontend_requests", "HTTP and gRPC requests by route, status and model ('' when none applies)",
            ["route", "status", "model"], registry=r,
        )  # fmt: skip
        self.inflight = Gauge("meshllm_frontend_inflight_requests", "Requests being served", registry=r)
        self.ttft = Histogram(
            "meshllm_frontend_time_to_first_token_seconds",
            "Arrival to first token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "meshllm_frontend_inter_token_latency_seconds",
            "Time between tokens (a coalesced chunk counts once per token)",
            ["model"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "meshllm_frontend_request_duration_seconds",
            "Arrival to last byte",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.input_tokens = Counter("meshllm_frontend_input_tokens", "Prompt tokens", ["model"], registry=r)
        self.output_tokens = Counter("meshllm_frontend_output_tokens", "Completion tokens", ["model"], registry=r)
        self.cached_tokens = Counter(
            "meshllm_frontend_cached_tokens", "Prompt tokens served from a prefix cache", ["model"], registry=r
        )
        self.disconnects = Counter("meshllm_frontend_client_disconnects", "Requests whose client went away", registry=r)
        # API keys (frontend/auth.py): a key is named by its id, never by the key.
        self.api_key_requests = Counter(
            "meshllm_frontend_api_key_requests", "Requests let in, by API key id and API (http, grpc)", ["key_id", "api"],
            registry=r,
        )  # fmt: skip
        self.auth_failures = Counter(
            "meshllm_frontend_auth_failures", "Requests refused for a missing or wrong API key", ["api", "reason"], registry=r
        )
        self._key_children: dict[tuple[str, str], Any] = {}

        self._models: dict[str, ModelMetrics] = {}
        self._also: list[CollectorRegistry] = []

    def for_model(self, name: str) -> ModelMetrics:
        m = self._models.get(name)
        if m is None:
            m = self._models[name] = ModelMetrics(
                *(
                    metric.labels(name)
                    for metric in (self.ttft, self.itl, self.e2e, self.input_tokens, self.output_tokens, self.cached_tokens)
                )
            )
        return m

    def key_used(self, key_id: str, api: str) -> None:
        """Count one request let in with the key `key_id` on `api`."""
        child = self._key_children.get((key_id, api))
        if child is None:
            child = self._key_children[(key_id, api)] = self.api_key_requests.labels(key_id, api)
        child.inc()

    def include(self, registry: CollectorRegistry) -> None:
        """Serve `registry`'s metrics on this /metrics too (`meshllm run`: the router's and workers')."""
        self._also.append(registry)

    def render(self) -> bytes:
        """The text exposition format: this frontend's metrics and those of the registries included."""
        return generate_latest(_Merged([self.registry, *self._also]) if self._also else self.registry)


class _Merged:
    """Several registries as one: families of the same name (one per worker) exposed once, with all their samples."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Iterable[Any]:
        families: dict[str, Any] = {}
        for registry in self.registries:
            for family in registry.collect():
                same = families.get(family.name)
                if same is None:
                    families[family.name] = family
                else:
                    same.samples.extend(family.samples)
        return list(families.values())

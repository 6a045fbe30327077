"""Prometheus metrics of one frontend (its own registry, so a `meshllm run` process can hold several)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

__all__ = ["FrontendMetrics", "ModelMetrics", "ObservationBatch"]

disable_created_metrics()  # no `_created` series: nobody charts them, and they double every counter's series

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ObservationBatch:
    """One request's observations of a histogram child, added to it `flush_every` at a time and at the end.

    `Histogram.observe` takes two locked increments (the sum, one bucket) per call: per streamed chunk that was
    ~6 % of a frontend's CPU at one event per token. Here a chunk costs a list increment, and a flush adds the
    counts bucket by bucket: the histogram's sum and buckets end up exactly as with one `observe` each. Uses the
    child's `_upper_bounds`, `_buckets` and `_sum` (prometheus_client's Histogram, in both its single- and
    multi-process modes; tests/unit/test_frontend_metrics_batch.py compares the two ways).
    """

    __slots__ = ("_bounds", "_child", "_counts", "_n", "_sum", "flush_every")

    def __init__(self, child: Any, *, flush_every: int = 64) -> None:
        self._child = child
        self._bounds: list[float] = list(child._upper_bounds)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._n = 0
        self.flush_every = flush_every

    def observe(self, amount: float, count: int = 1) -> None:
        """`count` observations of `amount` (a merged chunk of `count` tokens, each `amount` after the one before)."""
        self._counts[bisect_left(self._bounds, amount)] += count  # the first bucket with amount <= bound, as observe()
        self._sum += amount * count
        self._n += count
        if self._n >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self._n:
            return
        child, counts = self._child, self._counts
        child._sum.inc(self._sum)
        for i, c in enumerate(counts):
            if c:
                child._buckets[i].inc(c)
                counts[i] = 0
        self._sum, self._n = 0.0, 0


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
        # API keys (frontend/http/auth.py): a key is named by its id, never by the key.
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

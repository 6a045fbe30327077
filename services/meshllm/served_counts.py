"""The frontend's served-request counters and latency histograms, read from Prometheus samples.

One reading (`read_counts`) sums the counters, the in-flight gauge and the
histogram buckets of `meshllm_frontend_*` over models and processes; two
readings give the rates and percentiles between them. The dashboard reads
the frontend's own registry this way, and the planner reads frontends'
`/metrics` text the same way, so both agree with Grafana: percentiles
interpolate within buckets as PromQL's `histogram_quantile` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HISTOGRAMS", "Counts", "delta_buckets", "quantile", "read_counts"]

HISTOGRAMS = {
    "meshllm_frontend_time_to_first_token_seconds": "ttft",
    "meshllm_frontend_inter_token_latency_seconds": "itl",
    "meshllm_frontend_request_duration_seconds": "e2e",
}
_INFERENCE_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "grpc:ChatCompletion", "grpc:Completion"})
_TOKENS = {"meshllm_frontend_input_tokens": "input_tokens", "meshllm_frontend_output_tokens": "output_tokens"}


@dataclass(slots=True)
class Counts:
    """Cumulative counts read at one moment."""

    at: float
    requests: float = 0.0
    failed: float = 0.0
    input_tokens: float = 0.0
    output_tokens: float = 0.0
    inflight: float = 0.0
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> le -> cumulative count


def read_counts(families: Iterable[Any], at: float) -> Counts:
    """Sum the series over models (and processes); `families` as prometheus_client's collect() or text parser give."""
    c = Counts(at, buckets={k: {} for k in HISTOGRAMS.values()})
    for family in families:
        name = family.name
        if name == "meshllm_frontend_requests":
            for s in family.samples:
                if s.name.endswith("_total") and s.labels.get("route") in _INFERENCE_ROUTES:
                    c.requests += s.value
                    if _failed(s.labels.get("status", "")):
                        c.failed += s.value
        elif name in _TOKENS:
            total = sum(s.value for s in family.samples if s.name.endswith("_total"))
            setattr(c, _TOKENS[name], getattr(c, _TOKENS[name]) + total)
        elif name == "meshllm_frontend_inflight_requests":
            c.inflight += sum(s.value for s in family.samples)
        elif name in HISTOGRAMS:
            into = c.buckets[HISTOGRAMS[name]]
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    into[le] = into.get(le, 0.0) + s.value
    return c


def _failed(status: str) -> bool:
    """HTTP 4xx/5xx but a client's own disconnect (499); gRPC calls that did not end ok."""
    if status.isdigit():
        return int(status) >= 400 and status != "499"
    return status != "ok"


def delta_buckets(new: Counts, old: Counts, key: str) -> dict[float, float]:
    """Histogram `key`'s buckets between two readings (a counter reset reads as zero, never negative)."""
    before = old.buckets.get(key, {})
    return {le: max(0.0, n - before.get(le, 0.0)) for le, n in new.buckets.get(key, {}).items()}


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """PromQL's histogram_quantile over cumulative `le -> count` buckets; None when empty."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower

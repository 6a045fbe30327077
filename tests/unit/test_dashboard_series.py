"""The live mesh page's chart maths (frontend/http/dashboard.py): percentiles as PromQL computes them, rates between readings."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram

from meshllm.frontend.http.dashboard import point
from meshllm.frontend.metrics import FrontendMetrics
from meshllm.served_counts import quantile, read_counts

INF = math.inf


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        (0.5, 0.15),  # rank 50 of 100: half way into (0.1, 0.2], which holds ranks 40..60
        (0.2, 0.05),  # rank 20 in the first bucket (0, 0.1] holding 40: half of it
        (0.99, 0.5),  # rank 99 falls in +Inf: the highest finite bound
    ],
)
def test_quantile_interpolates_within_buckets_like_histogram_quantile(q: float, expected: float) -> None:
    buckets = {0.1: 40.0, 0.2: 60.0, 0.5: 60.0, INF: 100.0}
    assert quantile(q, buckets) == pytest.approx(expected)


def test_quantile_of_nothing_is_none() -> None:
    assert quantile(0.5, {}) is None
    assert quantile(0.5, {0.1: 0.0, INF: 0.0}) is None


def test_quantiles_match_the_observations_bucket() -> None:
    registry = CollectorRegistry()
    h = Histogram("meshllm_frontend_time_to_first_token_seconds", "x", ["model"], buckets=(0.01, 0.1, 1.0), registry=registry)
    for _ in range(90):
        h.labels("a").observe(0.05)
    for _ in range(10):
        h.labels("b").observe(0.5)  # another model: summed in
    p = point(read_counts(registry.collect(), 2.0), read_counts([], 0.0))
    assert 0.01 < p["ttft_p50"] <= 0.1
    assert 0.1 < p["ttft_p99"] <= 1.0
    assert p["itl_p50"] is None  # no observations


def test_rates_count_inference_routes_and_failures_only() -> None:
    m = FrontendMetrics()
    before = read_counts(m.registry.collect(), 10.0)
    m.requests.labels("/v1/chat/completions", "200", "x").inc(8)
    m.requests.labels("/v1/completions", "503", "x").inc(2)
    m.requests.labels("/v1/chat/completions", "499", "x").inc(2)  # the client went away: not a failure
    m.requests.labels("grpc:Completion", "error", "x").inc(1)
    m.requests.labels("/dashboard/state", "200", "").inc(50)
    m.requests.labels("/metrics", "200", "").inc(50)
    m.for_model("x").output_tokens.inc(100)
    p = point(read_counts(m.registry.collect(), 12.0), before)
    assert p["rps"] == pytest.approx(13 / 2)
    assert p["failed_ps"] == pytest.approx(3 / 2)
    assert p["tokens_ps"] == pytest.approx(50)

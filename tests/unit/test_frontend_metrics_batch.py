"""ObservationBatch (frontend/metrics.py): a request's ITL observations reach the histogram exactly as one observe() each.

Locks: the exposition (every bucket and the count exactly, the sum up to float rounding: it adds in another
order) equals that of a histogram observed one value at a time, for values on, between and beyond the bucket
bounds, flushed both by count and at the end; nothing is added before a flush, and an empty flush adds nothing.
"""

from __future__ import annotations

import math
import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from meshllm.frontend.metrics import ObservationBatch

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


def exposition(registry: CollectorRegistry) -> tuple[list[str], float]:
    """The exposition's lines but the sum, and the sum."""
    lines = generate_latest(registry).decode().splitlines()
    (total,) = (float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("itl_seconds_sum"))
    return [line for line in lines if not line.startswith("itl_seconds_sum")], total


def pair() -> tuple[CollectorRegistry, Histogram, CollectorRegistry, Histogram]:
    a, b = CollectorRegistry(), CollectorRegistry()
    ha = Histogram("itl_seconds", "x", ["model"], buckets=BUCKETS, registry=a)
    hb = Histogram("itl_seconds", "x", ["model"], buckets=BUCKETS, registry=b)
    return a, ha, b, hb


def test_batched_observations_expose_exactly_what_one_observe_each_does() -> None:
    rng = random.Random(7)
    values = [*BUCKETS, 0.0, 3.0, 100.0] + [rng.uniform(0, 3) for _ in range(500)] + [b * 0.999 for b in BUCKETS]
    direct, hd, batched, hb = pair()
    batch = ObservationBatch(hb.labels("m"), flush_every=64)
    child = hd.labels("m")
    for v in values:
        child.observe(v)
        batch.observe(v)
    assert exposition(direct)[0] != exposition(batched)[0]  # the last partial batch is not in yet
    batch.flush()
    batch.flush()  # nothing left: adds nothing
    (lines, total), (want_lines, want_total) = exposition(batched), exposition(direct)
    assert lines == want_lines and math.isclose(total, want_total, rel_tol=1e-12)


def test_nothing_reaches_the_histogram_before_a_flush() -> None:
    _, _, batched, hb = pair()
    batch = ObservationBatch(hb.labels("m"), flush_every=3)
    batch.observe(0.002)
    batch.observe(0.004)
    assert b'itl_seconds_count{model="m"} 0.0' in generate_latest(batched)
    batch.observe(0.3)  # the third: flushed by count
    text = generate_latest(batched)
    assert b'itl_seconds_count{model="m"} 3.0' in text and b'itl_seconds_bucket{le="0.0025",model="m"} 1.0' in text


def test_a_merged_chunk_counts_once_per_token() -> None:
    _, _, batched, hb = pair()
    batch = ObservationBatch(hb.labels("m"))
    batch.observe(0.002, 5)  # 5 tokens in one chunk, 2 ms apart on average
    batch.flush()
    text = generate_latest(batched).decode()
    assert 'itl_seconds_count{model="m"} 5.0' in text and 'itl_seconds_sum{model="m"} 0.01' in text

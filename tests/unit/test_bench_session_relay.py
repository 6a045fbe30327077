"""bench/session_relay.py on a tiny real run: both ways deliver every token of every stream, and the report reads.

Locks: each way is measured every round over a real grpc.aio session (the bench asserts every stream's token
count); the report gives both medians with their ranges and the relay's ratio to the iterator.
"""

from __future__ import annotations

import asyncio

from bench_support import load_bench


def test_a_tiny_run_measures_both_ways_and_reports_them() -> None:
    bench = load_bench("session_relay")
    res = asyncio.run(bench.measure(streams=3, tokens=5, rounds=2))
    assert set(res) == {"iterator", "relay"} and all(len(v) == 2 and min(v) > 0 for v in res.values())
    text = bench.report({"iterator": [20.0, 22.0], "relay": [18.0, 19.0]}, streams=3, tokens=5, rounds=2)
    assert text.startswith("## Session relay\n")
    assert "| 21.0 (20.0–22.0) | 1.00× |" in text and "| 18.5 (18.0–19.0) | 0.88× |" in text
    assert "The difference, 2.5 µs per chunk" in text

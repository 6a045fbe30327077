"""bench/session_carrier.py on a tiny real run: both carriers deliver every token of every stream, and the report reads.

Locks: each carrier is measured every round over a real server (a grpc.aio `GenerateSession` call and the same
`SessionServer` on its TCP session port; the bench asserts every stream's token count), for many streams and for
one; the report gives medians with ranges, items per message and the ratio to gRPC.
"""

from __future__ import annotations

import asyncio

from bench_support import load_bench


def test_a_tiny_run_measures_both_carriers_and_reports_them() -> None:
    bench = load_bench("session_carrier")
    res = asyncio.run(bench.measure(streams=3, tokens=5, rounds=2))
    assert set(res) == {("grpc", 3), ("tcp", 3), ("grpc", 1), ("tcp", 1)}
    assert all(len(v) == 2 and min(cpu for cpu, _ in v) > 0 for v in res.values())
    assert all(items >= 1 for v in res.values() for _, items in v)
    fake = {
        ("grpc", 3): [(30.0, 3.0), (34.0, 3.0)],
        ("tcp", 3): [(24.0, 3.0), (26.0, 2.0)],
        ("grpc", 1): [(400.0, 1.0), (420.0, 1.0)],
        ("tcp", 1): [(150.0, 1.0), (170.0, 1.0)],
    }
    text = bench.report(fake, streams=3, tokens=5, rounds=2)
    assert text.startswith("## Session carriers\n")
    assert "| 3 | gRPC `GenerateSession` call | 32.0 (30.0–34.0) | 3.0 | 1.00× |" in text
    assert "| 3 | TCP frames (`--session-port`) | 25.0 (24.0–26.0) | 2.5 | 0.78× |" in text
    assert "| 1 | TCP frames (`--session-port`) | 160.0 (150.0–170.0) | 1.0 | 0.39× |" in text

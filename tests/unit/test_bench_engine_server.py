"""bench/engine_server.py: systems take turns fairly, and its report judges each engine against its own server."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest
from bench_support import load_bench


def _row(ttft: float, itl: float, rps: float) -> dict[str, Any]:
    keys = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms")
    vals = (ttft, ttft, ttft, itl, itl, itl)
    return dict(zip(keys, vals, strict=True)) | {"itl_mean_ms": itl, "req_per_s": rps, "cpu_ms": {"p": 1.0}}


def test_each_engine_gets_its_own_section_with_targets_against_its_own_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks: meshllm ÷ the group's own server (llama.cpp's `server`, vLLM's `serve`), ≤ 1.03 met, above missed;
    req/s at c=4 ≥ 1.0, and ≥ 1.5 for llama.cpp's decode-heavy c=4 (where batching can win); a group of the
    other engine stays out of the section."""
    es = load_bench("engine_server")
    monkeypatch.setattr(es, "llama_cpp_build", lambda: "llama-cpp-python x")  # not llama_cpp itself in this process
    names = [w.name for w in es.WORKLOADS]
    server = {n: _row(100.0, 10.0, 1.0) for n in names}
    slow = {n: _row(104.0, 10.2, 1.1) for n in names}
    results = {
        "llama.cpp T=2": {"server": server, "run": slow},
        "vLLM": {"serve": server, "run": {n: _row(90.0, 12.0, 0.9) for n in names}},
    }
    args = argparse.Namespace(requests=5)
    llama = es.report("llama.cpp", results, args, "quiet machine")
    assert llama.startswith(es.HEADINGS["llama.cpp"]) and "vLLM |" not in llama
    assert "| llama.cpp T=2 | run | 1.04× **missed** | 1.04× **missed** | 1.02× met | 1.10× met | 1.10× **missed** |" in llama
    assert "llama.cpp T=2 run 1.02× (decode gains at most 3.92×)" in llama  # ITL 10.2 ÷ 10.0 in the batched case
    results["vLLM"]["serve"]["64 tokens, 256 out, c=4"]["cpu_ms"] = {"vllm serve": 900.0, "vllm serve front": 80.0}
    results["vLLM"]["run"]["64 tokens, 256 out, c=4"]["cpu_ms"] = {"meshllm run": 950.0, "meshllm run front": 120.0}
    vllm = es.report("vLLM", results, args, "quiet machine")
    assert "workload: vllm serve 80; meshllm run 120." in vllm
    assert "| vLLM | run | 0.90× met | 0.90× met | 1.20× **missed** | 0.90× **missed** | 0.90× **missed** |" in vllm
    assert load_bench("harness.stats").ratio(math.nan, 1.0) == "–"


def test_a_run_of_some_workloads_reports_only_those(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks: `--workloads prefix` gives a table and targets of that workload alone, with its request count."""
    es = load_bench("engine_server")
    monkeypatch.setattr(es, "llama_cpp_build", lambda: "llama-cpp-python x")
    prefix = next(w for w in es.WORKLOADS if w.key == "prefix")
    results = {"llama.cpp T=1": {"server": {prefix.name: _row(100.0, 10.0, 1.0)}, "split": {prefix.name: _row(95.0, 9.0, 1.0)}}}
    text = es.report("llama.cpp", results, argparse.Namespace(requests=5), "quiet machine")
    assert f"{prefix.name}: {5 * prefix.repeats} requests" in text
    assert "| group | system | TTFT p50 repeated prefix (≤ 1.03) |" in text
    assert "| llama.cpp T=1 | split | 0.95× met |" in text
    assert "300 tokens, c=1 |" not in text


def test_paired_ttft_compares_prompt_by_prompt_and_says_how_sure() -> None:
    """Locks: the median of per-prompt ratios, unmoved by a drift that slows both systems alike; its interval
    holds the true ratio, excludes 1.0 for a system 10 % slower on every prompt, and failed requests drop out."""
    stats = load_bench("harness.stats")  # bench/engine_server.py's paired comparison
    base = [100.0 * (1 + j / 10) for j in range(12)]  # the machine slows down over the run
    slower = [b * 1.10 for b in base]
    mid, lo, hi = stats.paired_ratio(slower, base)
    assert mid == pytest.approx(1.10) and lo == pytest.approx(1.10) and hi == pytest.approx(1.10)
    noisy = [b * (1.10 + (0.04 if j % 2 else -0.04)) for j, b in enumerate(base)]
    mid, lo, hi = stats.paired_ratio([*noisy, None], [*base, 100.0])
    assert 1.0 < lo <= mid <= hi and lo <= 1.10 <= hi
    assert all(math.isnan(x) for x in stats.paired_ratio([None], [1.0]))


def test_the_report_shows_paired_ttft_for_c1_workloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks: the report's prompt-by-prompt table has a cell per c=1 workload, from the rows' TTFT lists."""
    es = load_bench("engine_server")
    monkeypatch.setattr(es, "llama_cpp_build", lambda: "llama-cpp-python x")
    prefix = next(w for w in es.WORKLOADS if w.key == "prefix")
    server = _row(100.0, 10.0, 1.0) | {"ttfts": [0.1, 0.2, 0.3], "blocks": [1.0, 2.0, 3.0]}
    run = _row(95.0, 9.0, 1.0) | {"ttfts": [0.09, 0.18, 0.27], "blocks": [0.9, 1.8, 2.7]}
    results = {"llama.cpp T=1": {"server": {prefix.name: server}, "run": {prefix.name: run}}}
    text = es.report("llama.cpp", results, argparse.Namespace(requests=5), "quiet machine")
    assert "| llama.cpp T=1 | run | 0.900× (0.900–0.900) |" in text


def test_the_report_pairs_itl_at_c1_and_block_times_at_c4_as_rates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks: the 300-token c=1 workload also pairs each request's median ITL; a c=4 workload pairs its blocks as
    a rate (server time ÷ meshllm time: above 1 = meshllm serves faster)."""
    es = load_bench("engine_server")
    monkeypatch.setattr(es, "llama_cpp_build", lambda: "llama-cpp-python x")
    cold = next(w for w in es.WORKLOADS if w.key == "300")
    c4 = next(w for w in es.WORKLOADS if w.key == "c4")
    server = {
        cold.name: _row(100.0, 10.0, 1.0) | {"ttfts": [0.1, 0.1], "itls": [0.010, 0.020], "blocks": [1.0, 1.0]},
        c4.name: _row(100.0, 10.0, 1.0) | {"blocks": [4.0, 6.0]},
    }
    run = {
        cold.name: _row(100.0, 10.0, 1.0) | {"ttfts": [0.1, 0.1], "itls": [0.011, 0.022], "blocks": [1.0, 1.0]},
        c4.name: _row(100.0, 10.0, 1.0) | {"blocks": [2.0, 3.0]},
    }
    text = es.report("llama.cpp", {"llama.cpp T=2": {"server": server, "run": run}}, argparse.Namespace(requests=2), "q")
    head = "| TTFT, 300 tokens, c=1 | ITL (each request's median), 300 tokens, c=1 | req/s (per block of 4), 300 tokens, c=4 |"
    assert f"| group | system {head}" in text
    assert "| llama.cpp T=2 | run | 1.000× (1.000–1.000) | 1.100× (1.100–1.100) | 2.000× (2.000–2.000) |" in text

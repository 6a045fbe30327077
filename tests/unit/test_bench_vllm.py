"""bench/vllm_bench.py: its targets (issue 37) against vLLM's own server, round-robin and Dynamo + vLLM."""

from __future__ import annotations

from bench_support import load_bench


def _result(vb: object, ttft: float, itl: float, cached: int) -> object:
    r = vb.Result(ttft_ms=[ttft] * 4, itl_ms=[itl] * 4, prompt_tokens=100, cached_tokens=cached, seconds=2.0, requests=4)  # type: ignore[attr-defined]
    r.cpu_ms = {"p": 1.0}
    return r


def _rows(vb: object, ttft: float, itl: float, cached: int) -> dict[tuple[str, int], object]:
    return {w: _result(vb, ttft, itl, cached) for w in vb.WORKLOADS}  # type: ignore[attr-defined]


def test_kv_is_judged_against_round_robin_and_dynamo_and_the_report_says_which_ran() -> None:
    vb = load_bench("vllm_bench")
    results = {
        "serve": _rows(vb, 100.0, 10.0, 0),
        "run": _rows(vb, 102.0, 10.3, 0),
        "split-2 kv": _rows(vb, 90.0, 10.0, 60),
        "split-2 rr": _rows(vb, 95.0, 10.0, 30),
        "dynamo-2 kv": _rows(vb, 90.0, 10.0, 70),
    }
    text = vb.report(results, "quiet machine")
    assert "TTFT p50 1.020× (target ≤ 1.03: met), ITL p50 1.030× (target ≤ 1.02: **missed**)" in text
    assert "cached-token ratio kv 0.60 vs round-robin 0.30 (2.00×; target ≥ 1.5: met)" in text
    assert "Dynamo + vLLM 0.70 (target kv ≥ it: **missed**)" in text
    assert "TTFT p90 kv 90.0 vs rr 95.0 ms (target ≤: met)" in text
    assert "`dynamo-2 kv` = Dynamo 1.6.1" in text
    assert "Why c=4 falls short" not in text  # 0.60 ≥ 1.5 × 0.30: nothing to explain
    results["split-2 kv"] = _rows(vb, 90.0, 10.0, 40)
    assert "Dynamo's KV router, on the same load, cached 0.70." in vb.report(results, "quiet machine")
    del results["dynamo-2 kv"]
    text = vb.report(results, "quiet machine")
    assert "against Dynamo: not run" in text and "Dynamo + vLLM did not run here" in text


def test_each_row_shows_sse_events_per_response() -> None:
    """Locks: the mean number of SSE events with text per recorded response, beside each row's figures."""
    vb = load_bench("vllm_bench")
    rows = _rows(vb, 100.0, 10.0, 0)
    for r in rows.values():
        r.events = 4 * 31  # type: ignore[attr-defined]
    text = vb.report({"serve": rows}, "quiet machine")
    assert "SSE events per response" in text
    assert "| 2.000 | 31.0 | 0.00 | p 1 |" in text

"""bench/llamacpp_batch.py: the gain of n sequences per step over one at a time, and its report."""

from __future__ import annotations

import pytest
from bench_support import load_bench


def test_the_gain_is_n_single_steps_over_one_batched_step() -> None:
    lb = load_bench("llamacpp_batch")
    assert lb.gain(4, 10.0, 40.0) == pytest.approx(1.0)
    assert lb.gain(4, 10.0, 20.0) == pytest.approx(2.0)
    assert lb.gain(4, 10.0, 50.0) < 1.0  # a batched step dearer than its single steps loses


def test_the_report_gives_each_level_its_medians_ranges_and_gain(monkeypatch: pytest.MonkeyPatch) -> None:
    lb = load_bench("llamacpp_batch")
    monkeypatch.setattr(lb, "llama_cpp_build", lambda: "llama-cpp-python x")
    results = {(2, "bare"): {1: [10.0, 12.0, 11.0], 4: [30.0, 33.0, 36.0]}, (2, "engine"): {1: [11.0], 4: [44.0]}}
    text = lb.report(results, 4, 3, "quiet machine")
    assert text.startswith(lb.HEADING)
    assert "| 2 | bare | 11.0 (10.0–12.0) | 33.0 (30.0–36.0) | 3.00 | 1.33× |" in text
    assert "| 2 | engine | 11.0 (11.0–11.0) | 44.0 (44.0–44.0) | 4.00 | 1.00× |" in text
    assert "at most 2.67× a single one" in text

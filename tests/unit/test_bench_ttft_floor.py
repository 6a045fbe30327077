"""bench/ttft_floor.py: a tiny real run (a real grpc.aio server process, the real SmolLM2 tokenizer) and its report."""

from __future__ import annotations

import pytest
from bench_support import load_bench as load
from bench_support import needs_model

pytestmark = pytest.mark.usefixtures("bench_cache")  # tests/unit/conftest.py


@needs_model
def test_a_run_times_each_part_of_every_counted_request_and_sums_them() -> None:
    floor = load("ttft_floor")
    times, tokens = floor.run(3, 3, seed=1)  # blocks of 3, the first 2 not counted: 3 rounds for 3 each
    assert list(times) == [label for label, _, _ in floor.KINDS]
    for row in times.values():
        assert all(len(row[p]) == 3 for p in floor.PARTS)
        assert all(v > 0 for p in floor.PARTS for v in row[p])  # one-way hops on one clock: never negative
        for enc, h1, h2, total in zip(*(row[p] for p in floor.PARTS), strict=True):
            assert total == pytest.approx(enc + h1 + h2)
    assert 400 < tokens < 800  # bench/mesh.py's ~600-token prompts, template included


def test_the_report_names_its_run_and_states_the_idle_sum() -> None:
    floor = load("ttft_floor")
    times = {
        label: {p: [0.1 * (i + 1) * (j + 1)] * 3 for j, p in enumerate(floor.PARTS)}
        for i, (label, _, _) in enumerate(floor.KINDS)
    }
    text = floor.render(times, 631.2, 3, 20, [0.4])
    assert text.startswith(floor.SECTION + "\n")
    assert "--requests 3 --block 20" in text and "631 tokens" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "/" in line]
    assert len(rows) == 2 and rows[1].startswith("| as at concurrency 1")
    assert "0.80 ms" in text  # the idle row's sum at p50 (0.2 × 4), stated under the table

"""bench/mesh_load.py `engines_alone`: the mockers driven in-process, closed loop, for bench/mesh.py's engines row.

Locks, on small real runs (built-in tokenizer and chat template, real mockers): every request streams exactly its
output length; the row has `meshllm bench`'s keys with ordered percentiles; the engines' busy fraction is that of
their simulated steps over the measured time (none at speedup 0); concurrency 1 is the overhead baseline's shape.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from types import ModuleType

import pytest
from bench_support import load_bench as load

TOKENIZER = Path("builtin:mocker")


@pytest.fixture(scope="module")
def mesh_load() -> ModuleType:
    return load("mesh_load")


def _small_load(mesh_load: ModuleType) -> object:
    return mesh_load.Load(isl=40, isl_spread=10, osl=6, osl_spread=0, chars_per_token=1.0)


def test_engines_alone_streams_every_token_and_reports_like_meshllm_bench(mesh_load: ModuleType) -> None:
    row = asyncio.run(
        mesh_load.engines_alone(
            TOKENIZER, _small_load(mesh_load), speedup=1000.0, engines=2, concurrency=4, requests=12, warmup=2, seed=3
        )
    )
    assert row["requests"] == 12 and row["errors"] == 0
    assert row["mean_osl"] == 6.0  # ignore_eos: each request streams exactly its max_tokens
    assert 1.0 <= row["events_per_request"] <= 6.0
    assert row["mean_isl"] > 40  # the chat template's tokens come on top of the ~40-token message
    assert row["req_per_s"] > 0 and row["output_tok_per_s"] == pytest.approx(row["req_per_s"] * 6.0)
    for what in ("ttft", "itl"):
        assert 0 <= row[f"{what}_p50_ms"] <= row[f"{what}_p90_ms"] <= row[f"{what}_p99_ms"]
    assert 0 < row["model_busy"] <= 1.2  # simulated step time over wall time, per engine
    assert row["cpu_ms_per_request"] > 0


def test_no_simulated_time_means_no_busy_fraction(mesh_load: ModuleType) -> None:
    row = asyncio.run(
        mesh_load.engines_alone(
            TOKENIZER, _small_load(mesh_load), speedup=0.0, engines=1, concurrency=2, requests=4, warmup=0, seed=4
        )
    )
    assert row["mean_osl"] == 6.0
    assert math.isnan(row["model_busy"])


def test_engine_alone_is_one_engine_at_speedup_1_one_request_at_a_time(mesh_load: ModuleType) -> None:
    row = asyncio.run(mesh_load.engine_alone(TOKENIZER, _small_load(mesh_load), 2, 1, 5))
    assert row["requests"] == 2 and row["mean_osl"] == 6.0
    # One request alone on an idle mocker: its first token comes after the prefill step (≥ 16.5 ms at speedup 1).
    assert row["ttft_p50_ms"] >= 16.0
    assert row["model_busy"] > 0.5

"""meshllm.engine.mocker.timing and the step loop's use of it: prefill, decode and transfer times."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import cast

import pytest

from meshllm.engine.base import Context
from meshllm.engine.mocker import MockerConfig, MockerEngine, StepReport
from meshllm.engine.mocker.timing import decode_ms, prefill_ms, step_ms, transfer_seconds
from meshllm.protocol.types import GenerateChunk


def test_prefill_time_is_the_quadratic_of_the_new_tokens_and_free_when_all_cached() -> None:
    """Locks: prefill ms = 4.209989e-7·T² + 1.518344e-2·T + 16.50142; T = 0 costs nothing."""
    assert prefill_ms(1000) == pytest.approx(32.1058589)
    assert prefill_ms(8192) == pytest.approx(4.209989e-7 * 8192**2 + 1.518344e-2 * 8192 + 16.50142)
    assert prefill_ms(0) == 0.0


def test_decode_time_rises_with_kv_usage_along_the_fitted_curve() -> None:
    """Locks: decode ms = −25.74·p² + 54.01·p + 5.74, increasing over 0..1 and clamped outside it."""
    assert decode_ms(0.0) == pytest.approx(5.74)
    assert decode_ms(0.5) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    assert decode_ms(1.0) == pytest.approx(34.01)
    curve = [decode_ms(p / 10) for p in range(11)]
    assert curve == sorted(curve)
    assert decode_ms(1.5) == decode_ms(1.0) and decode_ms(-1) == decode_ms(0.0)


def test_a_mixed_step_costs_prefill_plus_decode() -> None:
    """Locks: the documented choice for steps that carry both prefill chunks and decodes."""
    assert step_ms(500, True, 0.3) == pytest.approx(prefill_ms(500) + decode_ms(0.3))
    assert step_ms(500, False, 0.3) == pytest.approx(prefill_ms(500))
    assert step_ms(0, True, 0.3) == pytest.approx(decode_ms(0.3))


def test_transfer_time_is_bytes_over_bandwidth_divided_by_speedup() -> None:
    """Locks: tokens·bytes_per_token / (GB/s·1e9) / speedup; 0 bandwidth or speedup 0 = instant."""
    assert transfer_seconds(1000, 131072, 25.0, 1.0) == pytest.approx(1000 * 131072 / 25e9)
    assert transfer_seconds(1000, 131072, 25.0, 10.0) == pytest.approx(1000 * 131072 / 25e10)
    assert transfer_seconds(1000, 131072, 0.0, 1.0) == 0.0
    assert transfer_seconds(1000, 131072, 25.0, 0.0) == 0.0


async def test_decode_steps_are_charged_by_the_kv_usage_they_run_at() -> None:
    """Locks: each decode-only step's model time is decode_ms(fraction of blocks in use at that step)."""
    engine = MockerEngine(MockerConfig(speedup_ratio=0.0, num_gpu_blocks=256, block_size=4, context_length=512))
    steps: list[StepReport] = []
    engine.on_step = steps.append
    await engine.start("w")

    async def one(i: int) -> None:
        request = {"request_id": f"r{i}", "token_ids": [i] * 40 * (i + 1), "stop": {"max_tokens": 30, "ignore_eos": True}}
        async for _ in engine.generate(request, Context(f"r{i}")):  # type: ignore[arg-type]
            pass

    await asyncio.gather(*(one(i) for i in range(4)))
    await engine.cleanup()
    decode_only = [s for s in steps if s.prefill_tokens == 0]
    assert len({s.kv_usage for s in decode_only}) > 3
    assert all(s.model_ms == pytest.approx(decode_ms(s.kv_usage)) for s in decode_only)
    mixed = [s for s in steps if s.prefill_tokens and s.decode_seqs]
    assert all(s.model_ms == pytest.approx(prefill_ms(s.prefill_tokens) + decode_ms(s.kv_usage)) for s in mixed)


async def test_ttft_of_a_1000_token_prompt_on_an_idle_mocker_matches_the_formula() -> None:
    """Locks: at speedup 1 the first token arrives after prefill_ms(1000) ≈ 32.1 ms (within 10 %).

    A busy machine can only delay a step, never shorten it, so every run must
    be at least the formula and the best of up to five runs within 10 % of it.
    """
    engine = MockerEngine(MockerConfig(speedup_ratio=1.0))
    await engine.start("w")
    loop = asyncio.get_running_loop()
    expected = prefill_ms(1000)
    ttfts: list[float] = []
    for run in range(5):
        request = {"request_id": f"t{run}", "token_ids": [run + 5] * 1000, "stop": {"max_tokens": 1}}
        t0 = loop.time()
        stream = cast(AsyncGenerator[GenerateChunk, None], engine.generate(request, Context(f"t{run}")))  # type: ignore[arg-type]
        first = await anext(stream)
        ttfts.append((loop.time() - t0) * 1000)
        assert first["token_ids"]
        await stream.aclose()
        if ttfts[-1] <= expected * 1.1:
            break
    await engine.cleanup()
    assert min(ttfts) >= expected * 0.999
    assert min(ttfts) == pytest.approx(expected, rel=0.10)

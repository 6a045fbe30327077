"""meshllm.engine.mocker.timing and the step loop's use of it: prefill, decode and transfer times."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import cast

import pytest

from meshllm.engine.base import Context
from meshllm.engine.mocker import MockerConfig, MockerEngine, StepReport
from meshllm.engine.mocker.timing import StepPacer, decode_ms, prefill_ms, step_ms, transfer_seconds
from meshllm.protocol.types import TokenChunk


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
        stream = cast(AsyncGenerator[TokenChunk, None], engine.generate(request, Context(f"t{run}")))  # type: ignore[arg-type]
        first = await anext(stream)
        ttfts.append((loop.time() - t0) * 1000)
        assert first["token_ids"]
        await stream.aclose()
        if ttfts[-1] <= expected * 1.1:
            break
    await engine.cleanup()
    assert min(ttfts) >= expected * 0.999
    assert min(ttfts) == pytest.approx(expected, rel=0.10)


def _run_steps(pacer: StepPacer, steps: int, step_s: float, compute_s: float, overshoot_s: float, t0: float = 0.0) -> float:
    """Drive `steps` back-to-back steps on a simulated clock whose every wait ends `overshoot_s` late; returns the end."""
    now = t0
    for _ in range(steps):
        started = now
        now += compute_s
        now = max(now, pacer.step_end(started, step_s)) + overshoot_s
    return now


def test_busy_steps_follow_the_model_whatever_the_timer_overshoot() -> None:
    """A timer waking 0.6 ms late on every 0.76 ms step adds one overshoot in total, not one per step."""
    end = _run_steps(StepPacer(), steps=1000, step_s=0.00076, compute_s=0.0001, overshoot_s=0.0006)
    assert end == pytest.approx(1000 * 0.00076 + 0.0006, abs=1e-9)


def test_without_the_pacer_the_overshoot_accumulates() -> None:
    """The rule the pacer replaced (wait from each step's start) loses the overshoot every step: what it fixes."""
    now = 0.0
    for _ in range(1000):
        now = max(now + 0.0001, now + 0.00076) + 0.0006
    assert now > 1000 * 0.00076 * 1.7


def test_a_step_slower_to_compute_than_its_model_is_not_waited_for() -> None:
    """Compute longer than the model's step: no wait, and no credit carried past `max_lag_s` (no catch-up burst)."""
    pacer = StepPacer(max_lag_s=0.005)
    now = 0.0
    for _ in range(100):
        end = pacer.step_end(now, 0.0001)
        assert end <= now + 0.0001
        now += 0.001  # every step computes for 1 ms
    assert now - pacer.step_end(now, 0.0001) < 0.005  # the timeline restarted instead of drifting behind


def test_after_idle_or_a_stall_the_timeline_restarts_at_the_present() -> None:
    pacer = StepPacer(max_lag_s=0.005)
    assert pacer.step_end(0.0, 0.001) == pytest.approx(0.001)
    assert pacer.step_end(0.5, 0.001) == pytest.approx(0.501)  # 499 ms late: a stall, not a timer
    pacer.idle()
    assert pacer.step_end(0.5015, 0.001) == pytest.approx(0.5025)  # idle: not started at the old due time


def test_a_step_never_starts_before_the_previous_one_ends() -> None:
    pacer = StepPacer()
    first = pacer.step_end(1.0, 0.002)
    assert pacer.step_end(1.001, 0.002) == pytest.approx(first + 0.002)  # woke early: still after the first

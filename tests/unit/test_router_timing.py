"""The router's measured worker times: step time per worker, prefill time per block, and the wait they give."""

from __future__ import annotations

import pytest

from meshllm.router.policy.timing import BUSY_STEPS, PrefillFit, WorkerTimes, wait_blocks


def test_the_prefill_fit_finds_the_time_per_token_of_idle_legs() -> None:
    fit = PrefillFit()
    for tokens in (16, 1040, 16, 528, 1040, 16):
        fit.add(tokens, 20.0 + 0.015 * tokens)  # 20 ms overhead + 15 µs a token
    assert fit.ms_per_token == pytest.approx(0.015)
    assert fit.fixed_ms == pytest.approx(20.0)  # the intercept: a step's fixed time


def test_the_prefill_time_is_unknown_until_enough_lengths_were_seen() -> None:
    fit = PrefillFit()
    for _ in range(3):
        fit.add(1000, 40.0)
    assert fit.ms_per_token == 0.0  # too few samples
    for _ in range(10):
        fit.add(1000, 40.0)
    assert fit.ms_per_token == 0.0  # one length: no slope
    noisy = PrefillFit()
    for tokens, ms in ((16, 30.0), (1040, 20.0), (16, 30.0), (1040, 20.0)):
        noisy.add(tokens, ms)
    assert noisy.ms_per_token == 0.0  # a negative slope is noise, not a time
    assert fit.fixed_ms == 0.0 and noisy.fixed_ms == 0.0  # no slope, no intercept either


def test_worker_times_keep_a_moving_step_time_per_slot_and_a_prefill_fit_per_model() -> None:
    t = WorkerTimes()
    assert t.step_ms(("a", 0)) == 0.0 and t.block_ms("m", 16) == 0.0
    t.step(("a", 0), 20.0)
    t.step(("a", 0), 30.0)
    assert t.step_ms(("a", 0)) == pytest.approx(22.0)  # 20 + 0.2 × (30 − 20)
    for tokens in (16, 1040, 16, 1040):
        t.prefill("m", tokens, 10.0 + 0.02 * tokens)
    assert t.block_ms("m", 16) == pytest.approx(0.32)
    assert t.fixed_ms("m") == pytest.approx(10.0)
    assert t.block_ms("other", 16) == 0.0 and t.fixed_ms("other") == 0.0
    t.remove_worker("a")
    assert t.step_ms(("a", 0)) == 0.0


def test_the_wait_is_one_and_a_half_steps_in_prefill_blocks_on_a_busy_worker_only() -> None:
    assert wait_blocks(2, 25.0, 0.25) == pytest.approx(BUSY_STEPS * 100) == pytest.approx(150)
    assert wait_blocks(0, 25.0, 0.25) == 0.0  # idle: nothing to wait for
    assert wait_blocks(1, 0.0, 0.25) == 0.0 and wait_blocks(1, 25.0, 0.0) == 0.0  # not measured yet


def test_a_request_waiting_for_its_first_token_adds_the_fixed_time_of_its_prefill_step() -> None:
    busy = wait_blocks(2, 25.0, 0.25)
    assert wait_blocks(2, 25.0, 0.25, prefilling=1, fixed_ms=20.0) == pytest.approx(busy + 80)  # 20 ms / 0.25
    assert wait_blocks(2, 25.0, 0.25, prefilling=2, fixed_ms=20.0) == pytest.approx(busy + 80)  # one step, batched
    assert wait_blocks(2, 25.0, 0.25, prefilling=0, fixed_ms=20.0) == pytest.approx(busy)  # all decoding
    assert wait_blocks(1, 0.0, 0.25, prefilling=1, fixed_ms=20.0) == pytest.approx(80)  # step time not measured yet
    assert wait_blocks(0, 25.0, 0.25, prefilling=0, fixed_ms=20.0) == 0.0  # idle
    assert wait_blocks(1, 25.0, 0.0, prefilling=1, fixed_ms=20.0) == 0.0  # no prefill time per block: no unit

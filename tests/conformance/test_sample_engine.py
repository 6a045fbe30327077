"""The `sample` engine's own behaviour beyond the kit: roles, EOS, min_tokens, flags, early stop."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from meshllm.engine.base import Context, DisaggregationMode, TokenChunk, TokenRequest
from meshllm.engine.sample import SampleEngine
from meshllm.errors import InvalidArgument
from meshllm.testing.conformance import RecordingSink


async def run(engine: SampleEngine, token_ids: list[int], **fields: Any) -> list[TokenChunk]:
    request: TokenRequest = {"request_id": "r", "token_ids": token_ids, **fields}  # type: ignore[typeddict-item]
    return [chunk async for chunk in engine.generate(request, Context("r"))]


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.get("token_ids", [])]


async def test_tokens_rotate_from_the_last_prompt_token_and_stop_at_max_tokens() -> None:
    """Locks: output i is (last prompt token + 1 + i) % vocab; the default max_tokens is 16."""
    engine = SampleEngine(vocab_size=10)
    out = await run(engine, [3, 8], stop={"max_tokens": 4})
    assert tokens(out) == [9, 0, 1, 2]
    assert out[-1]["finish_reason"] == "length"
    assert len(tokens(await run(engine, [1]))) == 16


async def test_prefill_then_decode_equals_the_aggregated_output() -> None:
    """Locks: context_only answers the first token and a kv handle; generation_only continues after it."""
    engine = SampleEngine()
    stop = {"max_tokens": 6}
    aggregated = await run(engine, [5, 6, 7], stop=stop)
    (prefill,) = await run(engine, [5, 6, 7], stop=stop, disagg={"request_type": "context_only"})
    assert prefill["finish_reason"] == "length"
    disagg = prefill["disagg"]
    assert disagg["first_token_ids"] == prefill["token_ids"] == tokens(aggregated)[:1]
    assert isinstance(disagg["kv_handle"], bytes) and disagg["kv_handle"]
    decode = await run(engine, [5, 6, 7], stop=stop, disagg={**disagg, "request_type": "generation_only"})
    assert prefill["token_ids"] + tokens(decode) == tokens(aggregated)
    assert decode[-1]["finish_reason"] == aggregated[-1]["finish_reason"] == "length"
    assert decode[-1]["usage"] == aggregated[-1]["usage"]  # the decode leg reports the whole completion


async def test_a_decode_leg_without_first_tokens_or_a_zero_max_tokens_is_invalid() -> None:
    with pytest.raises(InvalidArgument):
        await run(SampleEngine(), [1], disagg={"request_type": "generation_only"})
    with pytest.raises(InvalidArgument):
        await run(SampleEngine(), [1], stop={"max_tokens": 0})


async def test_eos_ends_the_stream_unless_ignored_and_not_before_min_tokens() -> None:
    """Locks: an EOS token is emitted with "eos"; ignore_eos and min_tokens suppress it."""
    engine = SampleEngine()
    out = await run(engine, [1], eos_token_ids=[3], stop={"max_tokens": 8})
    assert tokens(out) == [2, 3] and out[-1]["finish_reason"] == "eos"
    out = await run(engine, [1], eos_token_ids=[3], stop={"max_tokens": 4, "ignore_eos": True})
    assert tokens(out) == [2, 3, 4, 5] and out[-1]["finish_reason"] == "length"
    out = await run(engine, [1], eos_token_ids=[2], stop={"max_tokens": 3, "min_tokens": 1})
    assert tokens(out) == [2, 3, 4] and out[-1]["finish_reason"] == "length"


async def test_a_stop_token_is_not_emitted_and_names_the_stop_reason() -> None:
    out = await run(SampleEngine(), [1], stop={"max_tokens": 8, "stop_token_ids": [4]})
    assert tokens(out) == [2, 3]
    assert out[-1]["finish_reason"] == "stop" and out[-1]["stop_reason"] == "4"
    assert out[-1]["usage"]["completion_tokens"] == 2


async def test_from_args_builds_the_engine_and_a_worker_config() -> None:
    """Locks: sample flags plus the common worker flags; --model-name names the model."""
    engine, config = await SampleEngine.from_args(["--token-delay-ms", "5", "--model-name", "toy", "--role", "decode"])
    assert engine.token_delay_s == pytest.approx(0.005)
    assert config.engine == "sample" and config.role is DisaggregationMode.DECODE
    assert (await engine.start("w")).model == "toy"
    default, _ = await SampleEngine.from_args([])
    assert (await default.start("w")).model == "sample" and default.token_delay_s == 0


async def test_stop_wakes_a_stream_that_waits_for_its_next_token() -> None:
    """Locks: with a long per-token delay, stop() ends a waiting stream at once with "cancelled"."""
    engine = SampleEngine(token_delay_ms=600_000)
    engine.sink = sink = RecordingSink()
    running = asyncio.Event()
    sink.load = lambda metrics: running.set() if metrics.running else None  # type: ignore[method-assign]
    context = Context("slow")
    stream = engine.generate({"request_id": "slow", "token_ids": [1]}, context)
    pending = asyncio.ensure_future(anext(stream))
    await running.wait()  # admitted: the stream now waits out its first token's delay
    assert not pending.done()
    context.stop()
    chunk = await asyncio.wait_for(pending, 5)
    assert chunk["finish_reason"] == "cancelled" and chunk["usage"]["completion_tokens"] == 0
    await stream.aclose()  # type: ignore[attr-defined]


async def test_cleanup_is_safe_without_start_twice_and_concurrently() -> None:
    engine = SampleEngine()
    await asyncio.gather(engine.cleanup(), engine.cleanup())
    await engine.cleanup()

"""meshllm.engine.mocker.engine: the mocker behind the LLMEngine contract, driven directly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any, cast

import pytest

from meshllm.config import ConfigError
from meshllm.engine.base import Context, LoadMetrics
from meshllm.engine.mocker import MockerConfig, MockerEngine, StepReport
from meshllm.engine.mocker.handle import KvHandle, decode_kv_handle, encode_kv_handle
from meshllm.errors import ContextLengthExceeded, EngineShutdown, FailedPrecondition, InvalidArgument, Unknown
from meshllm.protocol.kv import block_hashes, stored_blocks
from meshllm.protocol.types import TokenChunk, TokenRequest


class RecordingSink:
    """An EngineSink that records every call and lets a test await a load condition."""

    def __init__(self) -> None:
        self.stored: list[tuple[list[tuple[int, int]], int | None]] = []
        self.removed: list[int] = []
        self.cleared = 0
        self.loads: list[LoadMetrics] = []
        self.load_times: list[float] = []
        self._changed = asyncio.Event()

    def blocks_stored(self, blocks: Seq[tuple[int, int]], parent_hash: int | None, dp_rank: int = 0) -> None:
        self.stored.append((list(blocks), parent_hash))

    def blocks_removed(self, block_hashes: Seq[int], dp_rank: int = 0) -> None:
        self.removed.extend(block_hashes)

    def all_cleared(self, dp_rank: int = 0) -> None:
        self.cleared += 1

    def load(self, metrics: LoadMetrics) -> None:
        self.loads.append(metrics)
        self.load_times.append(asyncio.get_running_loop().time())
        self._changed.set()

    def stored_hashes(self) -> list[int]:
        return [bh for blocks, _ in self.stored for bh, _ in blocks]

    async def until_load(self, pred: Callable[[LoadMetrics], bool]) -> LoadMetrics:
        async with asyncio.timeout(5):
            while not (self.loads and pred(self.loads[-1])):
                self._changed.clear()
                await self._changed.wait()
        return self.loads[-1]


FAST = MockerConfig(speedup_ratio=0.0)


async def started(config: MockerConfig = FAST, **changes: Any) -> tuple[MockerEngine, RecordingSink, list[StepReport]]:
    engine = MockerEngine(replace(config, **changes))
    sink = RecordingSink()
    engine.sink = sink
    steps: list[StepReport] = []
    engine.on_step = steps.append
    await engine.start("w1")
    return engine, sink, steps


@pytest.fixture
async def mocker() -> AsyncIterator[tuple[MockerEngine, RecordingSink, list[StepReport]]]:
    engine, sink, steps = await started()
    yield engine, sink, steps
    await engine.cleanup()


def req(prompt: list[int], rid: str = "r", **stop: Any) -> TokenRequest:
    return {"request_id": rid, "token_ids": prompt, "stop": stop}  # type: ignore[typeddict-item]


def stream(engine: MockerEngine, request: TokenRequest, ctx: Context) -> AsyncGenerator[TokenChunk, None]:
    return cast(AsyncGenerator[TokenChunk, None], engine.generate(request, ctx))


async def run(engine: MockerEngine, request: TokenRequest) -> tuple[list[int], TokenChunk]:
    """All emitted tokens and the terminal chunk; checks nothing follows the terminal."""
    tokens: list[int] = []
    chunks = [c async for c in engine.generate(request, Context(request["request_id"]))]
    for c in chunks:
        tokens.extend(c.get("token_ids", []))
    assert "finish_reason" in chunks[-1] and all("finish_reason" not in c for c in chunks[:-1])
    return tokens, chunks[-1]


PROMPT = list(range(1000, 1200))


# ------------------------------------------------------------------ prefix caching and events


@pytest.mark.parametrize(("prompt_len", "tail", "cached"), [(200, 8, 192), (192, 16, 176)])
async def test_a_second_identical_prompt_is_charged_only_its_uncached_tail(prompt_len: int, tail: int, cached: int) -> None:
    """Locks: cached prefix tokens cost no prefill; exactly one BlocksStored per newly computed block; usage shows the hit."""
    engine, sink, steps = await started(block_size=16)
    prompt = PROMPT[:prompt_len]
    _, first = await run(engine, req(prompt, "a", max_tokens=4))
    charged_first = sum(s.prefill_tokens for s in steps)
    steps.clear()
    _, second = await run(engine, req(prompt, "b", max_tokens=4))
    assert charged_first == prompt_len and sum(s.prefill_tokens for s in steps) == tail
    assert first["usage"]["cached_tokens"] == 0 and second["usage"]["cached_tokens"] == cached
    assert sink.stored_hashes() == [bh for bh, _ in stored_blocks(prompt, 16)]
    await engine.cleanup()


async def test_filling_the_cache_evicts_in_lru_order_and_an_evicted_prefix_is_recomputed() -> None:
    """Locks: BlocksRemoved in least-recently-released order; a later hit on an evicted prefix recomputes it."""
    engine, sink, steps = await started(num_gpu_blocks=8, block_size=4, watermark=0.0, context_length=32)
    a, b, c = list(range(12)), list(range(100, 112)), list(range(200, 216))
    ha, hb = block_hashes(a, 4), block_hashes(b, 4)
    for i, prompt in enumerate((a, b, c)):
        await run(engine, req(prompt, f"r{i}", max_tokens=1))
    assert sink.removed == [ha[2], ha[1]]  # 2 free blocks, then a's tail first
    steps.clear()
    sink.stored.clear()
    _, again = await run(engine, req(a, "again", max_tokens=1))
    assert again["usage"]["cached_tokens"] == 4 and sum(s.prefill_tokens for s in steps) == 8
    assert sink.stored == [(stored_blocks(a, 4)[1:], ha[0])]
    assert sink.removed[2:] == [hb[2], hb[1]]
    await engine.cleanup()


async def test_clear_kv_blocks_drops_the_cache_and_reports_all_cleared(mocker: Any) -> None:
    """Locks: ClearKvBlocks returns the dropped count and the next identical prompt hits nothing."""
    engine, sink, _ = mocker
    await run(engine, req(PROMPT, "a", max_tokens=1))
    assert await engine.clear_kv_blocks() == 3  # 200 tokens = 3 full blocks of 64
    assert sink.cleared == 1
    _, again = await run(engine, req(PROMPT, "b", max_tokens=1))
    assert again["usage"]["cached_tokens"] == 0


# ------------------------------------------------------------------ batching, preemption


async def test_300_concurrent_requests_run_256_at_a_time_and_all_complete(mocker: Any) -> None:
    """Locks: max-num-seqs 256 leaves 44 waiting; every request gets exactly max_tokens tokens."""
    engine, _, steps = mocker
    requests = [req([i, i + 1, i + 2], f"r{i}", max_tokens=20, ignore_eos=True) for i in range(300)]
    results = await asyncio.gather(*(run(engine, r) for r in requests))
    assert (steps[0].running, steps[0].waiting) == (256, 44)
    assert max(s.running for s in steps) == 256
    assert all(len(toks) == 20 and end["finish_reason"] == "length" for toks, end in results)
    assert all(end["usage"]["completion_tokens"] == 20 for _, end in results)
    assert engine.blocks.num_used == 0


async def test_too_few_blocks_preempt_without_losing_or_changing_any_request() -> None:
    """Locks: preemption by recompute under KV pressure; outputs equal an unconstrained run."""
    requests = [req([i] * 8, f"r{i}", max_tokens=40, ignore_eos=True) for i in range(20)]
    tight, _, _ = await started(num_gpu_blocks=24, block_size=4, watermark=0.0, context_length=64)
    roomy, _, _ = await started()
    got = await asyncio.gather(*(run(tight, r) for r in requests))
    want = await asyncio.gather(*(run(roomy, r) for r in requests))
    assert tight.scheduler.num_preemptions > 0
    assert [t for t, _ in got] == [t for t, _ in want] and all(len(t) == 40 for t, _ in got)
    assert tight.blocks.num_used == 0
    await tight.cleanup()
    await roomy.cleanup()


# ------------------------------------------------------------------ output rules


async def test_the_same_request_gives_the_same_tokens_and_the_seed_changes_them(mocker: Any) -> None:
    """Locks: determinism (seeded by sampling.seed, else by the prompt)."""
    engine, _, _ = mocker
    one, _ = await run(engine, req(PROMPT, "a", max_tokens=30, ignore_eos=True))
    two, _ = await run(engine, req(PROMPT, "b", max_tokens=30, ignore_eos=True))
    seeded: TokenRequest = {**req(PROMPT, "c", max_tokens=30, ignore_eos=True), "sampling": {"seed": 7}}
    three, _ = await run(engine, seeded)
    four, _ = await run(engine, {**seeded, "request_id": "d"})
    assert one == two and three == four and one != three
    assert all(0 <= t < 32000 for t in one)


async def test_a_stop_token_ends_the_stream_without_being_emitted_unless_below_min_tokens(mocker: Any) -> None:
    """Locks: stop_token_ids → "stop" (token not emitted); min_tokens masks stop tokens until reached."""
    engine, _, _ = mocker
    ref, _ = await run(engine, req(PROMPT, "ref", max_tokens=60, ignore_eos=True))
    i = next(k for k in range(5, 60) if ref[k] not in ref[:k])
    toks, end = await run(engine, req(PROMPT, "s", max_tokens=60, ignore_eos=True, stop_token_ids=[ref[i]]))
    assert toks == ref[:i] and end["finish_reason"] == "stop" and end["usage"]["completion_tokens"] == i
    toks, end = await run(engine, req(PROMPT, "m", max_tokens=60, ignore_eos=True, stop_token_ids=[ref[i]], min_tokens=i + 2))
    assert toks[:i] == ref[:i] and toks[i] == (ref[i] + 1) % 32000 and len(toks) >= i + 2


async def test_eos_ends_the_stream_unless_ignore_eos_and_never_before_min_tokens() -> None:
    """Locks: EOS (emitted) → "eos"; ignore_eos runs to max_tokens; request eos ids override the engine's."""
    engine, _, _ = await started(vocab_size=4, eos_token_id=2)
    toks, end = await run(engine, req(PROMPT, "e", max_tokens=50))
    assert end["finish_reason"] == "eos" and toks[-1] == 2 and 2 not in toks[:-1]
    toks, end = await run(engine, req(PROMPT, "i", max_tokens=50, ignore_eos=True))
    assert end["finish_reason"] == "length" and len(toks) == 50 and 2 in toks
    toks, end = await run(engine, req(PROMPT, "m", max_tokens=50, min_tokens=10))
    assert len(toks) >= 10 and 2 not in toks[:9]
    custom: TokenRequest = {**req(PROMPT, "c", max_tokens=50), "eos_token_ids": [3]}
    toks, end = await run(engine, custom)
    assert end["finish_reason"] == "eos" and toks[-1] == 3 and 3 not in toks[:-1]
    await engine.cleanup()


async def test_default_max_tokens_runs_to_the_context_length() -> None:
    """Locks: without max_tokens a request may use the rest of the context, then ends "length"."""
    engine, _, _ = await started(context_length=64, block_size=16, num_gpu_blocks=64)
    toks, end = await run(engine, req(list(range(50)), "a", ignore_eos=True))
    assert len(toks) == 14 and end["finish_reason"] == "length"
    await engine.cleanup()


async def test_invalid_requests_raise_before_any_chunk(mocker: Any) -> None:
    """Locks: empty prompt → InvalidArgument; prompt + max_tokens over the context → ContextLengthExceeded."""
    engine, _, _ = mocker
    with pytest.raises(InvalidArgument):
        await run(engine, req([], "empty"))
    with pytest.raises(ContextLengthExceeded):
        await run(engine, req([1] * 8000, "long", max_tokens=500))
    with pytest.raises(ContextLengthExceeded):
        await run(engine, req([1] * 8192, "full"))
    with pytest.raises(InvalidArgument):
        await run(engine, req([1], "zero", max_tokens=0))
    bad = req([1, 2], "bad")
    bad["disagg"] = {"request_type": "generation_only", "kv_handle": b"x", "first_token_ids": [1]}
    with pytest.raises(InvalidArgument):
        await run(engine, bad)


# ------------------------------------------------------------------ cancellation


async def test_stopping_a_request_ends_it_cancelled_and_frees_its_blocks(mocker: Any) -> None:
    """Locks: context.stop() → a "cancelled" terminal, and the sequence's KV is freed."""
    engine, _, _ = mocker
    ctx = Context("c")
    chunks = stream(engine, req(PROMPT, "c", max_tokens=5000, ignore_eos=True), ctx)
    first = await anext(chunks)
    assert first["token_ids"] and engine.blocks.num_used > 0
    ctx.stop()
    rest = [c async for c in chunks]
    assert rest[-1]["finish_reason"] == "cancelled" and len(rest) == 1
    assert engine.blocks.num_used == 0 and not engine.scheduler.has_work()


async def test_dropping_the_iterator_frees_the_blocks_at_once(mocker: Any) -> None:
    """Locks: a consumer that goes away (aclose) frees the request's KV without a stop signal."""
    engine, _, _ = mocker
    chunks = stream(engine, req(PROMPT, "d", max_tokens=5000, ignore_eos=True), Context("d"))
    await anext(chunks)
    await chunks.aclose()
    assert engine.blocks.num_used == 0 and not engine.scheduler.has_work()


async def test_a_waiting_request_notices_its_stop_and_abort_frees_a_running_one() -> None:
    """Locks: a request that never got admitted still ends "cancelled" promptly; abort() frees KV out of band."""
    engine, _, _ = await started(MockerConfig(speedup_ratio=1.0), max_num_seqs=1)
    hog_ctx, waiter_ctx = Context("hog"), Context("waiter")
    hog = stream(engine, req(PROMPT, "hog", max_tokens=5000, ignore_eos=True), hog_ctx)
    await anext(hog)
    waiting = asyncio.ensure_future(anext(engine.generate(req([5, 6], "waiter"), waiter_ctx)))
    await asyncio.sleep(0)
    assert len(engine.scheduler.waiting) == 1
    waiter_ctx.stop()
    assert (await waiting)["finish_reason"] == "cancelled"
    hog_ctx.stop()
    await engine.abort(hog_ctx)
    assert engine.blocks.num_used == 0
    assert (await anext(hog))["finish_reason"] == "cancelled"
    await hog.aclose()
    await engine.cleanup()


# ------------------------------------------------------------------ roles


def disagg_req(prompt: list[int], rid: str, role: str, **extra: Any) -> TokenRequest:
    r = req(prompt, rid, max_tokens=12, ignore_eos=True)
    r["disagg"] = {"request_type": role, **extra}  # type: ignore[typeddict-item]
    return r


async def test_prefill_then_decode_legs_produce_the_aggregated_tokens() -> None:
    """Locks: context_only ends with one terminal carrying the first token and a kv handle; the decode leg continues after it."""
    agg_engine, _, _ = await started()
    prefill, _, _ = await started()
    decode, decode_sink, decode_steps = await started()
    agg, _ = await run(agg_engine, req(PROMPT, "agg", max_tokens=12, ignore_eos=True))

    chunks = [c async for c in prefill.generate(disagg_req(PROMPT, "p", "context_only"), Context("p"))]
    assert len(chunks) == 1
    end = chunks[0]
    assert end["finish_reason"] == "length" and end["token_ids"] == agg[:1]
    d = end["disagg"]
    assert d["first_token_ids"] == agg[:1] and d["kv_bytes"] == 200 * FAST.kv_bytes_per_token
    handle = decode_kv_handle(d["kv_handle"])
    assert handle.prompt_tokens == 200 and list(handle.block_hashes) == block_hashes(PROMPT, 64)
    assert prefill.num_holds == 1 and prefill.blocks.num_used == 4  # held for the decode leg

    leg = disagg_req(PROMPT, "g", "generation_only", kv_handle=d["kv_handle"], first_token_ids=d["first_token_ids"])
    rest, end = await run(decode, leg)
    assert agg[:1] + rest == agg and end["usage"]["completion_tokens"] == 12
    assert sum(s.prefill_tokens for s in decode_steps) == 0  # transferred, not prefilled
    assert decode_sink.stored_hashes() == block_hashes(PROMPT, 64)
    for e in (agg_engine, prefill, decode):
        await e.cleanup()


async def test_held_prefill_kv_is_released_after_the_hold_timeout_or_by_a_local_decode_leg() -> None:
    """Locks: nobody pulls mocker KV, so a hold ends at --kv-hold-timeout; a decode leg on the same engine ends it at once."""
    engine, sink, _ = await started(kv_hold_timeout_s=0.05)
    await run(engine, disagg_req(PROMPT, "p1", "context_only"))
    assert engine.num_holds == 1 and engine.blocks.num_used == 4
    sink.loads.clear()
    await sink.until_load(lambda m: m.active_blocks == 0)
    assert engine.num_holds == 0

    _, end = await run(engine, disagg_req(PROMPT, "p2", "context_only"))
    d = end["disagg"]
    leg = disagg_req(PROMPT, "g", "generation_only", kv_handle=d["kv_handle"], first_token_ids=d["first_token_ids"])
    toks, _ = await run(engine, leg)
    assert engine.num_holds == 0 and len(toks) == 11 and engine.blocks.num_used == 0
    await engine.cleanup()


async def test_a_decode_leg_whose_first_tokens_reach_max_tokens_ends_at_once(mocker: Any) -> None:
    """Locks: max_tokens counts the prefill leg's first tokens end to end."""
    engine, _, _ = mocker
    _, end = await run(engine, disagg_req(PROMPT, "p", "context_only"))
    d = end["disagg"]
    r = disagg_req(PROMPT, "g", "generation_only", kv_handle=d["kv_handle"], first_token_ids=d["first_token_ids"])
    r["stop"]["max_tokens"] = 1
    toks, end = await run(engine, r)
    assert toks == [] and end["finish_reason"] == "length" and end["usage"]["completion_tokens"] == 1


# ------------------------------------------------------------------ lifecycle, flags, load


async def test_start_reports_the_engine_config_and_cleanup_is_idempotent() -> None:
    """Locks: EngineConfig fields; cleanup twice (and concurrently) is safe; generate after cleanup is refused."""
    engine = MockerEngine(MockerConfig(model_name="m"))
    await engine.cleanup()  # safe without start
    engine = MockerEngine(MockerConfig(model_name="m"))
    cfg = await engine.start("w")
    assert (cfg.model, cfg.kv_block_size, cfg.total_kv_blocks, cfg.max_num_seqs) == ("m", 64, 16384, 256)
    assert (cfg.max_num_batched_tokens, cfg.context_length, cfg.eos_token_ids) == (8192, 8192, (2,))
    assert (cfg.tokenizer_source, cfg.kv_layout) == ("builtin:mocker", "mocker-v1")
    await asyncio.gather(engine.cleanup(), engine.cleanup())
    await engine.cleanup()
    with pytest.raises(EngineShutdown):
        await run(engine, req([1], "late"))


async def test_from_args_parses_mocker_flags_and_rejects_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks: flag defaults, --no-enable-prefix-caching, env-driven booleans, one-line ConfigErrors."""
    engine, worker = await MockerEngine.from_args([])
    assert engine.config == MockerConfig() and worker.engine == "mocker" and worker.model_name == "mocker"
    engine, worker = await MockerEngine.from_args(
        ["--model-name", "x", "--block-size", "16", "--no-enable-prefix-caching"]
        + ["--speedup-ratio", "0", "--kv-transfer-bandwidth", "25"]
    )
    assert (engine.config.model_name, engine.config.block_size, engine.config.enable_prefix_caching) == ("x", 16, False)
    assert (engine.config.speedup_ratio, engine.config.kv_transfer_bandwidth, worker.model_name) == (0.0, 25.0, "x")
    monkeypatch.setenv("MESHLLM_ENABLE_PREFIX_CACHING", "false")
    engine, _ = await MockerEngine.from_args([])
    assert engine.config.enable_prefix_caching is False
    monkeypatch.delenv("MESHLLM_ENABLE_PREFIX_CACHING")
    bad_flags = [["--block-size", "0"], ["--watermark", "1.5"], ["--speedup-ratio", "-1"]]
    bad_flags += [["--eos-token-id", "40000"], ["--num-gpu-blocks", "10"]]
    for argv in bad_flags:
        with pytest.raises(ConfigError) as info:
            await MockerEngine.from_args(argv)
        assert "\n" not in str(info.value)


async def test_load_snapshots_follow_the_queues_at_most_every_100ms_and_settle_idle() -> None:
    """Locks: load reports carry blocks and queue lengths, are throttled, and the last one shows the idle state."""
    engine, sink, _ = await started(MockerConfig(speedup_ratio=1.0), max_num_seqs=2)
    await asyncio.gather(*(run(engine, req([i] * 70, f"r{i}", max_tokens=30, ignore_eos=True)) for i in range(4)))
    idle = await sink.until_load(lambda m: m.running == 0 and m.waiting == 0)
    assert idle.total_blocks == 16384 and idle.active_blocks == 0
    busy = [m for m in sink.loads if m.running > 0]
    assert busy and all(m.active_blocks > 0 for m in busy)
    gaps = [b - a for a, b in zip(sink.load_times, sink.load_times[1:], strict=False)]
    assert min(gaps) >= 0.099
    await engine.cleanup()


async def test_a_failing_step_loop_fails_its_streams_instead_of_hanging(mocker: Any) -> None:
    """Locks: a simulator bug surfaces as `Unknown` on every stream and refuses new requests."""
    engine, _, _ = mocker

    def broken(now: float) -> Any:
        raise RuntimeError("boom")

    engine.scheduler.schedule = broken
    with pytest.raises(Unknown, match="boom"):
        await run(engine, req(PROMPT, "x"))
    with pytest.raises(EngineShutdown, match="boom"):
        await run(engine, req(PROMPT, "y"))


def test_kv_handles_round_trip_and_foreign_layouts_are_refused() -> None:
    """Locks: the handle codec, and a decode leg with another block size fails with FailedPrecondition."""
    handle = KvHandle(64, 130, 2**63 + 5, 7, (1, 2**64 - 1))
    assert decode_kv_handle(encode_kv_handle(handle)) == handle
    engine = MockerEngine(MockerConfig(block_size=16))
    with pytest.raises(FailedPrecondition):
        engine.transfers.accept_handle(encode_kv_handle(handle), [0] * 130)
    with pytest.raises(InvalidArgument):
        engine.transfers.accept_handle(encode_kv_handle(handle._replace(block_size=16)), [0] * 12)


async def test_tokens_that_pile_up_behind_a_slow_consumer_leave_as_one_chunk(mocker: Any) -> None:
    """Locks: coalescing — a stream yields every token produced since its last chunk at once."""
    engine, _, steps = mocker
    ten_steps = asyncio.Event()

    def observe(report: StepReport) -> None:
        steps.append(report)
        if len(steps) >= 10:
            ten_steps.set()

    engine.on_step = observe
    chunks = stream(engine, req(PROMPT, "slow", max_tokens=50, ignore_eos=True), Context("slow"))
    first = await anext(chunks)
    await ten_steps.wait()
    second = await anext(chunks)
    assert len(first["token_ids"]) + len(second["token_ids"]) >= 10 and len(second["token_ids"]) > 1
    rest = [c async for c in chunks]
    assert sum(len(c.get("token_ids", [])) for c in [first, second, *rest]) == 50

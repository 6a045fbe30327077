"""The mocker hands each step's tokens to `Context.relay` from its step loop (the worker's session relay).

Locks: with a relay the same request gives the same tokens (relay chunks, then the terminal from the iterator,
which yields nothing else); a decode leg's relay starts after the tokens another worker streamed; a stop during
the stream ends it "cancelled" through the iterator; nothing reaches the relay after its iterator is closed; a
relay that raises fails its own stream with Unknown and the engine serves the next request; a subclass that
overrides `generate` is not given a relay (`takes_relay()` false), so its view of the chunks is not bypassed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from test_mocker_engine import PROMPT, disagg_req, req, run, started

from meshllm.engine.base import Context
from meshllm.engine.mocker import MockerConfig, MockerEngine
from meshllm.errors import Unknown
from meshllm.protocol import chunks
from meshllm.protocol.types import TokenChunk, TokenRequest


@pytest.fixture
async def engine() -> AsyncIterator[MockerEngine]:
    e, _, _ = await started()
    yield e
    await e.cleanup()


async def sunk(engine: MockerEngine, request: TokenRequest) -> tuple[list[TokenChunk], list[TokenChunk]]:
    """(chunks the relay got, chunks the iterator yielded)."""
    got: list[TokenChunk] = []
    ctx = Context(request["request_id"])
    ctx.relay = got.append
    yielded = [c async for c in engine.generate(request, ctx)]
    return got, yielded


async def test_a_relay_gets_every_token_and_the_iterator_only_the_terminal(engine: MockerEngine) -> None:
    assert engine.takes_relay()
    expected, terminal = await run(engine, req(PROMPT, "plain", max_tokens=40, ignore_eos=True))
    got, yielded = await sunk(engine, req(PROMPT, "sunk", max_tokens=40, ignore_eos=True))
    assert [t for c in got for t in c["token_ids"]] + yielded[-1]["token_ids"] == expected and len(expected) == 40
    assert len(yielded) == 1 and yielded[0]["finish_reason"] == terminal["finish_reason"] == "length"
    assert yielded[0]["usage"]["completion_tokens"] == 40 and all("finish_reason" not in c for c in got)


async def test_a_decode_legs_relay_starts_after_the_tokens_already_streamed(engine: MockerEngine) -> None:
    expected, _ = await run(engine, req(PROMPT, "agg", max_tokens=12, ignore_eos=True))
    prefill, _, _ = await started()
    try:
        (end,) = [c async for c in prefill.generate(disagg_req(PROMPT, "p", "context_only"), Context("p"))]
        d = end["disagg"]
        leg = disagg_req(PROMPT, "g", "generation_only", kv_handle=d["kv_handle"], first_token_ids=d["first_token_ids"])
        got, yielded = await sunk(engine, leg)
    finally:
        await prefill.cleanup()
    assert d["first_token_ids"] == expected[:1]
    assert [t for c in got for t in c["token_ids"]] + yielded[-1]["token_ids"] == expected[1:]


class Filling:
    """A relay that records chunks and tells a test when it holds `n` of them."""

    def __init__(self, n: int) -> None:
        self.got: list[TokenChunk] = []
        self.n = n
        self.ready = asyncio.Event()

    def __call__(self, chunk: TokenChunk) -> None:
        self.got.append(chunk)
        if len(self.got) >= self.n:
            self.ready.set()


async def streaming(
    engine: MockerEngine, rid: str, n: int
) -> tuple[list[TokenChunk], Context, AsyncIterator[TokenChunk], asyncio.Future[TokenChunk]]:
    """A long request with a relay, its iterator awaited in the background, once the relay holds `n` chunks."""
    relay = Filling(n)
    ctx = Context(rid)
    ctx.relay = relay
    stream = engine.generate(req(PROMPT, rid, max_tokens=5000, ignore_eos=True), ctx)
    waiting = asyncio.ensure_future(anext(stream))
    await asyncio.wait_for(relay.ready.wait(), 5)
    return relay.got, ctx, stream, waiting


async def test_a_stop_during_the_stream_ends_it_cancelled_through_the_iterator() -> None:
    engine, _, _ = await started(MockerConfig(speedup_ratio=100.0))
    try:
        got, ctx, stream, waiting = await streaming(engine, "c", 3)
        ctx.stop()
        assert (await waiting)["finish_reason"] == "cancelled"
        n = len(got)
        await stream.aclose()  # type: ignore[attr-defined]
        assert engine.blocks.num_used == 0 and not engine.scheduler.has_work() and len(got) == n
    finally:
        await engine.cleanup()


async def test_nothing_reaches_the_relay_after_its_iterator_is_closed() -> None:
    engine, _, _ = await started(MockerConfig(speedup_ratio=100.0))
    try:
        got, _, stream, waiting = await streaming(engine, "d", 1)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await stream.aclose()  # type: ignore[attr-defined]
        n = len(got)
        tokens, _ = await run(engine, req(PROMPT, "next", max_tokens=20, ignore_eos=True))  # the engine steps on
        assert len(tokens) == 20 and len(got) == n
    finally:
        await engine.cleanup()


async def test_a_relay_that_raises_fails_its_stream_with_unknown_and_the_engine_goes_on(engine: MockerEngine) -> None:
    def bad(chunk: TokenChunk) -> None:
        raise KeyError("relay bug")

    ctx = Context("bad")
    ctx.relay = bad
    with pytest.raises(Unknown, match="chunk relay failed: KeyError"):
        _ = [c async for c in engine.generate(req(PROMPT, "bad", max_tokens=40, ignore_eos=True), ctx)]
    assert engine.blocks.num_used == 0
    tokens, terminal = await run(engine, req(PROMPT, "after", max_tokens=10, ignore_eos=True))
    assert len(tokens) == 10 and terminal["finish_reason"] == "length"


async def test_a_subclass_that_overrides_generate_is_not_given_a_relay() -> None:
    class Wrapping(MockerEngine):
        async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
            async for chunk in super().generate(request, context):
                yield chunk

    class Plain(MockerEngine):
        pass

    config: Any = MockerConfig(speedup_ratio=0.0)
    assert not Wrapping(config).takes_relay() and Plain(config).takes_relay()


async def stream_to_writer(
    engine: MockerEngine, rid: str, max_tokens: int, seen: list[int], on_turn: Callable[[int], None]
) -> None:
    """Run one request whose relay (extending `seen`) wakes a writer task, as a session's writer is woken;
    `on_turn(tokens seen)` runs at each of the writer's turns."""
    woken = asyncio.Event()
    ended = False

    def relay(chunk: TokenChunk) -> None:
        seen.extend(chunk["token_ids"])
        woken.set()

    async def writer() -> None:
        while True:
            await woken.wait()
            if ended:
                return
            woken.clear()
            on_turn(len(seen))

    task = asyncio.ensure_future(writer())
    try:
        ctx = Context(rid)
        ctx.relay = relay
        [c async for c in engine.generate(req(PROMPT, rid, max_tokens=max_tokens, ignore_eos=True), ctx)]
        ended = True
        woken.set()
        await asyncio.wait_for(task, 5)
    finally:
        task.cancel()
        await engine.cleanup()


async def test_a_steps_consumers_run_before_its_bookkeeping() -> None:
    """Locks: on a timed mocker, a task the relay wakes (a session's writer) runs before the step's own bookkeeping
    (the step hook, the load report), so that work does not delay the tokens' way out. (A step already over on
    the model's timeline when it ends, in a loop that ran late, is the exception: see the next test; the first
    step here is a prefill, milliseconds long at speedup 10.)"""
    engine, _, _ = await started(MockerConfig(speedup_ratio=10.0))
    writer_ran: list[int] = []  # tokens the writer task had seen when it ran
    order: list[tuple[int, int]] = []  # per step with output: (tokens seen, writer wake-ups) when its hook ran
    seen: list[int] = []

    def on_step(_: Any) -> None:
        if seen and len(order) < 3:
            order.append((len(seen), len(writer_ran)))

    engine.on_step = on_step
    await stream_to_writer(engine, "b", 5, seen, writer_ran.append)
    assert order and all(woke >= 1 for _, woke in order)
    assert writer_ran[0] == order[0][0]  # the writer saw the step's token before the step's hook ran


async def test_steps_that_fell_due_while_the_loop_was_busy_run_without_a_yield() -> None:
    """Locks the mocker's catch-up: after its process held the event loop for 4 ms (far longer than a step at
    speedup 100), the steps already due on the model's timeline run back to back, so the relay's writer task
    takes several steps' tokens in one turn; a mocker that yielded after every step would hand it one each."""
    engine, _, _ = await started(MockerConfig(speedup_ratio=100.0))
    per_turn: list[int] = []  # new tokens the writer found at each of its turns
    taken = [0]

    def on_turn(seen: int) -> None:
        per_turn.append(seen - taken[0])
        taken[0] = seen
        if len(per_turn) == 2:
            busy_until = time.perf_counter() + 0.004  # the behaviour under test: this process keeps the loop busy
            while time.perf_counter() < busy_until:
                pass

    await stream_to_writer(engine, "c", 60, [], on_turn)
    assert max(per_turn[2:]) >= 2, per_turn


@pytest.mark.parametrize("coalesce", [True, False])
async def test_a_lagging_consumer_gets_one_token_per_chunk_without_coalescing(
    engine: MockerEngine, monkeypatch: pytest.MonkeyPatch, coalesce: bool
) -> None:
    """Locks: a consumer slower than the steps (no relay: the in-process plane) gets the tokens made meanwhile as
    one chunk, or, with --no-coalesce, one chunk per step (one token each, the terminal holding at most one);
    the tokens are the same either way."""
    monkeypatch.setattr(chunks, "_coalescing", coalesce)
    expected, _ = await run(engine, req(PROMPT, "plain", max_tokens=30, ignore_eos=True))
    sizes, tokens = [], []
    async for c in engine.generate(req(PROMPT, "slow", max_tokens=30, ignore_eos=True), Context("slow")):
        sizes.append(len(c.get("token_ids", ())))
        tokens += c.get("token_ids", ())
        for _ in range(20):
            await asyncio.sleep(0)  # the behaviour under test: steps run while the consumer is away
    assert tokens == expected and len(expected) == 30
    if coalesce:
        assert max(sizes) > 1, sizes
    else:
        assert max(sizes) == 1, sizes

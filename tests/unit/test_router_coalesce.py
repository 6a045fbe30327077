"""Token coalescing: a slow caller gets merged chunks; terminals are never merged; closing cancels the source."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from meshllm.errors import Disconnected
from meshllm.protocol.types import GenerateChunk
from meshllm.router.coalesce import coalesce, merge_into


async def fast_source(n: int, *, terminal: bool = True) -> AsyncIterator[GenerateChunk]:
    for i in range(n):
        yield {"token_ids": [i], "logprobs": [{"token_id": i, "logprob": -1.0}]}
    if terminal:
        usage = {"prompt_tokens": 1, "completion_tokens": n, "cached_tokens": 0}
        yield {"token_ids": [], "finish_reason": "length", "usage": usage}  # type: ignore[typeddict-item]


async def test_a_slow_caller_gets_the_tokens_merged_into_fewer_chunks() -> None:
    out = []
    async for chunk in coalesce(fast_source(100)):
        out.append(chunk)
        await asyncio.sleep(0.01)  # the slow caller (the behaviour under test, not a synchronisation)
    tokens = [t for c in out for t in c.get("token_ids", [])]
    assert tokens == list(range(100))
    assert len(out) < 50
    assert [lp["token_id"] for c in out for lp in c.get("logprobs", [])] == list(range(100))
    assert out[-1]["finish_reason"] == "length" and out[-1]["token_ids"] == []
    assert sum("finish_reason" in c for c in out) == 1


async def test_a_fast_caller_gets_every_chunk_as_sent() -> None:
    async def paced() -> AsyncIterator[GenerateChunk]:
        for i in range(5):
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            yield {"token_ids": [i]}
        yield {"token_ids": [], "finish_reason": "eos", "usage": {"prompt_tokens": 1, "completion_tokens": 5, "cached_tokens": 0}}

    out = [c async for c in coalesce(paced())]
    assert [c["token_ids"] for c in out[:-1]] == [[0], [1], [2], [3], [4]]


def test_merge_never_crosses_a_terminal() -> None:
    from meshllm.router.coalesce import _Pipe

    pipe = _Pipe()
    pipe.put({"token_ids": [1]})
    pipe.put({"token_ids": [2]})
    pipe.put({"token_ids": [3], "finish_reason": "length"})
    pipe.put({"token_ids": [4]})  # nothing is merged into a terminal
    assert [c["token_ids"] for c in pipe.queue] == [[1, 2], [3], [4]]
    target: GenerateChunk = {"token_ids": [1]}
    merge_into(target, {"token_ids": [2], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "cached_tokens": 0}})
    assert target == {"token_ids": [1, 2], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "cached_tokens": 0}}


async def test_closing_the_stream_cancels_and_closes_the_source() -> None:
    closed = asyncio.Event()
    started = asyncio.Event()

    async def endless() -> AsyncIterator[GenerateChunk]:
        try:
            started.set()
            while True:
                await asyncio.sleep(0.001)
                yield {"token_ids": [1]}
        finally:
            closed.set()

    stream = coalesce(endless())
    await stream.__anext__()
    await stream.aclose()  # type: ignore[attr-defined]
    assert started.is_set()
    await asyncio.wait_for(closed.wait(), 5)


async def test_an_error_in_the_source_reaches_the_caller_after_the_queued_tokens() -> None:
    async def broken() -> AsyncIterator[GenerateChunk]:
        yield {"token_ids": [1]}
        raise Disconnected("worker went away")

    got = []
    with pytest.raises(Disconnected):
        async for chunk in coalesce(broken()):
            got.append(chunk)
    assert got == [{"token_ids": [1]}]

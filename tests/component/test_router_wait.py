"""The measured wait behind a busy worker, end to end: real mocker workers (real timing), real gRPC, Route's explanation.

Locks: the router measures a worker's step time and the model's prefill time
per block from the streams it proxies; a prompt whose prefix worker a
caches goes to idle worker b while a is running another request and the
wait there (1.5 steps) costs more than the prefill the hit saves — without
the wait term a would win — and goes back to a once a is idle.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from test_router_support import collect, mesh, mocker, request, wait_for

from meshllm.protocol.kv import block_hashes
from meshllm.router.core import RouterCore
from meshllm.router.timing import BUSY_STEPS


def unique(seed: int, n: int) -> list[int]:
    """`n` token ids of their own (the vocabulary has 32,000)."""
    return [(seed * 7919 + i * 31) % 31_000 + 1000 for i in range(n)]


async def pinned(core: RouterCore, worker: str, prompt: list[int], rid: str, max_tokens: int = 4) -> None:
    await collect(core.generate(request(rid, prompt, max_tokens=max_tokens, routing={"backend_instance_id": worker})))


async def test_a_cache_hit_waits_only_when_the_wait_costs_less_than_recomputing_on_an_idle_worker() -> None:
    async with mesh() as m:
        for wid in ("a", "b"):  # real timing: a decode step of a few ms, ~0.24 ms per prefill block
            await m.worker(mocker(speedup_ratio=1.0), instance_id=wid)
        core = await m.router()
        # Idle legs of different lengths teach the prefill time per block; their tokens teach a's step time.
        for i, n in enumerate((16, 2048, 16, 2048)):
            await pinned(core, "ab"[i % 2], unique(i + 1, n), f"learn{i}")
        await pinned(core, "a", unique(9, 16), "learn-a")
        doc = unique(5, 12 * 16)  # 12 blocks: a hit saves ~3 ms of prefill, less than 1.5 decode steps
        await pinned(core, "a", doc, "warm")
        hashes = block_hashes(doc, 16)
        await wait_for(lambda: core.index.overlaps(hashes, [("a", 0)]).get(("a", 0), 0) == 12, what="a's KV events")
        assert core.times.block_ms("mocker", 16) > 0 and core.times.step_ms(("a", 0)) > 0

        first = asyncio.Event()

        async def busy() -> None:  # a long request keeps a decoding
            long = request("busy", unique(7, 32), max_tokens=2000, routing={"backend_instance_id": "a"})
            async for chunk in core.generate(long):
                if chunk.get("token_ids"):
                    first.set()

        task = asyncio.create_task(busy())
        try:
            await asyncio.wait_for(first.wait(), 10)
            block_ms = core.times.block_ms("mocker", 16)  # the busy request's own first token counted too
            prompt = doc + unique(6, 16)
            d = await core.route("mocker", prompt)
            by_id = {c.worker_id: c for c in d.candidates}
            a, b = by_id["a"], by_id["b"]
            assert a.overlap_blocks == 12 and b.overlap_blocks == 0 and a.in_flight == 1
            assert d.wait_weight == 1.0 and d.prefill_ms_per_block == pytest.approx(block_ms)
            assert a.step_ms > 0 and a.wait_blocks == pytest.approx(BUSY_STEPS * a.step_ms / block_ms)
            assert b.wait_blocks == 0
            assert d.worker_id == "b", str(list(d.candidates))
            assert a.cost - a.wait_blocks < b.cost  # without the wait term the hit on a would win
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await wait_for(lambda: core.load.get(("a", 0)).in_flight == 0, what="a idle")
        d = await core.route("mocker", prompt)
        assert d.worker_id == "a" and {c.worker_id: c for c in d.candidates}["a"].wait_blocks == 0

"""The measured wait behind a busy worker, end to end: real mocker workers (real timing), real gRPC, Route's explanation.

Locks: the router measures a worker's step time and the model's prefill time
per block from the streams it proxies; a prompt whose prefix worker a
caches goes to idle worker b while a is running another request and the
wait there (1.5 steps) costs more than the prefill the hit saves — without
the wait term a would win — and goes back to a once a is idle. Decode
load counts a cached prompt block as saved only while a running request
shares it (idle cached blocks become active again), and while a request on
a worker has no first token yet the wait there adds the fixed time of a
prefill step (the prefill fit's intercept, `prefill_fixed_ms`).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from test_router_support import collect, mesh, mocker, request, wait_for

from meshllm.protocol.kv import block_hashes
from meshllm.router.core import RouterCore
from meshllm.router.policy.timing import BUSY_STEPS


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


async def test_decode_load_saves_only_blocks_running_requests_share_and_a_prefill_in_progress_adds_its_fixed_time() -> None:
    async with mesh() as m:
        for wid in ("a", "b"):
            await m.worker(mocker(speedup_ratio=1.0, context_length=16384), instance_id=wid)
        core = await m.router()
        for i, n in enumerate((16, 2048, 16, 2048)):
            await pinned(core, "ab"[i % 2], unique(i + 1, n), f"learn{i}")
        doc = unique(5, 12 * 16)
        await pinned(core, "a", doc, "warm")
        hashes = block_hashes(doc, 16)
        await wait_for(lambda: core.index.overlaps(hashes, [("a", 0)]).get(("a", 0), 0) == 12, what="a's KV events")

        def reported_idle(key: tuple[str, int]) -> bool:
            rep = core.load.get(key).reported  # a snapshot taken after the last request ended
            return rep is not None and rep.active_blocks == 0 and rep.running == 0

        await wait_for(lambda: reported_idle(("a", 0)) and reported_idle(("b", 0)), what="idle snapshots")
        prompt = doc + unique(6, 16)  # 13 blocks, the first 12 cached on a
        d = await core.route("mocker", prompt)
        a, b = (next(c for c in d.candidates if c.worker_id == w) for w in "ab")
        assert a.overlap_blocks == 12 and a.in_flight == b.in_flight == 0
        # Cached but idle blocks save prefill only: running the request there makes them active again.
        assert a.decode_blocks == b.decode_blocks == 13
        assert a.prefill_tokens == 16 and d.worker_id == "a"

        started, first = asyncio.Event(), asyncio.Event()

        async def long() -> None:  # the document + 12,000 tokens of its own: its prefill step takes ~0.26 s
            req = request("long", doc + unique(8, 12_000), max_tokens=300, routing={"backend_instance_id": "a"})
            started.set()
            async for chunk in core.generate(req):
                if chunk.get("token_ids"):
                    first.set()

        task = asyncio.create_task(long())
        try:
            await started.wait()
            await wait_for(lambda: core.load.get(("a", 0)).prefilling == 1, what="the long request charged")
            d = await core.route("mocker", prompt)
            active = {w: core.load.get((w, 0)).active_blocks for w in "ab"}  # route ran without yielding: the same view
            a, b = (next(c for c in d.candidates if c.worker_id == w) for w in "ab")
            assert not first.is_set() and a.in_flight == 1 and a.prefilling == 1, str(a)
            assert a.decode_blocks == active["a"] + 13 - 12  # the 12 document blocks are shared with the running request
            assert b.decode_blocks == active["b"] + 13
            assert d.prefill_fixed_ms > 0 and d.prefill_ms_per_block > 0 and a.step_ms > 0
            step_part = BUSY_STEPS * a.step_ms / d.prefill_ms_per_block
            assert a.wait_blocks == pytest.approx(step_part + d.prefill_fixed_ms / d.prefill_ms_per_block)

            await asyncio.wait_for(first.wait(), 10)
            await wait_for(lambda: core.load.get(("a", 0)).prefilling == 0, what="the long request's first token")
            d = await core.route("mocker", prompt)
            a = next(c for c in d.candidates if c.worker_id == "a")
            assert a.in_flight == 1 and a.prefilling == 0  # decoding: only the steps are waited for
            assert a.wait_blocks == pytest.approx(BUSY_STEPS * a.step_ms / d.prefill_ms_per_block)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

"""Capacity-aware kv routing end to end: real mocker workers, real KV events, the Route explanation.

Locks, with small caches: a document that shares only its 2-block preamble
with the one cached on worker a goes to a worker with room (in `kv` and in
`approximate` mode), and the explanation shows why (a's pressure; without
the capacity terms a wins on its preamble); of two equally cheap, nearly full
workers, the one whose eviction victims were never reused takes a new
prefix, and the other's reused blocks are reported as `evicted_hot_blocks`,
each charged `reused_evict_cost` (2.5) prefill blocks; a worker whose
running requests leave no room for a request's blocks is marked `no_room`
and loses to one with room even where its cost is lower.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from test_router_support import collect, mesh, mocker, request, wait_for

from meshllm.router.config import RouterMode
from meshllm.router.core import RouterCore


def doc(first: int, blocks: int, preamble: list[int]) -> list[int]:
    return preamble + list(range(first, first + 16 * blocks - len(preamble)))


async def warm(core: RouterCore, worker: str, prompt: list[int], rid: str) -> None:
    await collect(core.generate(request(rid, prompt, max_tokens=1, routing={"backend_instance_id": worker})))


@pytest.mark.parametrize("mode", ["kv", "approximate"])
async def test_a_new_document_sharing_only_the_preamble_goes_to_a_worker_with_room(mode: str) -> None:
    preamble = list(range(500, 532))  # 2 blocks
    async with mesh() as m:
        for wid in ("a", "b", "c"):
            await m.worker(mocker(num_gpu_blocks=96, context_length=1024), instance_id=wid)
        core = await m.router(mode=RouterMode(mode))
        doc_a = doc(10_000, 40, preamble)
        await warm(core, "a", doc_a, "warm")
        if mode == "kv":
            await wait_for(lambda: core.index.worker_blocks("a") >= 40, what="a's KV events")
        d = await core.route("mocker", doc(20_000, 40, preamble))
        by_id = {c.worker_id: c for c in d.candidates}
        assert d.worker_id in ("b", "c") and d.capacity_weight == 1.0
        assert by_id["a"].overlap_blocks == 2 and by_id["a"].new_blocks == 38
        assert by_id["a"].total_blocks == 96 and by_id["a"].resident_blocks >= 40
        assert by_id["a"].pressure == pytest.approx(38 * by_id["a"].resident_blocks / 96)
        assert by_id["b"].pressure == 0 and by_id["b"].new_blocks == 40
        # the document itself still goes home
        assert (await core.route("mocker", doc_a)).worker_id == "a"
        # the peers' cost (overlap and load only) sends the new document to a, for its preamble
        plain = await m.router(mode=RouterMode(mode), capacity_weight=0.0)
        if mode == "approximate":
            await warm(plain, "a", doc_a, "warm2")
        assert (await plain.route("mocker", doc(20_000, 40, preamble))).worker_id == "a"


async def test_a_new_prefix_evicts_never_reused_blocks_rather_than_reused_ones() -> None:
    async with mesh() as m:
        for wid in ("a", "b"):
            await m.worker(mocker(num_gpu_blocks=40, context_length=512), instance_id=wid)
        core = await m.router()
        reused = list(range(1000, 1000 + 16 * 28))  # 28 blocks on a, sent twice: reused
        once = list(range(5000, 5000 + 16 * 30))  # 30 blocks on b, sent once
        await warm(core, "a", reused, "a1")
        await warm(core, "b", once, "b1")
        await wait_for(lambda: core.index.worker_blocks("a") >= 28 and core.index.worker_blocks("b") >= 30,
                       what="both workers' KV events")  # fmt: skip
        await warm(core, "a", reused, "a2")
        d = await core.route("mocker", list(range(9000, 9000 + 16 * 24)))  # 24 new blocks: both must evict
        by_id = {c.worker_id: c for c in d.candidates}
        # a's victims (12 of its 28 reused blocks) cost more than b's (14 blocks never reused), though b is fuller
        assert by_id["a"].evicted_hot_blocks == 12 and by_id["b"].evicted_hot_blocks == 0
        assert by_id["a"].pressure < by_id["b"].pressure
        assert d.worker_id == "b"
        # Route explains the price of each reused victim: 2.5 prefill blocks (× the tier's evict ratio, 1 here)
        a = by_id["a"]
        assert d.reused_evict_cost == 2.5 and a.evict_ratio == 1.0
        prefill = (a.prefill_tokens + a.queued_prefill_tokens) / d.block_size
        assert a.cost == pytest.approx(prefill + a.decode_blocks + a.pressure + 2.5 * 12 + a.wait_blocks)


async def test_a_worker_whose_running_requests_leave_no_room_loses_to_one_with_room() -> None:
    async with mesh() as m:
        # a: a small cache that holds the document; b: a large one, busier in blocks.
        # Slow steps (speedup 0.25): the long requests outlast the test.
        await m.worker(mocker(num_gpu_blocks=64, speedup_ratio=0.25, context_length=1024), instance_id="a")
        await m.worker(mocker(num_gpu_blocks=512, speedup_ratio=0.25, context_length=2048), instance_id="b")
        core = await m.router()
        document = list(range(1000, 1000 + 16 * 12))
        await warm(core, "a", document, "warm")
        await wait_for(lambda: core.index.worker_blocks("a") >= 12, what="a's KV events")

        async def run(rid: str, worker: str, blocks: int, first: int) -> None:
            prompt = list(range(first, first + 16 * blocks))
            await collect(core.generate(request(rid, prompt, max_tokens=100, routing={"backend_instance_id": worker})))

        long = [
            asyncio.create_task(run("on-a", "a", 44, 12_000)),  # 44 of a's 64 blocks in use (51 at its end)
            asyncio.create_task(run("on-b", "b", 100, 20_000)),  # 100 of b's 512
        ]
        try:
            await wait_for(
                lambda: core.load.get(("a", 0)).active_blocks >= 44 and core.load.get(("b", 0)).active_blocks >= 100,
                what="both long requests running",
            )
            prompt = document + list(range(7000, 7000 + 16 * 8))  # 12 cached blocks on a + 8 new: 20 blocks
            d = await core.route("mocker", prompt)
            by_id = {c.worker_id: c for c in d.candidates}
            a, b = by_id["a"], by_id["b"]
            assert a.overlap_blocks == 12 and a.no_room and not b.no_room
            assert a.cost < b.cost  # the cost alone would stack it onto a, to wait for the long request
            assert d.worker_id == "b"
            # without the capacity terms nothing is marked and the cheaper worker wins
            plain = await m.router(capacity_weight=0.0)
            await wait_for(
                lambda: plain.load.get(("a", 0)).active_blocks >= 44 and plain.load.get(("b", 0)).active_blocks >= 100,
                what="the second router's view of both long requests",
            )
            d = await plain.route("mocker", prompt)
            assert d.worker_id == "a" and not any(c.no_room for c in d.candidates)
        finally:
            for t in long:
                t.cancel()
            for t in long:
                with contextlib.suppress(asyncio.CancelledError):
                    await t

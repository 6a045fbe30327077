"""Peer prefix pulls end to end: mocker workers on real gRPC, a real router, the Route explanation.

A peer worker keeps a document in its host tier (evicted there by a second
document, as its real block manager does); the prefill worker holds none of
it. Everything between them is real: KV events, the router's index and rule
(router/kv/pull.py), the prefill leg's `disagg.kv_source`, the prefill
worker's `kv_pull` over gRPC `Worker.PullKv`, the peer's `pull_kv` resolving
the prefix handle against its tiers.

Locks: with a fast assumed link the router attaches the pull and explains it
(blocks per tier, restore, transfer and recompute terms), the prefill worker's
cached tokens are the pulled ones and the request's usage reports them; with
a slow link the router explains why it computes instead and attaches
nothing; a prefill leg whose peer no longer holds the blocks (NOT_FOUND), or
whose peer is gone, computes the prompt and succeeds; a prefill leg cancelled
while its pull is seconds from done ends "cancelled" at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_router_support import collect, mesh, mocker, request, tokens_of, wait_for

from meshllm.engine.base import Context, KvTier
from meshllm.engine.mocker import MockerEngine
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.kv import block_hashes, prefix_handle
from meshllm.router.core import RouterCore
from meshllm.router.policy.timing import WorkerTimes
from meshllm.v1 import discovery_pb2, events_pb2
from meshllm.worker.client import WorkerClient

HOST = events_pb2.KV_TIER_HOST


def doc(first: int, blocks: int) -> list[int]:
    return list(range(first, first + 16 * blocks))


def peer_engine() -> MockerEngine:
    """A small device cache (50 blocks) over a host tier: a second 40-block document pushes the first down."""
    return mocker(num_gpu_blocks=50, context_length=720, kv_host_bytes=200 * 16 * 131072)


async def held_in_host(m: Any, core: RouterCore, peer: MockerEngine, document: list[int]) -> None:
    """Run `document` on the peer, then another one that evicts it into the peer's host tier."""
    for rid, tokens in (("warm", document), ("evict", doc(20_000, 40))):
        await collect(core.generate(request(rid, tokens, max_tokens=1, routing={"backend_instance_id": "peer"})))
    hashes = block_hashes(document, 16)
    await wait_for(
        lambda: (
            core.index.lower_blocks("peer", HOST) > 0
            and all(peer.blocks.holder(h) is not None for h in hashes)
            and core.load.get(("peer", 0)).reported is not None
            and len(core.load.get(("peer", 0)).reported.tiers) == 1
        ),  # type: ignore[union-attr]
        what="the document in the peer's host tier, indexed, and the peer's tier usage",
    )


def measured(core: RouterCore) -> None:
    core.times = WorkerTimes()  # forget the warm-up legs' samples: the figures below are the whole fit
    for n in (64, 128, 256, 512, 1024):  # the router measured 1 ms per prefill token: 16 ms a block
        core.times.prefill("mocker", n, 5.0 + n)


async def test_the_prefill_leg_pulls_a_prefix_from_a_peers_host_tier_when_cheaper() -> None:
    async with mesh() as m:
        peer, prefill, decode = peer_engine(), mocker(), mocker()
        await m.worker(peer, instance_id="peer")
        await m.worker(prefill, role="prefill", instance_id="p")
        await m.worker(decode, role="decode", instance_id="d")
        core = await m.router(kv_pull_gbps=10.0)
        document = doc(1000, 40)
        await held_in_host(m, core, peer, document)
        measured(core)
        prompt = document + doc(9000, 2)  # 40 blocks the peer holds, 2 new ones

        d = await core.route("mocker", prompt)
        pull = d.kv_pull
        assert d.worker_id == "p" and pull.worker_id == "peer" and pull.chosen and pull.reason == ""
        assert pull.blocks == 40 and pull.local_blocks == 0
        host = {t.tier: t for t in pull.lower_tiers}[HOST]
        assert pull.device_blocks + host.blocks == 40 and host.blocks > 0
        block_bytes = 16 * 131072
        assert pull.block_bytes == block_bytes
        assert host.restore_ms_per_block == pytest.approx(block_bytes / 25e9 * 1000)
        assert pull.restore_ms == pytest.approx(host.blocks * host.restore_ms_per_block)
        assert pull.transfer_ms == pytest.approx(40 * block_bytes / 10e9 * 1000)
        assert pull.recompute_ms == pytest.approx(40 * 16.0)
        assert pull.pull_ms == pytest.approx(pull.restore_ms + pull.transfer_ms) and pull.pull_ms < pull.recompute_ms
        asked = await core.route("mocker", prompt, role=discovery_pb2.WORKER_ROLE_PREFILL)  # the prefill pool named
        assert asked.kv_pull == pull

        chunks = await collect(core.generate(request("r", prompt, max_tokens=4)))
        assert len(tokens_of(chunks)) == 4 and chunks[-1]["finish_reason"] == "length"
        assert prefill.pulled_tokens == 640 and prefill.pull_failures == 0
        assert prefill.stats.device_hit_tokens == 640 and prefill.stats.prefill_tokens == len(prompt) - 640
        assert chunks[-1]["usage"]["cached_tokens"] == 640
        events = [e for e in core.metrics.recent.events() if e["kind"] == "kv_pull"]
        assert events and events[0]["worker_id"] == "peer"


async def test_a_slow_link_makes_recompute_cheaper_and_route_says_why() -> None:
    async with mesh() as m:
        peer, prefill = peer_engine(), mocker()
        await m.worker(peer, instance_id="peer")
        await m.worker(prefill, role="prefill", instance_id="p")
        await m.worker(mocker(), role="decode", instance_id="d")
        core = await m.router(kv_pull_gbps=0.001)  # 1 MB/s: 2 s a block against 16 ms to compute it
        document = doc(1000, 40)
        await held_in_host(m, core, peer, document)
        measured(core)
        prompt = document + doc(9000, 2)
        pull = (await core.route("mocker", prompt)).kv_pull
        assert pull.worker_id == "peer" and not pull.chosen and pull.reason == "recompute is cheaper"
        assert pull.transfer_ms == pytest.approx(40 * 16 * 131072 / 1e6 * 1000) and pull.recompute_ms == pytest.approx(640)
        chunks = await collect(core.generate(request("r", prompt, max_tokens=4)))
        assert chunks[-1]["finish_reason"] == "length" and prefill.pulled_tokens == 0
        assert prefill.stats.prefill_tokens == len(prompt) and chunks[-1]["usage"].get("cached_tokens", 0) == 0


async def test_without_a_measured_prefill_time_or_with_pulls_off_nothing_is_pulled() -> None:
    async with mesh() as m:
        peer = peer_engine()
        await m.worker(peer, instance_id="peer")
        await m.worker(mocker(), role="prefill", instance_id="p")
        await m.worker(mocker(), role="decode", instance_id="d")
        core = await m.router(kv_pull_gbps=10.0)
        document = doc(1000, 40)
        await held_in_host(m, core, peer, document)
        pull = (await core.route("mocker", document)).kv_pull
        assert not pull.chosen and pull.reason == "prefill time per block not measured yet"
        off = await m.router()  # --kv-pull-gbps 0
        measured(off)
        assert not (await off.route("mocker", document)).HasField("kv_pull")


def prefill_leg(rid: str, prompt: list[int], address: str, blocks: int) -> Any:
    src = {
        "worker_id": "peer", "address": address, "blocks": blocks, "block_size": 16, "tier": HOST,
        "kv_handle": prefix_handle(16, block_hashes(prompt, 16)[:blocks]),
    }  # fmt: skip
    return request(rid, prompt, max_tokens=4, disagg={"request_type": "context_only", "kv_source": src})


async def test_a_prefill_leg_whose_peer_lost_the_blocks_or_is_gone_computes_the_prompt() -> None:
    async with mesh() as m, ChannelCache() as channels:
        peer, prefill = peer_engine(), mocker()
        peer_worker = await m.worker(peer, instance_id="peer")
        p = await m.worker(prefill, role="prefill", instance_id="p")
        client = WorkerClient(channels, p.address)
        prompt = doc(3000, 10) + [7, 8, 9]  # the peer never saw it: NOT_FOUND there
        with pytest.raises(Exception, match="no longer held"):
            [c async for c in WorkerClient(channels, peer_worker.address).pull_kv(prefix_handle(16, block_hashes(prompt, 16)))]
        chunks = await collect(client.generate(prefill_leg("missing", prompt, peer_worker.address, 10)))
        assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["disagg"].get("cached_tokens", 0) == 0
        assert prefill.pull_failures == 1 and prefill.pulled_tokens == 0 and prefill.stats.prefill_tokens == len(prompt)

        await peer_worker.aclose()  # the peer is gone
        chunks = await collect(client.generate(prefill_leg("gone", doc(4000, 10) + [1], peer_worker.address, 10)))
        assert chunks[-1]["finish_reason"] == "length" and prefill.pull_failures == 2 and prefill.pulled_tokens == 0


async def test_a_prefill_leg_pulls_from_a_peer_over_grpc_and_reports_the_tokens_cached() -> None:
    async with mesh() as m, ChannelCache() as channels:
        peer, prefill = peer_engine(), mocker()
        peer_worker = await m.worker(peer, instance_id="peer")
        p = await m.worker(prefill, role="prefill", instance_id="p")
        document = doc(1000, 10)
        await collect(WorkerClient(channels, peer_worker.address).generate(request("warm", document, max_tokens=1)))
        prompt = document + [5, 6, 7]
        chunks = await collect(WorkerClient(channels, p.address).generate(prefill_leg("pull", prompt, peer_worker.address, 10)))
        assert chunks[-1]["disagg"]["cached_tokens"] == 160 and chunks[-1]["usage"]["cached_tokens"] == 160
        assert prefill.pulled_tokens == 160 and prefill.pull_failures == 0 and prefill.stats.prefill_tokens == 3


async def test_a_prefill_leg_cancelled_while_pulling_ends_at_once() -> None:
    async with mesh() as m, ChannelCache() as channels:
        # The peer's host tier restores at 1 MB/s in real time: 2 s a block.
        peer = mocker(
            num_gpu_blocks=50, context_length=720, kv_host_bytes=200 * 16 * 131072, kv_host_bandwidth=0.001, speedup_ratio=1.0
        )
        prefill = mocker()
        peer_worker = await m.worker(peer, instance_id="peer")
        await m.worker(prefill, role="prefill", instance_id="p")
        client = WorkerClient(channels, peer_worker.address)
        document = doc(1000, 40)
        for rid, tokens in (("warm", document), ("evict", doc(20_000, 40))):
            await collect(client.generate(request(rid, tokens, max_tokens=1)))
        hashes = block_hashes(document, 16)
        assert any(peer.blocks.holder(h) == KvTier.HOST for h in hashes) and all(
            peer.blocks.holder(h) is not None for h in hashes
        )
        ctx = Context("c")
        leg = prefill_leg("c", document + [1], peer_worker.address, 40)
        task = asyncio.ensure_future(collect(prefill.generate(leg, ctx)))
        ctx.stop()  # the pull has seconds to go
        chunks = await asyncio.wait_for(task, 2.0)
        assert chunks[-1]["finish_reason"] == "cancelled" and prefill.pulled_tokens == 0 and prefill.pull_failures == 0
        assert not prefill.scheduler.waiting and not prefill.scheduler.running

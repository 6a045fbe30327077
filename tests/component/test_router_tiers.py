"""Lower KV tiers end to end: workers that report host and disk tiers, a real router, the Route explanation.

The workers are mockers whose sink also reports lower tiers the way a
tiered engine does (`EngineSink.blocks_stored(..., tier=)`, `LoadMetrics.tiers`);
what they keep there is set by the test. Everything between them and the
decision is real: the worker's sink and `GetKvSnapshot`, the event plane,
the router's feed, index and cost.

Locks: a prefix a worker keeps on disk from before the router started
reaches the index through the snapshot and draws the document to it over an
empty worker, with the tier, the advertised restore time and the restore
term in the explanation; host-tier events reach a running router; a device
hit beats the same prefix in another worker's host memory; a worker whose
tier restores slower than the router measured a prefill block to take loses
to an empty worker, and a worker with a fast tier wins; `Router.Route` over
gRPC names, per candidate, its device blocks, the blocks of each lower tier
(each counted in the nearest tier holding it), the advertised restore time,
the restore term and the evict ratio; a decode worker that can restore the
prompt from its own host tier prefills it locally (no remote prefill).
"""

from __future__ import annotations

from typing import Any

import pytest
from test_router_support import PLANE, collect, mesh, mocker, request, wait_for

from meshllm.engine.base import EngineConfig, KvTier, LoadMetrics, TierUsage
from meshllm.engine.mocker import MockerEngine
from meshllm.protocol.kv import stored_blocks
from meshllm.router.client import RouterClient
from meshllm.router.config import RouterConfig
from meshllm.router.core import RouterCore
from meshllm.router.main import RouterServer
from meshllm.router.policy.timing import DEFAULT_RESTORE_RATIO
from meshllm.testing.conformance.kit import TierSink
from meshllm.v1 import discovery_pb2, events_pb2

HOST, DISK = events_pb2.KV_TIER_HOST, events_pb2.KV_TIER_DISK
BLOCK_BYTES = 1_000_000


def tiered(restore_bytes_per_s: float, **kw: Any) -> MockerEngine:
    """A mocker that reports a host and a disk tier restoring at `restore_bytes_per_s` (blocks of 1 MB)."""
    engine = mocker(**kw)
    bw = restore_bytes_per_s
    tiers = [TierUsage(t, 0, 0, 1 << 30, block_bytes=BLOCK_BYTES, restore_bytes_per_s=bw) for t in (KvTier.HOST, KvTier.DISK)]
    start = engine.start

    async def start_tiered(worker_id: str) -> EngineConfig:
        cfg = await start(worker_id)
        engine.sink = TierSink(engine.sink, tiers)  # type: ignore[assignment]
        engine.sink.load(LoadMetrics(0, cfg.total_kv_blocks, 0, 0))
        return cfg

    engine.start = start_tiered  # type: ignore[method-assign]
    return engine


def keep(engine: MockerEngine, tokens: list[int], tier: KvTier) -> None:
    """The engine reports the prompt's full blocks as held in `tier` (as after evicting them there)."""
    engine.sink.blocks_stored(stored_blocks(tokens, 16), None, tier=tier)


def doc(first: int, blocks: int) -> list[int]:
    return list(range(first, first + 16 * blocks))


def tiers_known(core: RouterCore, worker: str) -> bool:
    return seen_tiers(core, worker) == 2


def seen_tiers(core: RouterCore, worker: str) -> int | None:
    """Tiers in the worker's latest load report at the router (None: no report yet)."""
    rep = core.load.get((worker, 0)).reported
    return None if rep is None else len(rep.tiers)


async def test_a_prefix_kept_on_disk_before_the_router_started_draws_its_document() -> None:
    async with mesh() as m:
        a = tiered(restore_bytes_per_s=1e9)
        await m.worker(a, instance_id="a")
        await m.worker(mocker(), instance_id="b")
        document = doc(1000, 40)
        keep(a, document, KvTier.DISK)  # e.g. a worker restarted on its disk directory
        core = await m.router()  # its index comes from the workers' snapshots
        assert core.index.lower_blocks("a", DISK) == 40 and core.index.worker_blocks("a") == 0
        await wait_for(lambda: tiers_known(core, "a"), what="a's load snapshot with tiers")
        d = await core.route("mocker", document)
        by_id = {c.worker_id: c for c in d.candidates}
        assert d.worker_id == "a"
        (disk,) = by_id["a"].lower_tiers
        assert disk.tier == DISK and disk.blocks == 40
        assert disk.restore_ms_per_block == pytest.approx(1.0)  # 1 MB at 1 GB/s
        assert d.prefill_ms_per_block == 0 and disk.restore_ratio == DEFAULT_RESTORE_RATIO[DISK]  # not measured yet
        assert by_id["a"].overlap_blocks == 0 and by_id["a"].prefill_tokens == 0 and by_id["a"].new_blocks == 40
        assert by_id["a"].restore_blocks == pytest.approx(40 * DEFAULT_RESTORE_RATIO[DISK])
        assert not by_id["b"].lower_tiers and by_id["b"].restore_blocks == 0 and by_id["b"].prefill_tokens == 640
        assert by_id["a"].cost < by_id["b"].cost


async def test_host_tier_events_reach_a_running_router_and_a_device_hit_beats_a_host_copy() -> None:
    async with mesh() as m:
        a = tiered(restore_bytes_per_s=1e9)
        await m.worker(a, instance_id="a")
        await m.worker(mocker(), instance_id="b")
        core = await m.router()
        shared, only_a = doc(1000, 30), doc(5000, 30)
        await collect(core.generate(request("warm", shared, max_tokens=1, routing={"backend_instance_id": "b"})))
        keep(a, shared, KvTier.HOST)
        keep(a, only_a, KvTier.HOST)
        await wait_for(
            lambda: core.index.worker_blocks("b") >= 30 and core.index.lower_blocks("a", HOST) == 60,
            what="b's device events and a's host events",
        )
        d = await core.route("mocker", shared)
        by_id = {c.worker_id: c for c in d.candidates}
        assert d.worker_id == "b" and by_id["b"].overlap_blocks == 30 and not by_id["b"].lower_tiers
        assert [(t.tier, t.blocks) for t in by_id["a"].lower_tiers] == [(HOST, 30)]
        d = await core.route("mocker", only_a + doc(9000, 2))  # 30 blocks in a's host memory, 2 new
        by_id = {c.worker_id: c for c in d.candidates}
        assert d.worker_id == "a" and by_id["a"].prefill_tokens == 32 and by_id["a"].new_blocks == 32
        # the dashboard's record of a routed request shows the same terms
        await collect(core.generate(request("r", only_a, max_tokens=1)))
        (last,) = core.metrics.recent.decisions(1)
        (ca,) = [c for c in last["candidates"] if c["worker_id"] == "a"]
        assert last["worker_id"] == "a" and ca["lower_tiers"][0]["tier"] == "host" and ca["lower_tiers"][0]["blocks"] == 30


async def test_a_tier_restoring_slower_than_computing_is_not_worth_it() -> None:
    async with mesh() as m:
        slow, fast = tiered(restore_bytes_per_s=1e7), tiered(restore_bytes_per_s=1e10)  # 100 ms and 0.1 ms a block
        await m.worker(slow, instance_id="slow")
        await m.worker(fast, instance_id="fast")
        await m.worker(mocker(), instance_id="empty")
        core = await m.router()
        for n in (64, 128, 256, 512, 1024):  # the router measured 1 ms per prefill token: 16 ms a block
            core.times.prefill("mocker", n, 5.0 + n)
        document = doc(1000, 20)
        keep(slow, document, KvTier.HOST)
        keep(fast, document, KvTier.HOST)
        await wait_for(
            lambda: all(core.index.lower_blocks(w, HOST) == 20 and tiers_known(core, w) for w in ("slow", "fast")),
            what="both tiered workers' host events and load",
            state=lambda: {w: (core.index.lower_blocks(w, HOST), seen_tiers(core, w)) for w in ("slow", "fast")},
        )
        d = await core.route("mocker", document)
        by_id = {c.worker_id: c for c in d.candidates}
        assert d.prefill_ms_per_block == pytest.approx(16.0)
        assert by_id["slow"].lower_tiers[0].restore_ratio == pytest.approx(100.0 / 16.0)
        assert by_id["fast"].lower_tiers[0].restore_ratio == pytest.approx(0.1 / 16.0)
        assert d.worker_id == "fast"
        d = await core.route("mocker", document, {"allowed_worker_ids": ["slow", "empty"]})
        by_id = {c.worker_id: c for c in d.candidates}
        assert d.worker_id == "empty" and by_id["slow"].cost > by_id["empty"].cost


async def test_route_over_grpc_shows_the_tier_of_every_overlap() -> None:
    async with mesh() as m:
        a = tiered(restore_bytes_per_s=2e9)
        await m.worker(a, instance_id="a")
        await m.worker(mocker(), instance_id="b")
        server = await RouterServer.start(RouterConfig(plane=PLANE), memory_store=m.store, memory_broker=m.broker)
        try:
            core = server.core
            assert core is not None
            await core.pool.wait_until(lambda: len(core.pool.all()) == 2)
            await core.feed.wait_synced(10.0)
            client = RouterClient(m.channels, server.address)
            document = doc(1000, 35) + [7, 7, 7, 7, 7]
            warm = request("warm", document[: 16 * 10], max_tokens=1, routing={"backend_instance_id": "a"})
            await collect(client.generate(warm))
            keep(a, document[: 16 * 30], KvTier.HOST)  # blocks 0-29 in host memory (0-9 also on the device)
            keep(a, document[: 16 * 35], KvTier.DISK)  # blocks 0-34 on disk
            await wait_for(
                lambda: (
                    core.index.worker_blocks("a") >= 10 and core.index.lower_blocks("a", DISK) == 35 and tiers_known(core, "a")
                ),
                what="a's device, host and disk blocks and its tiers",
                state=lambda: {
                    "device": core.index.worker_blocks("a"),
                    "host": core.index.lower_blocks("a", HOST),
                    "disk": core.index.lower_blocks("a", DISK),
                    "load": core.load.get(("a", 0)).reported,
                    "index_event": core.index.last_event_id("a"),
                    "worker_event": a.sink.inner.last_event_id,  # type: ignore[attr-defined]
                },
            )
            d = await client.route("mocker", document)
            by_id = {c.worker_id: c for c in d.candidates}
            ca = by_id["a"]
            assert d.worker_id == "a" and ca.overlap_blocks == 10
            assert [(t.tier, t.blocks) for t in ca.lower_tiers] == [(HOST, 20), (DISK, 5)]  # each block from the nearest tier
            assert all(t.restore_ms_per_block == pytest.approx(0.5) for t in ca.lower_tiers)
            assert ca.restore_blocks == pytest.approx(20 * DEFAULT_RESTORE_RATIO[HOST] + 5 * DEFAULT_RESTORE_RATIO[DISK])
            assert ca.prefill_tokens == 5 and ca.new_blocks == 25  # the restored blocks take device room
            assert ca.evict_ratio == pytest.approx(DEFAULT_RESTORE_RATIO[HOST])  # evicted blocks would go to host
            assert by_id["b"].evict_ratio == 1.0 and not by_id["b"].lower_tiers and by_id["b"].prefill_tokens == len(document)
            listed = {w.worker_id: w for w in (await client.list_workers("mocker")).workers}
            assert [(t.tier, t.blocks) for t in listed["a"].indexed_lower_tiers] == [(HOST, 30), (DISK, 35)]
            assert listed["a"].indexed_blocks >= 10 and not listed["b"].indexed_lower_tiers
        finally:
            await server.aclose()


async def test_a_decode_worker_that_restores_the_prompt_from_its_own_host_tier_prefills_locally() -> None:
    async with mesh() as m:
        dec = tiered(restore_bytes_per_s=2e9)
        await m.worker(mocker(), role="prefill", instance_id="p")
        await m.worker(dec, role="decode", instance_id="d")
        core = await m.router()
        held, fresh = doc(1000, 20), doc(5000, 20)
        keep(dec, held, KvTier.HOST)
        await wait_for(lambda: core.index.lower_blocks("d", HOST) == 20, what="d's host events")
        # the decode worker restores the whole prompt: no remote prefill, the decision is the decode pool's
        d = await core.route("mocker", held)
        assert d.role == discovery_pb2.WORKER_ROLE_DECODE and d.worker_id == "d"
        assert [(t.tier, t.blocks) for t in d.candidates[0].lower_tiers] == [(HOST, 20)]
        # a prompt it holds nowhere is prefilled remotely
        d = await core.route("mocker", fresh)
        assert d.role == discovery_pb2.WORKER_ROLE_PREFILL and d.worker_id == "p"

"""Lower KV tiers over real etcd and nats-server: tiered KV events and load snapshots reach the router's decision.

Locks: a worker (registered in etcd) that reports a prefix kept in host
memory — `BlocksStored` with `tier = HOST` on NATS, after the router synced,
and load snapshots carrying `KvTierUsage` — draws that prefix over an empty
worker, and the decision (`RouterCore.route`: the `RouteDecision` the Route
RPC returns) names the tier, the blocks and the advertised restore time;
`BlocksRemoved` with `tier = HOST` on NATS takes it out of the index again.
"""

from __future__ import annotations

import pytest

import meshllm.plane.backends  # noqa: F401  (registers the etcd and NATS openers)
from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.engine.base import EngineConfig, KvTier, LoadMetrics, TierUsage
from meshllm.engine.mocker import MockerConfig, MockerEngine
from meshllm.engine.worker_config import WorkerConfig
from meshllm.plane.discovery.base import open_discovery
from meshllm.plane.events.base import open_events
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.kv import block_hashes, stored_blocks
from meshllm.router.config import RouterConfig
from meshllm.router.core import RouterCore
from meshllm.testing.conformance.kit import TierSink
from meshllm.testing.servers import EtcdServer, NatsServer
from meshllm.testing.waiting import wait_until
from meshllm.v1 import events_pb2
from meshllm.worker.runtime import Worker

pytestmark = pytest.mark.integration

# the workers' host tier: 1 MB blocks restored at 2 GB/s
HOST_TIER = (TierUsage(KvTier.HOST, 0, 0, 1 << 30, block_bytes=1_000_000, restore_bytes_per_s=2e9),)


class TieredMocker(MockerEngine):
    async def start(self, worker_id: str) -> EngineConfig:
        cfg = await super().start(worker_id)
        self.sink = TierSink(self.sink, HOST_TIER)
        self.sink.load(LoadMetrics(0, cfg.total_kv_blocks, 0, 0))
        return cfg


async def test_host_tier_events_over_nats_draw_the_prefix_and_route_shows_the_tier() -> None:
    prompt = list(range(100, 100 + 16 * 24))
    async with EtcdServer() as etcd, NatsServer() as nats, ChannelCache() as channels:
        plane = PlaneConfig(
            discovery=DiscoveryKind.ETCD, etcd_endpoints=(etcd.endpoint,), lease_ttl_s=3,
            events=EventsKind.NATS, nats_url=nats.url,
        )  # fmt: skip
        mk = MockerConfig(block_size=16, num_gpu_blocks=1024, speedup_ratio=20.0)
        tiered = TieredMocker(mk)
        workers = [
            await Worker.start(tiered, WorkerConfig(engine="mocker", plane=plane, instance_id="a", grace_period_s=0.0)),
            await Worker.start(MockerEngine(mk), WorkerConfig(engine="mocker", plane=plane, instance_id="b", grace_period_s=0.0)),
        ]  # fmt: skip
        discovery = await open_discovery(plane)
        bus = await open_events(plane, name="router")
        core = RouterCore(RouterConfig(plane=plane), discovery, bus, channels)
        try:
            await core.start()
            await core.pool.wait_until(lambda: len(core.pool.all()) == 2, 20.0)
            await core.feed.wait_synced(20.0)
            tiered.sink.blocks_stored(stored_blocks(prompt, 16), None, tier=KvTier.HOST)  # over NATS now

            def advertised() -> bool:
                rep = core.load.get(("a", 0)).reported
                return core.index.lower_blocks("a", events_pb2.KV_TIER_HOST) == 24 and rep is not None and len(rep.tiers) == 1

            await wait_until(advertised, timeout_s=20.0, what="a's host-tier events and load over NATS")
            d = await core.route("mocker", prompt)
            by_id = {c.worker_id: c for c in d.candidates}
            assert d.worker_id == "a"
            (host,) = by_id["a"].lower_tiers
            assert host.tier == events_pb2.KV_TIER_HOST and host.blocks == 24
            assert host.restore_ms_per_block == pytest.approx(0.5)
            assert by_id["a"].overlap_blocks == 0 and by_id["a"].restore_blocks > 0 and by_id["a"].prefill_tokens == 0
            # the host copy leaves: nothing of the prompt is held anywhere
            tiered.sink.blocks_removed(block_hashes(prompt, 16), tier=KvTier.HOST)
            await wait_until(lambda: not core.index.lower_blocks("a", events_pb2.KV_TIER_HOST), timeout_s=20.0)
            d = await core.route("mocker", prompt)
            assert all(not c.lower_tiers and c.restore_blocks == 0 and c.prefill_tokens == len(prompt) for c in d.candidates)
        finally:
            await core.aclose()
            await bus.aclose()
            await discovery.aclose()
            for w in workers:
                await w.aclose()

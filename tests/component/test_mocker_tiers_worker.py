"""A tiered mocker inside a real worker (gRPC server, memory planes): the KV events it emits keep the
WorkerSink's per-tier snapshot (Worker.GetKvSnapshot) and its published load equal to the engine's tiers."""

from __future__ import annotations

import asyncio
import random

from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.engine.base import KvTier
from meshllm.engine.mocker import MockerConfig, MockerEngine
from meshllm.engine.worker_config import WorkerConfig
from meshllm.plane.discovery.base import MemoryStore
from meshllm.plane.events.base import MemoryBroker, MemoryEventBus
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.names import load_subject
from meshllm.v1 import events_pb2
from meshllm.worker.client import WorkerClient
from meshllm.worker.runtime import Worker

PLANE = PlaneConfig(discovery=DiscoveryKind.MEMORY, events=EventsKind.MEMORY)
BS = 4
TIERED = MockerConfig(
    speedup_ratio=0.0, block_size=BS, num_gpu_blocks=24, watermark=0.0, context_length=64,
    kv_bytes_per_token=8, kv_host_bytes=10 * BS * 8, kv_disk_bytes=12 * BS * 8,
)  # fmt: skip


def snapshot_tiers(snap: object) -> dict[KvTier, set[int]]:
    rank = snap.ranks[0]  # type: ignore[attr-defined]
    out = {KvTier.DEVICE: set(rank.block_hashes), KvTier.HOST: set(), KvTier.DISK: set()}
    for t in rank.lower_tiers:
        out[KvTier(t.tier)] = set(t.block_hashes)
    return out


def engine_tiers(engine: MockerEngine) -> dict[KvTier, set[int]]:
    out = {KvTier.DEVICE: set(engine.blocks._by_hash)}
    out.update((t.tier, set(t.hashes())) for t in engine.blocks.tiers)
    return out


async def test_worker_snapshot_and_load_follow_the_mocker_tiers_through_evictions_and_restores() -> None:
    """Locks: after traffic that evicts through HOST into DISK and restores from both, GetKvSnapshot's device
    blocks and lower_tiers equal the engine's tiers, and the published load's tiers equal its usage."""
    store, broker = MemoryStore(), MemoryBroker()
    engine = MockerEngine(TIERED)
    cfg = WorkerConfig(engine="mocker", plane=PLANE, grace_period_s=0.0, instance_id="w0", health_check_interval_s=3600)
    async with MemoryEventBus(broker) as bus:
        loads = await bus.subscribe(load_subject("meshllm", "worker"), events_pb2.LoadSnapshot)
        async with await Worker.start(engine, cfg, memory_store=store, memory_broker=broker) as w, ChannelCache() as ch:
            client = WorkerClient(ch, w.address)
            rng = random.Random(1)  # 7 prompts of 6 blocks revisited in a seeded order: hits in every tier
            prompts = [[1000 * p + k for k in range(6 * BS + 1)] for p in (rng.randrange(7) for _ in range(30))]

            async def one(i: int) -> int:
                rid = f"r{i}"
                request = {"request_id": rid, "token_ids": prompts[i], "stop": {"max_tokens": 3, "ignore_eos": True}}
                chunks = [c async for c in client.generate(request)]  # type: ignore[arg-type]
                return chunks[-1]["usage"]["cached_tokens"]

            cached = [await one(i) for i in range(len(prompts))]
            assert engine.stats.host_hit_tokens > 0 and engine.stats.disk_hit_tokens > 0  # both tiers restored
            assert sum(cached) == engine.stats.cached_tokens
            snap = await client.get_kv_snapshot()
            assert snapshot_tiers(snap) == engine_tiers(engine)
            assert {KvTier(t.tier) for t in snap.ranks[0].lower_tiers} == {KvTier.HOST, KvTier.DISK}
            want = [(int(u.tier), u.blocks, u.bytes_used, u.bytes_capacity, u.block_bytes) for u in engine.blocks.tier_usage()]
            async with asyncio.timeout(10):
                async for msg in loads:
                    got = [(t.tier, t.blocks, t.bytes_used, t.bytes_capacity, t.block_bytes) for t in msg.tiers]
                    if got == want:
                        break
            assert all(t.bytes_used <= t.bytes_capacity for t in msg.tiers)

"""Two router replicas over real etcd and nats-server agree on per-worker load (RouterSyncBatch over NATS).

Locks: with mocker workers registered in etcd and publishing on NATS, two
RouterCores each routing half the traffic hold per-worker active-block
views that differ by < 10 % (the median sample, and all samples together:
Σ|a − b| / Σ max(a, b)), each having received the other's sync events over
NATS (and each lists the other as a peer); their KV indexes match the workers' block sets once the load is gone.
A sample taken while a sync event is in transit differs by that request's
blocks: the bound is on agreement, not on propagation delay.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import AsyncIterator

import pytest

import meshllm.plane.backends  # noqa: F401  (registers the etcd and NATS openers)
from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.engine.mocker import MockerConfig, MockerEngine
from meshllm.engine.worker_config import WorkerConfig
from meshllm.plane.discovery.base import open_discovery
from meshllm.plane.events.base import open_events
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.types import TokenChunk
from meshllm.router.config import RouterConfig
from meshllm.router.core import RouterCore
from meshllm.testing.servers import EtcdServer, NatsServer
from meshllm.testing.waiting import wait_until
from meshllm.worker.runtime import Worker

pytestmark = pytest.mark.integration


async def drain(stream: AsyncIterator[TokenChunk]) -> None:
    async for _ in stream:
        pass


async def test_two_replicas_over_nats_agree_on_active_blocks() -> None:
    async with EtcdServer() as etcd, NatsServer() as nats, ChannelCache() as channels:
        plane = PlaneConfig(
            discovery=DiscoveryKind.ETCD, etcd_endpoints=(etcd.endpoint,), lease_ttl_s=3,
            events=EventsKind.NATS, nats_url=nats.url,
        )  # fmt: skip
        workers = []
        cores: list[RouterCore] = []
        closers = []
        try:
            for i in range(2):
                engine = MockerEngine(MockerConfig(block_size=16, num_gpu_blocks=4096, speedup_ratio=5.0))
                cfg = WorkerConfig(engine="mocker", plane=plane, instance_id=f"w{i}", grace_period_s=0.0)
                workers.append(await Worker.start(engine, cfg))
            for rid in ("replica-1", "replica-2"):
                discovery = await open_discovery(plane)
                bus = await open_events(plane, name=rid)
                core = RouterCore(RouterConfig(plane=plane, router_id=rid), discovery, bus, channels)
                await core.start()
                cores.append(core)
                closers += [core.aclose, bus.aclose, discovery.aclose]
            for core in cores:
                await core.pool.wait_until(lambda c=core: len(c.pool.all()) == 2, 20.0)  # type: ignore[misc]
                await core.feed.wait_synced(20.0)
            stop = asyncio.Event()
            done = 0

            async def client(core: RouterCore, seed: int) -> None:
                nonlocal done
                rng = random.Random(seed)
                n = 0
                while not stop.is_set():
                    n += 1
                    prompt = [rng.randrange(3, 30000) for _ in range(rng.randrange(64, 400))]
                    req = {"request_id": f"{core.id}-{seed}-{n}", "model": "mocker", "token_ids": prompt,
                           "stop": {"max_tokens": rng.randrange(8, 48), "ignore_eos": True}}  # fmt: skip
                    await drain(core.generate(req))  # type: ignore[arg-type]
                    done += 1

            tasks = [asyncio.create_task(client(c, s)) for c in cores for s in range(5)]
            diffs: list[float] = []
            pairs: list[tuple[int, int]] = []
            try:
                await wait_until(lambda: done >= 20, timeout_s=60, what="traffic through both replicas")
                for _ in range(60):
                    await asyncio.sleep(0.03)  # sampling interval of the observation
                    # compare what both replicas have applied, not what one has queued (in-process skew)
                    await wait_until(lambda: all(c.sync.pending == 0 and c.feed.pending == 0 for c in cores), timeout_s=10)
                    v1 = {w.worker_id: w.active_blocks for w in cores[0].list_workers().workers}
                    v2 = {w.worker_id: w.active_blocks for w in cores[1].list_workers().workers}
                    for wid, a in v1.items():
                        b = v2.get(wid, 0)
                        if max(a, b) >= 20:
                            diffs.append(abs(a - b) / max(a, b))
                            pairs.append((a, b))
            finally:
                stop.set()
                await asyncio.gather(*tasks)
            assert cores[0].sync.received > 0 and cores[1].sync.received > 0
            # each heard the other's presence over NATS (that is what lets it publish its charges)
            assert cores[0].sync.peers == ["replica-2"] and cores[1].sync.peers == ["replica-1"]
            assert len(diffs) >= 20, "too few loaded samples"
            overall = sum(abs(a - b) for a, b in pairs) / sum(max(a, b) for a, b in pairs)
            p90 = sorted(diffs)[int(0.9 * len(diffs))]
            assert statistics.median(diffs) < 0.10 and overall < 0.10, (statistics.median(diffs), overall, p90)

            def indexes_match() -> bool:
                return all(
                    c.index.worker_blocks(w.id) == (w.sink.block_count() if w.sink else -1) for c in cores for w in workers
                )

            await wait_until(indexes_match, timeout_s=20, what="both KV indexes to match the workers over NATS")
        finally:
            for close in reversed(closers):
                await close()
            for w in workers:
                await w.aclose()

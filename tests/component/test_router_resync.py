"""KV index resync with in-process mocker workers: router start, event gaps, lagging index, restart under load.

Locks: a router started after the workers rebuilds its index from
`Worker.GetKvSnapshot`; a gap in a worker's event ids triggers a snapshot
that repairs the index; an index that stays behind a load snapshot's
last_event_id is resynced; restarting the router under load rebuilds the
index from snapshots and the prefix hit rate recovers within 5 s.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from test_router_support import collect, mesh, mocker, request, wait_for

from meshllm.plane.events.base import MemoryEventBus
from meshllm.protocol.names import kv_subject, load_subject
from meshllm.router.core import RouterCore
from meshllm.router.kv import feed as feed_module
from meshllm.v1 import events_pb2
from meshllm.worker.runtime import Worker


def prefix(group: int, n: int = 256) -> list[int]:
    rng = random.Random(group)
    return [rng.randrange(3, 30000) for _ in range(n)]


def index_matches_worker(core: RouterCore, w: Worker) -> bool:
    assert w.sink is not None
    return core.index.worker_blocks(w.id) == w.sink.block_count() and not core.index.syncing(w.id)


async def test_a_router_started_after_the_workers_rebuilds_its_index_from_snapshots() -> None:
    async with mesh() as m:
        a = await m.worker(mocker(), instance_id="a")
        b = await m.worker(mocker(), instance_id="b")
        warm = await m.router()
        await collect(warm.generate(request("x", prefix(1), max_tokens=2, model="mocker", routing={"backend_instance_id": "a"})))
        await collect(warm.generate(request("y", prefix(2), max_tokens=2, model="mocker", routing={"backend_instance_id": "b"})))
        core = await m.router()  # starts now: everything it knows comes from snapshots
        assert index_matches_worker(core, a) and index_matches_worker(core, b)
        assert core.index.worker_blocks("a") >= 16
        d = await core.route("mocker", prefix(2))
        assert d.worker_id == "b" and max(c.overlap_blocks for c in d.candidates) == 16
        assert core.metrics.resyncs._value.get() >= 2


async def test_an_event_id_gap_triggers_a_snapshot_that_repairs_the_index() -> None:
    async with mesh() as m:
        a = await m.worker(mocker(), instance_id="a")
        core = await m.router()
        await collect(core.generate(request("x", prefix(1), max_tokens=2, model="mocker")))
        await wait_for(lambda: index_matches_worker(core, a), what="the index to follow a's events")
        resyncs = core.metrics.resyncs._value.get()
        # a batch that skips ids (events lost in transit) with a block the worker does not hold
        bogus = events_pb2.KvEventBatch(worker_id="a")
        assert a.sink is not None
        ev = bogus.events.add(event_id=a.sink.last_event_id + 5)
        ev.stored.blocks.add(block_hash=12345)
        async with MemoryEventBus(m.broker) as bus:
            bus.publish(kv_subject("meshllm", "worker"), bogus)
        await wait_for(lambda: core.metrics.resyncs._value.get() > resyncs, what="a resync")
        await wait_for(lambda: index_matches_worker(core, a), what="the repaired index")
        assert core.index.overlaps([12345], [("a", 0)]) == {}
        # the worker's later events apply on top of the snapshot
        await collect(core.generate(request("y", prefix(2), max_tokens=2, model="mocker")))
        await wait_for(lambda: index_matches_worker(core, a) and core.index.worker_blocks("a") >= 32, what="new events")


async def test_an_index_behind_the_load_snapshots_event_id_is_resynced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(feed_module, "BEHIND_GRACE_S", 0.0)
    async with mesh() as m:
        a = await m.worker(mocker(), instance_id="a")
        core = await m.router()
        resyncs = core.metrics.resyncs._value.get()
        assert a.sink is not None
        ahead = events_pb2.LoadSnapshot(worker_id="a", total_blocks=2048, last_event_id=a.sink.last_event_id + 3)
        async with MemoryEventBus(m.broker) as bus:
            bus.publish(load_subject("meshllm", "worker"), ahead)
            bus.publish(load_subject("meshllm", "worker"), ahead)
        await wait_for(lambda: core.metrics.resyncs._value.get() > resyncs, what="a resync of the lagging index")


async def test_restarting_the_router_under_load_recovers_the_hit_rate_within_5_s() -> None:
    async with mesh() as m:
        workers = [await m.worker(mocker(num_gpu_blocks=1024), instance_id=f"w{i}") for i in range(4)]
        router = await m.router()
        current = [router]
        groups = [prefix(g) for g in range(8)]
        results: list[tuple[float, int, int]] = []  # (start time, prompt tokens, cached tokens)
        stop = asyncio.Event()

        async def load(seed: int) -> None:
            rng = random.Random(seed)
            n = 0
            while not stop.is_set():
                n += 1
                prompt = [*rng.choice(groups), *[rng.randrange(3, 30000) for _ in range(16)]]
                t0 = time.monotonic()
                try:
                    chunks = await collect(current[0].generate(request(f"l{seed}-{n}", prompt, max_tokens=4, model="mocker")))
                except Exception:
                    await asyncio.sleep(0.01)  # raced the restart (old router gone, new one not watching yet): retry
                    continue
                usage = chunks[-1]["usage"]
                results.append((t0, usage["prompt_tokens"], usage["cached_tokens"]))

        tasks = [asyncio.create_task(load(s)) for s in range(4)]
        try:

            def recent_rate() -> float:
                warm = results[-60:]
                return sum(c for _, _, c in warm) / sum(p for _, p, _ in warm)

            # Warm: the last 60 requests hit above 80 % (while the router copies groups to idle workers, to save
            # the wait behind busy ones, the first requests miss more).
            await wait_for(lambda: len(results) >= 120 and recent_rate() > 0.8, 30.0, "warm-up traffic")
            warm_rate = recent_rate()
            await m.close_router(router)
            restart = time.monotonic()
            # the new router takes traffic at once, before its snapshots are in
            current[0] = await m.router(wait_synced=False)
            await wait_for(lambda: len([r for r in results if r[0] >= restart]) >= 80, 30.0, "post-restart traffic")
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        after = sorted(r for r in results if r[0] >= restart)
        window = 20
        recovered_at = next(
            after[i][0]
            for i in range(len(after) - window + 1)
            if sum(c for _, _, c in after[i : i + window]) / sum(p for _, p, _ in after[i : i + window]) >= 0.9 * warm_rate
        )
        assert recovered_at - restart < 5.0
        # and the index it routes with was rebuilt from the workers' snapshots
        new = current[0]
        await new.feed.wait_synced(10.0)
        await wait_for(lambda: all(index_matches_worker(new, w) for w in workers), what="the rebuilt index to match")
        assert new.metrics.resyncs._value.get() >= 4

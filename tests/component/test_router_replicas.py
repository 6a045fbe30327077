"""Two router replicas under the same load agree on each worker's active blocks (RouterSyncEvent).

Locks: route / prefill-done / complete decisions of one replica are applied
by the other at the times their replica made them, so once both have applied
the same events and snapshots their per-worker active-block views are equal
while both route concurrently, whichever order things arrived in (a stall of
the machine may still age a snapshot past plausibility: the bounds leave 5 %);
once the load is gone no charge is left.
"""

from __future__ import annotations

import asyncio
import random
import statistics

from test_router_support import collect, mesh, mocker, request, wait_for

from meshllm.router.core import RouterCore


def views(core: RouterCore) -> dict[str, int]:
    return {w.worker_id: w.active_blocks for w in core.list_workers().workers}


async def test_two_replicas_under_the_same_load_agree_on_active_blocks() -> None:
    async with mesh() as m:
        for i in range(3):
            await m.worker(mocker(speedup_ratio=5.0, num_gpu_blocks=4096), instance_id=f"w{i}")
        r1 = await m.router(router_id="replica-1")
        r2 = await m.router(router_id="replica-2")
        stop = asyncio.Event()
        done = 0

        async def client(core: RouterCore, seed: int) -> None:
            nonlocal done
            rng = random.Random(seed)
            n = 0
            while not stop.is_set():
                n += 1
                prompt = [rng.randrange(3, 30000) for _ in range(rng.randrange(64, 512))]
                req = request(f"{core.id}-{seed}-{n}", prompt, max_tokens=rng.randrange(8, 64), model="mocker")
                await collect(core.generate(req))
                done += 1

        tasks = [asyncio.create_task(client(r, s)) for r in (r1, r2) for s in range(6)]
        diffs: list[float] = []
        pairs: list[tuple[int, int]] = []
        try:
            await wait_for(lambda: done >= 10, 30.0, "traffic on both replicas")
            for _ in range(60):
                await asyncio.sleep(0.02)  # sampling interval of the observation, not a synchronisation
                # compare what both replicas have published and applied, not what one has batched or queued (in-process skew)
                await wait_for(
                    lambda: all(c.sync.pending == 0 and c.sync.unpublished == 0 and c.feed.pending == 0 for c in (r1, r2)),
                    10.0,
                )
                v1, v2 = views(r1), views(r2)
                for wid, a in v1.items():
                    b = v2.get(wid, 0)
                    if max(a, b) >= 20:
                        diffs.append(abs(a - b) / max(a, b))
                        pairs.append((a, b))
            assert r1.sync.received > 0 and r2.sync.received > 0
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        assert len(diffs) >= 30, "too few loaded samples"
        overall = sum(abs(a - b) for a, b in pairs) / sum(max(a, b) for a, b in pairs)
        p90 = sorted(diffs)[int(0.9 * len(diffs))]
        assert statistics.median(diffs) == 0 and overall < 0.05 and p90 < 0.05, (
            statistics.median(diffs),
            overall,
            p90,
            sorted(pairs, key=lambda p: -abs(p[0] - p[1]) / max(p))[:12],
        )
        # with the load gone, no charge is left on either replica
        await wait_for(lambda: r1.load.charges() == 0 and r2.load.charges() == 0, 10.0, "charges to drain")

"""A fleet of 256 simulated workers (bench/fleet.py's), two RouterCore replicas: decisions independent of timing.

The workers' KV event streams (Mooncake-shaped rows: a shared first block,
sessions sharing prefixes across the workers of a copy) fill every cache;
the replicas apply them in different cross-worker orders, as NATS delivers
a fleet's streams (each worker's own order kept). With the same load
snapshots and charges on both, every prompt must go to the same worker on
both replicas, and on each to the worker the exhaustive scorer picks. No
timing is asserted: bench/fleet.py measures it.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from meshllm.router.core import RouterCore
from meshllm.router.workers import AGGREGATED
from meshllm.v1 import events_pb2

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from bench_support import load_bench

MODEL = load_bench("fleet_procs").MODEL  # the model the simulated fleet registers

WORKERS = 256
BLOCKS = 256


def rows(rng: random.Random, n: int) -> list[list[int]]:
    """Mooncake-shaped rows: id 0 first (the system prompt), then a session's prefix, then the turn's own ids."""
    sessions = [[rng.randrange(1, 50_000) for _ in range(rng.randrange(2, 12))] for _ in range(n // 4)]
    return [[0, *rng.choice(sessions), *(rng.randrange(50_000, 900_000) for _ in range(rng.randrange(1, 8)))] for _ in range(n)]


def replica(fleet: object, workers: list[object], stream: list[tuple[bytes, int]]) -> RouterCore:
    core: RouterCore = fleet.in_process_core(workers, BLOCKS)  # type: ignore[attr-defined]
    for data, _ in stream:
        assert not core.index.apply_batch(events_pb2.KvEventBatch.FromString(data))
    return core


def test_256_workers_two_replicas_agree_with_each_other_and_with_the_exhaustive_scorer() -> None:
    fleet = load_bench("fleet")
    rng = random.Random(39)
    trace = rows(rng, 2000)
    shared = fleet.shared_ids(trace, fleet.SHARED_SHARE)
    chains = fleet.BlockChains(fleet.TraceScale(tokens_per_block=fleet.BLOCK_SIZE))
    workers = [fleet.SimWorker(f"w{i:04d}", i // fleet.WORKERS_PER_COPY) for i in range(WORKERS)]
    for w in workers:
        w.fill(trace, shared, chains, BLOCKS, random.Random(w.id))
    in_order = fleet.interleave(workers)
    by_worker = [b for w in reversed(workers) for b in w.batches]  # another cross-worker order, each worker's kept
    a, b = replica(fleet, workers, in_order), replica(fleet, workers, by_worker)
    # the fleet path, not the small-pool one
    assert a.candidates.fleet and a.candidates.table(MODEL, AGGREGATED) is not None
    now = time.time()
    for w in workers:
        snap = events_pb2.LoadSnapshot(worker_id=w.id, active_blocks=rng.randrange(BLOCKS), total_blocks=BLOCKS)
        a.load.apply_snapshot(snap, now=now)
        b.load.apply_snapshot(snap, now=now)
    decided = 0
    for i in range(150):
        if i % 4 == 3:
            tokens = [rng.randrange(1000, 32000) for _ in range(16 * rng.randrange(2, 20))]
        else:
            copy = rng.randrange(WORKERS // fleet.WORKERS_PER_COPY)
            tokens = chains.tokens(fleet.renamed(rng.choice(trace), copy, shared))
        plans = [core.plan(MODEL, tokens, {}, set()) for core in (a, b)]
        assert plans[0].main.chosen.key == plans[1].main.chosen.key, f"prompt {i}: the replicas disagree"
        a.candidates.fleet = False
        reference = a.plan(MODEL, tokens, {}, set())
        a.candidates.fleet = True
        assert reference.main.chosen.key == plans[0].main.chosen.key, f"prompt {i}: fleet path ≠ exhaustive scorer"
        assert len(plans[0].main.candidates) < len(reference.main.candidates) == WORKERS
        # Both replicas charge the request where it went (as replica sync does), so later decisions see the load.
        for core in (a, b):
            core.load.route("r", f"q{i}", plans[0].main.chosen.key, prefill_tokens=len(tokens), blocks=len(tokens) // 16, now=now)
            if i % 3 == 0:
                core.load.complete("r", f"q{i - 3}", now=now)
        decided += 1
    assert decided == 150

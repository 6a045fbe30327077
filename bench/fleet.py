"""Benchmark kv routing for a fleet: N simulated workers, real nats-server and etcd, two real `meshllm router`s.

    .venv/bin/python bench/fleet.py --workers 256 --json out.json       # one fleet size; prints its figures
    .venv/bin/python bench/fleet.py --report a.json b.json c.json       # the docs/benchmarks.md section from runs

Setup: etcd and nats-server as real processes; two `meshllm router`
replicas (`--router-mode kv`, worker health checks off); in this process,
N simulated workers, each registered in etcd (Instance and ModelCard:
block size 16, `--blocks` blocks) with a gRPC server of its own that
answers `Worker.GetKvSnapshot` from its simulated cache.

KV event streams from the Mooncake conversation trace
(../shared/traces/mooncake/, README there): one hash id = one 16-token
block (the trace's 512). Hash ids that at least `SHARED_SHARE` of the rows
hold (the system prompt) are the same on every worker; every other id is
renamed per *copy* of the trace, one copy per `WORKERS_PER_COPY` workers,
so prefixes repeat across a few workers the way a kv router spreads a
session's turns, and the fleet's caches are not all one trace. Each worker
draws rows (seeded) from the trace and stores the blocks it does not hold
— one `stored` event per row with its parent hash, up to 8 events per
batch, as the worker sink publishes them — until its cache holds exactly
`--blocks` blocks: full caches.

Measured:
- *ingestion*: every batch published through nats-server (in rounds: the
  publisher waits while the slower replica lags by more than `LAG_WINDOW`
  block-events, so the router is fed as fast as it applies without NATS
  dropping a slow consumer); block-events/s = all block-events / the time
  from the first publish until both replicas' `meshllm_router_kv_events_applied`
  reached the total.
- *memory*: the first replica's RSS after the fill minus before, over the
  indexed (worker, block) pairs (ListWorkers' indexed blocks).
- *load*: every worker publishes one LoadSnapshot with up to half its
  cache active (seeded), so decisions weigh load as well as overlap.
- *decision*: the whole `kv` decision (hash + `RouterCore.plan`) in this
  process, on a RouterCore whose index applied the same batches and whose
  load the same snapshots, for prompts from trace rows of random copies
  (most match a worker's prefix) and fresh prompts; the first
  `--exhaustive` of them also scored over every worker (the scorer before
  ISSUE 39), the share choosing the same worker; and `Router.Route` round
  trips to the first replica (gRPC and protobuf on both sides included),
  which must choose as the in-process core does.
- *Dynamo*: with `dynamo._core` importable (bench/fleet_dynamo.py run by
  Dynamo's venv), its RadixTree applies the same stored events and
  `find_matches` runs beside our walk on the same prompts: the decision's
  own walk (`BlockMap.overlap_groups` over the pool's slot mask), and the
  same walk answering {worker: depth} (`KvIndex.overlaps`) as
  `find_matches` answers.
- *resync, one worker*: the worker's next batch skips an event id; time
  until the replica's `meshllm_router_kv_resyncs` counts its snapshot.
- *resync, all*: nats-server stopped; every worker stores and evicts
  blocks meanwhile (events lost); nats-server started again on its port;
  once both replicas have subscribed again (nats-server's /subsz; their
  reconnect wait is in the figure, `resubscribed_s` of it), each worker
  publishes its next batch (a gap); time from the restart until both
  replicas have resynced every worker (snapshots fetched from the
  workers' gRPC servers, built beforehand as each real worker builds its
  own).
- *replica agreement*: the same prompts routed by both replicas: the share
  choosing the same worker; and whether both index the same blocks per worker.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from fleet_inproc import dynamo_python, dynamo_side_by_side, hot_share, in_process_core, measure_in_process, spread_reuse
from fleet_mesh import through_processes
from fleet_procs import log
from fleet_report import render, summary, verdicts
from fleet_sim import (
    BLOCK_SIZE,
    SHARED_SHARE,
    TRACE,
    WORKERS_PER_COPY,
    BlockChains,
    Fleet,
    SimWorker,
    interleave,
    read_rows,
    renamed,
    shared_ids,
)
from harness.doc import publish
from harness.runinfo import LoadMonitor

from meshllm.bench.trace import TraceScale
from meshllm.v1 import events_pb2


def build_fleet(args: argparse.Namespace) -> Fleet:
    """The workers' event streams from the trace, the prompts to decide and each worker's load."""
    rng = random.Random(args.seed)
    rows = read_rows(Path(args.trace))
    shared = shared_ids(rows, SHARED_SHARE)
    chains = BlockChains(TraceScale(tokens_per_block=BLOCK_SIZE, seed=args.seed))
    t0 = time.perf_counter()
    workers = [SimWorker(f"w{i:05d}", i // WORKERS_PER_COPY) for i in range(args.workers)]
    for w in workers:
        w.fill(rows, shared, chains, args.blocks, random.Random(f"{args.seed}:{w.id}"))
    total_events = sum(w.block_events for w in workers)
    log(
        f"streams built in {time.perf_counter() - t0:.1f}s: {total_events:,} block-events, "
        f"{sum(len(w.batches) for w in workers):,} batches"
    )
    prompts = []
    for i in range(args.decisions):
        if i % 4 == 3:  # a prompt no worker holds beyond the shared system prompt
            prompts.append([rng.randrange(1000, 32000) for _ in range(BLOCK_SIZE * rng.randrange(8, 64))])
        else:  # a trace row of a random copy: most of it cached on some worker of that copy
            copy = rng.randrange(max(1, args.workers // WORKERS_PER_COPY))
            prompts.append(chains.tokens(renamed(rows[rng.randrange(len(rows))], copy, shared)))
    stream = interleave(workers)
    for w in workers:
        w.batches = []
    # Each worker's load: a LoadSnapshot with some of its cache active (up to half), so the decision weighs load.
    loads = [
        events_pb2.LoadSnapshot(
            worker_id=w.id, active_blocks=rng.randrange(args.blocks // 2), total_blocks=args.blocks,
            running=rng.randrange(1, 16), last_event_id=w.event_id,
        )
        for w in workers
    ]  # fmt: skip
    out: dict[str, Any] = {"workers": args.workers, "blocks_per_worker": args.blocks, "shared_ids": len(shared)}
    return Fleet(args, chains, workers, total_events, prompts, stream, loads, out)


def in_process(f: Fleet) -> None:
    """The decision in this process, on an index fed the same events (the router's own cost, no gRPC); Dynamo's
    RadixTree beside the walk; with `--reuse`, the decision again with reused blocks in every eviction order."""
    args, out = f.args, f.out
    core = in_process_core(f.workers, args.blocks)
    t = time.perf_counter()
    for data, _ in f.stream:
        core.index.apply_batch(events_pb2.KvEventBatch.FromString(data))
    out["in_process_events_per_s"] = f.total_events / (time.perf_counter() - t)
    for snap in f.loads:
        core.load.apply_snapshot(snap, now=time.time())
    times, same, f.local_choice = measure_in_process(core, f.prompts, args.exhaustive)
    out["scored_in_process"] = summary(times.pop("scored"))
    out.update({f"{name}_ms": summary(values) for name, values in times.items() if values})
    out["exhaustive_agreement"] = same
    log(f"in process: decision p50 {out['decision_ms']['p50']:.3f} p99 {out['decision_ms']['p99']:.3f} ms; "
        f"exhaustive p50 {out.get('exhaustive_ms', {}).get('p50', 0):.1f} ms, same choice {same:.3f}")  # fmt: skip
    py = dynamo_python() if args.dynamo else None
    if py is None:
        out["dynamo"] = "not run" if not args.dynamo else "dynamo._core.RadixTree not importable"
    else:
        out["dynamo"] = dynamo_side_by_side(core, f.workers, [d for d, _ in f.stream], f.prompts, py)
        log(f"dynamo: {out['dynamo']}")
    if args.reuse:
        spread_reuse(core, f.workers, random.Random(f"{args.seed}:reuse"))
        times, same, _ = measure_in_process(core, f.prompts, args.exhaustive)
        out["reused"] = {"scored": summary(times.pop("scored")), "exhaustive_agreement": same, "hot_share": hot_share(core)}
        out["reused"].update({f"{name}_ms": summary(values) for name, values in times.items() if values})
        log(f"with reused blocks: {out['reused']}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    f = build_fleet(args)
    in_process(f)
    gc.collect()
    if args.in_process_only:
        f.out["targets"] = {}
        return f.out
    await through_processes(f)
    f.out["targets"] = verdicts(f.out)
    return f.out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=16_384, help="resident blocks per worker (full caches)")
    parser.add_argument("--decisions", type=int, default=400, help="Route calls timed")
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exhaustive", type=int, default=100, help="prompts also decided by scoring every worker")
    parser.add_argument("--no-dynamo", dest="dynamo", action="store_false", help="skip Dynamo's RadixTree side by side")
    parser.add_argument("--reuse", action="store_true", help="also decide with reused blocks spread through every cache")
    parser.add_argument("--in-process-only", action="store_true", help="skip the processes (no NATS, no routers)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--no-exact-lag", dest="exact_lag", action="store_false", help="publish without waiting on lag")
    parser.add_argument("--report", nargs="*", default=None, help="render the docs section from these JSON files")
    parser.add_argument("--write", action="store_true", help="with --report: update docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.report is not None:
        results = [json.loads(Path(p).read_text()) for p in args.report]
        publish("## Fleet routing", render(sorted(results, key=lambda r: r["workers"])), write=args.write)
        return 0
    with LoadMonitor() as monitor:
        result = asyncio.run(run(args))
    result["load"] = list(monitor.samples)
    result["pid"] = os.getpid()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

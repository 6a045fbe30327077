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
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet_inproc import dynamo_python, dynamo_side_by_side, hot_share, in_process_core, measure_in_process, spread_reuse
from fleet_procs import (
    MODEL,
    MonitoredNats,
    Replica,
    _at_least,
    _connected,
    _lag_ok,
    _loads_seen,
    _subscribed,
    _workers_seen,
    log,
    rss_bytes,
    start_router,
    until,
)
from fleet_report import render, summary, verdicts
from fleet_sim import (
    BLOCK_SIZE,
    COPY_STRIDE,
    SHARED_SHARE,
    TRACE,
    WORKERS_PER_COPY,
    BlockChains,
    SimWorker,
    SnapshotServers,
    interleave,
    read_rows,
    renamed,
    shared_ids,
)
from harness.doc import publish
from harness.runinfo import LoadMonitor

from meshllm.bench.trace import TraceScale
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.names import kv_subject, load_subject
from meshllm.router.client import RouterClient
from meshllm.testing.servers import EtcdServer
from meshllm.v1 import discovery_pb2, events_pb2, worker_pb2

NAMESPACE = "meshllm"


@dataclass
class Fleet:
    """One run's simulated fleet and what it measured so far (`out`)."""

    args: argparse.Namespace
    chains: BlockChains
    workers: list[SimWorker]
    total_events: int
    prompts: list[list[int]]
    stream: list[tuple[bytes, int]]  # every batch, round-robin across workers (serialized, block-events)
    loads: list[events_pb2.LoadSnapshot]
    out: dict[str, Any]
    local_choice: list[str] = field(default_factory=list)  # the in-process decision per prompt


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


@dataclass
class Mesh:
    """The real processes of a run: etcd, nats-server, the publisher's NATS client, the two router replicas."""

    etcd: EtcdServer
    nats: MonitoredNats
    channels: ChannelCache
    nc: Any
    replicas: list[Replica] = field(default_factory=list)


async def through_processes(f: Fleet) -> None:
    """Register the fleet, start two routers, then ingestion, memory, decisions and resyncs through them."""
    async with EtcdServer() as etcd, MonitoredNats() as nats, ChannelCache() as channels:
        servers = SnapshotServers()
        from meshllm.plane.discovery.etcd import EtcdDiscovery

        # A lease that outlives the loop stalls of building 1,024 snapshots (a lost lease would empty the pools).
        discovery = await EtcdDiscovery.connect([etcd.endpoint], NAMESPACE, lease_ttl_s=3600)
        import nats as nats_client

        async def quiet(exc: Exception) -> None:  # the outage below is on purpose
            pass

        nc = await nats_client.connect(
            nats.url, max_reconnect_attempts=-1, reconnect_time_wait=0.05, pending_size=512 << 20, error_cb=quiet
        )
        mesh = Mesh(etcd, nats, channels, nc)
        try:
            await register(f, servers, discovery)
            mesh.replicas = [await start_router(etcd, nats, f"fleet-{i}") for i in range(2)]
            for rep in mesh.replicas:
                client = RouterClient(channels, rep.address)
                await until(lambda c=client: _workers_seen(c, f.args.workers), 120, "the pool")
                await until(lambda r=rep: _at_least(r, "meshllm_router_kv_resyncs_total", f.args.workers), 120, "initial syncs")
            gc.collect()
            rss0 = rss_bytes(mesh.replicas[0].proc.proc.pid)
            await ingest(f, mesh)
            await memory(f, mesh, rss0)
            await decide(f, mesh)
            await resync(f, mesh)
        finally:
            for rep in mesh.replicas:
                await rep.proc.stop()
            await nc.close()
            await discovery.aclose()
            await servers.aclose()


async def register(f: Fleet, servers: SnapshotServers, discovery: Any) -> None:
    """Each simulated worker: its snapshot server, its model card and instance in etcd."""
    for w in f.workers:
        w.snapshot = worker_pb2.KvSnapshot(worker_id=w.id, last_event_id=0).SerializeToString()  # events fill it
        address = await servers.start(w)
        card = discovery_pb2.ModelCard(name=MODEL, kv_block_size=BLOCK_SIZE, instance_id=w.id, context_length=1 << 20)
        card.runtime_limits.total_kv_blocks = f.args.blocks
        await discovery.register_model(card)
        await discovery.register_instance(
            discovery_pb2.Instance(
                id=w.id, namespace=NAMESPACE, component="worker", endpoint="generate", address=address,
                role=discovery_pb2.WORKER_ROLE_AGGREGATED, model=MODEL, dp_size=1,
            )
        )  # fmt: skip


async def ingest(f: Fleet, mesh: Mesh) -> None:
    """Every batch through nats-server; block-events/s until both replicas applied them all."""
    args, out, replicas, nc, stream, total_events = f.args, f.out, mesh.replicas, mesh.nc, f.stream, f.total_events
    subject = kv_subject(NAMESPACE, "worker")
    # ---- ingestion
    sent = 0
    t_pub = time.perf_counter()
    offsets = [await r.value("meshllm_router_kv_events_applied_total") for r in replicas]
    for i, (data, n) in enumerate(stream):
        await nc.publish(subject, data)
        sent += n
        if i % 2000 == 1999:
            await nc.flush()
            if args.exact_lag:
                await until(lambda s=sent: _lag_ok(replicas, offsets, s), 600, "the routers to catch up", 0.05)
    await nc.flush()
    published_s = time.perf_counter() - t_pub
    for rep, off in zip(replicas, offsets, strict=True):
        await until(
            lambda r=rep, o=off: _at_least(r, "meshllm_router_kv_events_applied_total", o + total_events),
            900,
            "ingestion",
            0.01,
        )
    ingest_s = time.perf_counter() - t_pub
    out["events"] = total_events
    out["events_per_s"] = total_events / ingest_s
    out["publish_s"] = published_s
    out["ingest_s"] = ingest_s
    gaps = [await r.value("meshllm_router_kv_resyncs_total") - args.workers for r in replicas]
    out["resyncs_during_fill"] = gaps
    log(
        f"ingested {total_events:,} block-events in {ingest_s:.1f}s ({out['events_per_s']:,.0f}/s; "
        f"published in {published_s:.1f}s)"
    )


async def memory(f: Fleet, mesh: Mesh, rss0: int) -> None:
    """Router RSS growth per indexed (worker, block) pair."""
    out, replicas, channels = f.out, mesh.replicas, mesh.channels
    # ---- memory
    lw = await RouterClient(channels, replicas[0].address).list_workers(MODEL)
    pairs = sum(x.indexed_blocks for x in lw.workers)
    rss1 = rss_bytes(replicas[0].proc.proc.pid)
    out["pairs"] = pairs
    out["router_rss_mb"] = rss1 / 2**20
    out["bytes_per_pair"] = (rss1 - rss0) / max(pairs, 1)
    log(f"{pairs:,} pairs indexed; router RSS {rss0 / 2**20:,.0f} → {rss1 / 2**20:,.0f} MB: {out['bytes_per_pair']:.0f} B/pair")


async def decide(f: Fleet, mesh: Mesh) -> None:
    """The same loads, then decisions through `Router.Route` on both replicas."""
    out, replicas, channels, nc, prompts, loads, local_choice = (
        f.out, mesh.replicas, mesh.channels, mesh.nc, f.prompts, f.loads, f.local_choice
    )  # fmt: skip
    # ---- the same loads, then decisions through Router.Route
    for snap in loads:
        snap.timestamp_ms = int(time.time() * 1000)
        await nc.publish(load_subject(NAMESPACE, "worker"), snap.SerializeToString())
    await nc.flush()
    want = {snap.worker_id: snap.active_blocks for snap in loads}
    for rep in replicas:
        await until(lambda r=rep: _loads_seen(channels, r, want), 120, "the load snapshots", 0.05)
    clients = [RouterClient(channels, r.address) for r in replicas]
    for p in prompts[:20]:  # warm the channels and the fleet tables
        await clients[0].route(MODEL, p)
    lat, chosen, scored = [], [], []
    for p in prompts:
        t = time.perf_counter()
        d = await clients[0].route(MODEL, p)
        lat.append((time.perf_counter() - t) * 1000)
        chosen.append(d.worker_id)
        scored.append(len(d.candidates))
    other = [(await clients[1].route(MODEL, p)).worker_id for p in prompts]
    out["route_rpc_ms"] = summary(lat)
    out["router_matches_in_process"] = sum(a == b for a, b in zip(chosen, local_choice, strict=True)) / len(prompts)
    out["decisions"] = len(lat)
    out["candidates_scored_median"] = statistics.median(scored)
    out["replica_agreement"] = sum(a == b for a, b in zip(chosen, other, strict=True)) / len(prompts)
    lw, lw1 = await clients[0].list_workers(MODEL), await clients[1].list_workers(MODEL)
    out["replica_same_index"] = {x.worker_id: x.indexed_blocks for x in lw.workers} == {
        x.worker_id: x.indexed_blocks for x in lw1.workers
    }
    log(
        f"Route p50 {out['route_rpc_ms']['p50']:.3f} ms, p99 {out['route_rpc_ms']['p99']:.3f} ms; "
        f"agreement {out['replica_agreement']:.3f}"
    )


async def resync(f: Fleet, mesh: Mesh) -> None:
    """One worker's gap, then a NATS outage that every worker's next batch shows."""
    args, out, replicas, nc, nats, workers, chains = f.args, f.out, mesh.replicas, mesh.nc, mesh.nats, f.workers, f.chains
    subject = kv_subject(NAMESPACE, "worker")
    clients = [RouterClient(mesh.channels, r.address) for r in replicas]
    # ---- resync one worker: its next batch skips an event id
    w0 = workers[0]
    before = await replicas[0].value("meshllm_router_kv_resyncs_total")
    w0.event_id += 1  # lost
    w0.churn(64, chains.chain([COPY_STRIDE * 999_999 + k for k in range(64)]))
    w0.build_snapshot()
    t = time.perf_counter()
    await nc.publish(subject, w0.batches.pop()[0])
    await nc.flush()
    await until(lambda: _at_least(replicas[0], "meshllm_router_kv_resyncs_total", before + 1), 60, "one resync", 0.002)
    out["resync_one_s"] = time.perf_counter() - t
    # ---- NATS outage: every worker's events meanwhile are lost
    before = [await r.value("meshllm_router_kv_resyncs_total") for r in replicas]
    subs = await nats.subscriptions()
    await nats.stop()
    for k, w in enumerate(workers):
        w.event_id += 1  # an event published into the outage
        w.churn(16, chains.chain([COPY_STRIDE * 999_998 - k * 64 + j for j in range(16)]))
        w.build_snapshot()  # built beforehand, as each real worker builds its own
    t = time.perf_counter()
    await nats.start()
    # Once both replicas have subscribed again, each worker's next batch shows its gap.
    await until(_connected(nc), 60, "the publisher's reconnect", 0.01)
    await until(lambda: _subscribed(nats, subs), 60, "the routers' subscriptions", 0.01)
    out["resubscribed_s"] = time.perf_counter() - t
    for w in workers:
        await nc.publish(subject, w.batches.pop()[0])
    await nc.flush()
    for rep, b in zip(replicas, before, strict=True):
        await until(
            lambda r=rep, n=b: _at_least(r, "meshllm_router_kv_resyncs_total", n + args.workers), 600, "all resyncs", 0.01
        )
    out["resync_all_s"] = time.perf_counter() - t
    lw = await clients[0].list_workers(MODEL)
    out["resynced_exact"] = all(x.indexed_blocks == args.blocks for x in lw.workers)
    log(f"resync one {out['resync_one_s'] * 1000:.0f} ms, all {out['resync_all_s']:.2f} s")


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

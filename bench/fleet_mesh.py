"""bench/fleet.py through real processes: the fleet registered in etcd, two `meshllm router` replicas, then
ingestion, memory, decisions and resyncs measured through them (see bench/fleet.py's docstring)."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

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
from fleet_report import summary
from fleet_sim import BLOCK_SIZE, COPY_STRIDE, Fleet, SnapshotServers
from harness.cpu import process_seconds

from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.names import kv_subject, load_subject
from meshllm.router.client import RouterClient
from meshllm.testing.servers import EtcdServer
from meshllm.v1 import discovery_pb2, worker_pb2

__all__ = ["through_processes"]

NAMESPACE = "meshllm"


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
    offsets = [await r.value("meshllm_router_kv_events_applied_total") for r in replicas]
    cpu0 = [process_seconds(r.proc.proc.pid) for r in replicas]
    t_pub = time.perf_counter()
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
    # What one router core ingests: this machine runs both replicas, nats-server and the publisher on its cores.
    cpu = [process_seconds(r.proc.proc.pid) - c for r, c in zip(replicas, cpu0, strict=True)]
    out["router_cpu_s"] = cpu
    out["events_per_router_cpu_s"] = total_events / max(max(cpu), 1e-9)
    out["events"] = total_events
    out["events_per_s"] = total_events / ingest_s
    out["publish_s"] = published_s
    out["ingest_s"] = ingest_s
    gaps = [await r.value("meshllm_router_kv_resyncs_total") - args.workers for r in replicas]
    out["resyncs_during_fill"] = gaps
    log(
        f"ingested {total_events:,} block-events in {ingest_s:.1f}s ({out['events_per_s']:,.0f}/s; "
        f"published in {published_s:.1f}s; router CPU {' / '.join(f'{c:.1f}' for c in cpu)} s, "
        f"{out['events_per_router_cpu_s']:,.0f} per router CPU-second)"
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

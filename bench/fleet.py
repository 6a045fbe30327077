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
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import orjson
from harness.doc import publish
from harness.runinfo import LoadMonitor, load_sentence, machine, today
from harness.stats import pct

from meshllm.bench.trace import TraceScale, hash_id_tokens
from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.plane.discovery.base import MemoryDiscovery, MemoryStore
from meshllm.plane.events.base import MemoryBroker, MemoryEventBus
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.kv import block_hashes, chain_hash, stored_blocks, tokens_hash
from meshllm.protocol.names import kv_subject, load_subject
from meshllm.router.client import RouterClient
from meshllm.router.config import RouterConfig
from meshllm.router.core import RouterCore
from meshllm.router.policy.fleet import bit_indices
from meshllm.router.workers import AGGREGATED, PoolWorker
from meshllm.testing.mesh import metric, scrape
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.servers import EtcdServer, NatsServer, free_port
from meshllm.v1 import discovery_pb2, events_pb2, worker_pb2

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
BLOCK_SIZE = 16
MODEL = "fleet"
NAMESPACE = "meshllm"
SHARED_SHARE = 0.01  # hash ids held by at least this share of trace rows are the same on every worker
WORKERS_PER_COPY = 8
COPY_STRIDE = 10_000_000  # renamed id = copy * COPY_STRIDE + trace id (trace ids are far below it)
EVENTS_PER_BATCH = 8
DYN_HEAD = struct.Struct("<IIBQI")  # bench/fleet_dynamo.py's event records
DYN_PAIR = struct.Struct("<QQ")
LAG_WINDOW = 500_000  # block-events a replica may lag before the publisher waits
TARGETS = {"decision_p99_ms": 1.0, "events_per_s": 1_000_000, "bytes_per_pair": 100, "resync_all_s": 10.0}


# ---------------------------------------------------------------------------------------------- pure helpers
def read_rows(path: Path, limit: int | None = None) -> list[list[int]]:
    """The hash ids of each trace row."""
    rows = []
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                rows.append(orjson.loads(line)["hash_ids"])
                if limit is not None and len(rows) >= limit:
                    break
    return rows


def shared_ids(rows: Sequence[Sequence[int]], share: float) -> set[int]:
    """Hash ids that at least `share` of the rows hold (counted once per row)."""
    counts: Counter[int] = Counter()
    for ids in rows:
        counts.update(set(ids))
    need = share * len(rows)
    return {h for h, n in counts.items() if n >= need}


def renamed(ids: Iterable[int], copy: int, shared: set[int]) -> list[int]:
    """A row's ids in one copy of the trace: shared ids as they are, the others moved to the copy's range."""
    base = copy * COPY_STRIDE
    return [h if h in shared else base + h for h in ids]


def summary(values: Sequence[float]) -> dict[str, float]:
    """p50 / p90 / p99 of `values`."""
    return {f"p{p}": pct(values, p) for p in (50, 90, 99)}


class BlockChains:
    """Chained (block hash, tokens hash) of renamed hash ids, one 16-token block each, memoised."""

    def __init__(self, scale: TraceScale) -> None:
        self.scale = scale
        self._tokens_hash: dict[int, int] = {}

    def tokens(self, ids: Sequence[int]) -> list[int]:
        """The prompt whose blocks are `ids` (what a Route request sends)."""
        return [t for h in ids for t in hash_id_tokens(h, self.scale)]

    def chain(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        out = []
        parent: int | None = None
        memo = self._tokens_hash
        for h in ids:
            th = memo.get(h)
            if th is None:
                th = memo[h] = tokens_hash(hash_id_tokens(h, self.scale))
            parent = chain_hash(parent, th)
            out.append((parent, th))
        return out


@dataclass
class SimWorker:
    """One simulated worker: its cache (block hash → tokens hash, oldest first) and its event stream."""

    id: str
    copy: int
    cache: dict[int, int] = field(default_factory=dict)
    event_id: int = 0
    batches: list[tuple[bytes, int]] = field(default_factory=list)  # (serialized KvEventBatch, its block-events)
    block_events: int = 0  # block-events made so far
    snapshot: bytes = b""

    def fill(
        self, rows: Sequence[Sequence[int]], shared: set[int], chains: BlockChains, capacity: int, rng: random.Random
    ) -> None:
        """Store rows' blocks (rows drawn at random) until the cache holds exactly `capacity` blocks."""
        batch = events_pb2.KvEventBatch(worker_id=self.id)
        guard = 0
        while len(self.cache) < capacity:
            guard += 1
            if guard > 100 * capacity:
                raise RuntimeError(f"{self.id}: the trace cannot fill {capacity} blocks")
            blocks = chains.chain(renamed(rows[rng.randrange(len(rows))], self.copy, shared))
            first = next((i for i, (bh, _) in enumerate(blocks) if bh not in self.cache), None)
            if first is None:
                continue
            new = blocks[first : first + capacity - len(self.cache)]
            self._stored(batch, new, blocks[first - 1][0] if first else None)
            if len(batch.events) >= EVENTS_PER_BATCH:
                self._flush(batch)
                batch = events_pb2.KvEventBatch(worker_id=self.id)
        self._flush(batch)

    def churn(self, n: int, fresh: Iterable[tuple[int, int]]) -> None:
        """Evict the `n` oldest blocks and store `n` fresh ones (one removed and one stored event)."""
        batch = events_pb2.KvEventBatch(worker_id=self.id)
        gone = list(self.cache)[:n]
        for h in gone:
            del self.cache[h]
        self.event_id += 1
        batch.events.add(event_id=self.event_id).removed.block_hashes.extend(gone)
        self.block_events += len(gone)
        self._stored(batch, list(fresh)[:n], None)
        self._flush(batch)

    def _stored(self, batch: events_pb2.KvEventBatch, new: Sequence[tuple[int, int]], parent: int | None) -> None:
        self.event_id += 1
        ev = batch.events.add(event_id=self.event_id)
        if parent is not None:
            ev.stored.parent_hash = parent
        ev.stored.blocks.extend(events_pb2.StoredBlock(block_hash=bh, tokens_hash=th) for bh, th in new)
        for bh, th in new:
            self.cache[bh] = th
        self.block_events += len(new)

    def _flush(self, batch: events_pb2.KvEventBatch) -> None:
        if batch.events:
            n = sum(len(ev.stored.blocks) + len(ev.removed.block_hashes) for ev in batch.events)
            self.batches.append((batch.SerializeToString(), n))

    def build_snapshot(self) -> None:
        """`Worker.GetKvSnapshot`'s answer for the cache as it is now."""
        snap = worker_pb2.KvSnapshot(worker_id=self.id, last_event_id=self.event_id)
        snap.ranks.add(dp_rank=0).blocks.extend(
            events_pb2.StoredBlock(block_hash=bh, tokens_hash=th) for bh, th in self.cache.items()
        )
        self.snapshot = snap.SerializeToString()


def interleave(workers: Sequence[SimWorker]) -> list[tuple[bytes, int]]:
    """Every worker's pending batches, round-robin across workers (a fleet publishes at once), each worker in order."""
    out = []
    depth = max((len(w.batches) for w in workers), default=0)
    for i in range(depth):
        out.extend(w.batches[i] for w in workers if i < len(w.batches))
    return out


def verdicts(r: dict[str, Any]) -> dict[str, bool]:
    """Each target of ISSUE 39: met or not."""
    return {
        "decision_p99_ms": r["decision_ms"]["p99"] <= TARGETS["decision_p99_ms"],
        "events_per_s": r["events_per_s"] >= TARGETS["events_per_s"],
        "bytes_per_pair": r["bytes_per_pair"] <= TARGETS["bytes_per_pair"],
        "resync_all_s": r["resync_all_s"] <= TARGETS["resync_all_s"],
    }


# ---------------------------------------------------------------------------------------------- the processes
class SnapshotServers:
    """One gRPC server per simulated worker, answering `Worker.GetKvSnapshot` with its prebuilt snapshot."""

    def __init__(self) -> None:
        self.servers: list[grpc.aio.Server] = []

    async def start(self, worker: SimWorker) -> str:
        async def get(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            return worker.snapshot

        handler = grpc.method_handlers_generic_handler(
            "meshllm.v1.Worker",
            {"GetKvSnapshot": grpc.unary_unary_rpc_method_handler(get, request_deserializer=None, response_serializer=None)},
        )
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 256 << 20)])
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self.servers.append(server)
        return f"127.0.0.1:{port}"

    async def aclose(self) -> None:
        await asyncio.gather(*(s.stop(None) for s in self.servers))


class MonitoredNats(NatsServer):
    """nats-server with its monitoring port on: `subscriptions()` tells when the routers have subscribed again."""

    def __init__(self) -> None:
        super().__init__()
        self.monitor_port = free_port()

    def _config(self) -> str:
        path = Path(super()._config())
        conf = json.loads(path.read_text())
        conf["http_port"] = self.monitor_port
        path.write_text(json.dumps(conf))
        return str(path)

    async def subscriptions(self) -> int:
        body = await scrape("127.0.0.1", self.monitor_port, "/subsz")
        try:
            return int(json.loads(body)["num_subscriptions"])
        except (ValueError, KeyError):
            return -1


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Replica:
    proc: MeshllmProcess
    address: str
    metrics_port: int

    async def value(self, name: str) -> float:
        return metric(await scrape("127.0.0.1", self.metrics_port), name)


async def start_router(etcd: EtcdServer, nats: NatsServer, rid: str) -> Replica:
    mport = free_port()
    proc = MeshllmProcess(
        "router", "--port", "0", "--metrics-port", str(mport), "--router-mode", "kv", "--router-id", rid,
        "--discovery", "etcd", "--etcd-endpoints", etcd.endpoint, "--nats-url", nats.url,
        "--worker-health-interval", "0",
    )  # fmt: skip
    return Replica(proc, await proc.address(60), mport)


async def until(predicate: Any, timeout_s: float, what: str, poll_s: float = 0.02) -> float:
    """Poll an async predicate until it holds; the seconds it took (a deadline, not a sleep)."""
    t0 = time.perf_counter()
    while not await predicate():
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(poll_s)
    return time.perf_counter() - t0


def dynamo_python() -> Path | None:
    """A Python whose `dynamo._core` has the RadixTree ($DYN_VENV, else the anchors' venvs under /tmp/meshllm-anchor)."""
    home = Path(os.environ.get("ANCHOR_HOME", "/tmp/meshllm-anchor"))
    venvs = [Path(os.environ["DYN_VENV"])] if os.environ.get("DYN_VENV") else [home / "dynvllm", home / "dyn"]
    for venv in venvs:
        py = venv / "bin" / "python"
        if py.exists() and subprocess.run([py, "-c", "from dynamo._core import RadixTree"], capture_output=True).returncode == 0:
            return py
    return None


def in_process_core(workers: Sequence[SimWorker], blocks: int) -> RouterCore:
    """A RouterCore of this process with the fleet as its pool (nothing started: its index is fed by hand)."""
    plane = PlaneConfig(discovery=DiscoveryKind.MEMORY, events=EventsKind.MEMORY)
    core = RouterCore(RouterConfig(plane=plane), MemoryDiscovery(MemoryStore()), MemoryEventBus(MemoryBroker()), ChannelCache())
    card = discovery_pb2.ModelCard(name=MODEL, kv_block_size=BLOCK_SIZE)
    card.runtime_limits.total_kv_blocks = blocks
    core.pool._update({w.id: PoolWorker(w.id, f"sim/{w.id}", AGGREGATED, MODEL, 1, card) for w in workers})
    for w in workers:
        core.index.add_worker(w.id)
        core.index.apply_snapshot(worker_pb2.KvSnapshot(worker_id=w.id, last_event_id=0))
    return core


def measure_in_process(
    core: RouterCore, prompts: Sequence[list[int]], exhaustive: int
) -> tuple[dict[str, list[float]], float, list[str]]:
    """Per prompt: the whole decision (hash + `plan`), the candidates it scored, the hash + walk alone; the exhaustive
    scorer on the first `exhaustive` prompts (its times, and the share of them where both choose the same worker);
    the fleet choices."""
    keys = [(w.id, 0) for w in core.pool.workers(MODEL, AGGREGATED)]
    for p in prompts[:10]:
        core.plan(MODEL, p, {}, set())
    times: dict[str, list[float]] = {"decision": [], "walk": [], "exhaustive": [], "scored": []}
    chosen = []
    gc.collect()
    for p in prompts:
        t = time.perf_counter()
        plan = core.plan(MODEL, p, {}, set())
        times["decision"].append((time.perf_counter() - t) * 1000)
        times["scored"].append(len(plan.main.candidates))
        chosen.append(plan.main.chosen.worker_id)
        t = time.perf_counter()
        core.index.overlaps(block_hashes(p, BLOCK_SIZE), keys)
        times["walk"].append((time.perf_counter() - t) * 1000)
    same = 0
    core.candidates.fleet = False
    for p, want in zip(prompts[:exhaustive], chosen, strict=False):
        t = time.perf_counter()
        plan = core.plan(MODEL, p, {}, set())
        times["exhaustive"].append((time.perf_counter() - t) * 1000)
        same += plan.main.chosen.worker_id == want
    core.candidates.fleet = True
    return times, same / max(1, min(exhaustive, len(prompts))), chosen


def spread_reuse(core: RouterCore, workers: Sequence[SimWorker], rng: random.Random) -> None:
    """Route every cached block again, in runs of 20 in random order, half the runs as reuses (bench/indexer.py's
    adversarial case): reused blocks end up all through every eviction order, so no bound is exact."""
    for w in workers:
        hashes = list(w.cache)
        starts = list(range(0, len(hashes), 20))
        rng.shuffle(starts)
        for i in starts:
            core.index.touch((w.id, 0), hashes[i : i + 20], reused=rng.random() < 0.5)


def hot_share(core: RouterCore) -> float:
    """Reused blocks among all indexed blocks."""
    return sum(core.index.map.hot) / max(1, sum(core.index.map.sizes))


def dynamo_side_by_side(
    core: RouterCore, workers: Sequence[SimWorker], stream_events: Sequence[bytes], prompts: Sequence[list[int]], py: Path
) -> dict[str, Any]:
    """Dynamo's RadixTree fed the same stored events, `find_matches` beside our walk on the same prompts."""
    tmp = Path(tempfile.mkdtemp(prefix="meshllm-fleet-dynamo-"))
    number = {w.id: i for i, w in enumerate(workers)}
    with (tmp / "events").open("wb") as f:
        for data in stream_events:
            batch = events_pb2.KvEventBatch.FromString(data)
            for ev in batch.events:
                st = ev.stored
                has = st.HasField("parent_hash")
                f.write(DYN_HEAD.pack(number[batch.worker_id], ev.event_id, has, st.parent_hash if has else 0, len(st.blocks)))
                f.write(b"".join(DYN_PAIR.pack(b.block_hash, b.tokens_hash) for b in st.blocks))
    keys = [(w.id, 0) for w in workers]
    ours, agree = [], 0
    with (tmp / "queries").open("wb") as f:
        for p in prompts:
            pairs = stored_blocks(p, BLOCK_SIZE)
            f.write(struct.pack("<I", len(pairs)) + struct.pack(f"<{len(pairs)}Q", *(th for _, th in pairs)))
    try:
        proc = subprocess.run([py, Path(__file__).with_name("fleet_dynamo.py"), tmp / "events", tmp / "queries", tmp / "out"],
                              capture_output=True, text=True, timeout=3600)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"fleet_dynamo.py failed: {proc.stderr[-2000:]}")
        theirs = json.loads((tmp / "out").read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the events file is ~16 bytes per block
    table = core.candidates.table(MODEL, AGGREGATED)
    assert table is not None
    bmap = core.index.map
    by_dict = []
    gc.collect()
    for p, scores in zip(prompts, theirs["scores"], strict=True):
        hashes = block_hashes(p, BLOCK_SIZE)
        t = time.perf_counter()
        groups = bmap.overlap_groups(hashes, table.mask)  # the decision's walk: depth groups of slot bits
        ours.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        got = core.index.overlaps(hashes, keys)  # the same walk answering {worker: depth}, as find_matches does
        by_dict.append((time.perf_counter() - t) * 1000)
        from_groups = {table.skeys[table.pos_of_slot[s]]: d for d, bits in groups for s in bit_indices(bits).tolist()}
        agree += from_groups == got and {str(number[k[0]]): d for k, d in got.items()} == scores
    return {
        "find_matches_ms": summary(theirs["ms"]),
        "walk_ms": summary(ours),
        "walk_dict_ms": summary(by_dict),
        "same_overlaps": agree / max(1, len(prompts)),
        "dynamo_apply_s": theirs["apply_s"],
        "dynamo_blocks": theirs["blocks"],
        "version": theirs.get("version", ""),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
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
    out: dict[str, Any] = {"workers": args.workers, "blocks_per_worker": args.blocks, "shared_ids": len(shared)}
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
    # ---- the decision in this process, on an index fed the same events (the router's own cost, no gRPC)
    core = in_process_core(workers, args.blocks)
    t = time.perf_counter()
    for data, _ in stream:
        core.index.apply_batch(events_pb2.KvEventBatch.FromString(data))
    out["in_process_events_per_s"] = total_events / (time.perf_counter() - t)
    for snap in loads:
        core.load.apply_snapshot(snap, now=time.time())
    times, same, local_choice = measure_in_process(core, prompts, args.exhaustive)
    out["scored_in_process"] = summary(times.pop("scored"))
    for name, values in times.items():
        if values:
            out[f"{name}_ms"] = summary(values)
    out["exhaustive_agreement"] = same
    log(f"in process: decision p50 {out['decision_ms']['p50']:.3f} p99 {out['decision_ms']['p99']:.3f} ms; "
        f"exhaustive p50 {out.get('exhaustive_ms', {}).get('p50', 0):.1f} ms, same choice {same:.3f}")  # fmt: skip
    py = dynamo_python() if args.dynamo else None
    if py is None:
        out["dynamo"] = "not run" if not args.dynamo else "dynamo._core.RadixTree not importable"
    else:
        out["dynamo"] = dynamo_side_by_side(core, workers, [d for d, _ in stream], prompts, py)
        log(f"dynamo: {out['dynamo']}")
    if args.reuse:
        spread_reuse(core, workers, random.Random(f"{args.seed}:reuse"))
        times, same, _ = measure_in_process(core, prompts, args.exhaustive)
        out["reused"] = {"scored": summary(times.pop("scored")), "exhaustive_agreement": same, "hot_share": hot_share(core)}
        out["reused"].update({f"{name}_ms": summary(values) for name, values in times.items() if values})
        log(f"with reused blocks: {out['reused']}")
    del core
    gc.collect()
    if args.in_process_only:
        out["targets"] = {}
        return out
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
        replicas: list[Replica] = []
        try:
            for w in workers:
                w.snapshot = worker_pb2.KvSnapshot(worker_id=w.id, last_event_id=0).SerializeToString()  # events fill it
                address = await servers.start(w)
                card = discovery_pb2.ModelCard(name=MODEL, kv_block_size=BLOCK_SIZE, instance_id=w.id, context_length=1 << 20)
                card.runtime_limits.total_kv_blocks = args.blocks
                await discovery.register_model(card)
                await discovery.register_instance(
                    discovery_pb2.Instance(
                        id=w.id, namespace=NAMESPACE, component="worker", endpoint="generate", address=address,
                        role=discovery_pb2.WORKER_ROLE_AGGREGATED, model=MODEL, dp_size=1,
                    )
                )  # fmt: skip
            replicas = [await start_router(etcd, nats, f"fleet-{i}") for i in range(2)]
            for rep in replicas:
                client = RouterClient(channels, rep.address)
                await until(lambda c=client: _workers_seen(c, args.workers), 120, "the pool")
                await until(lambda r=rep: _at_least(r, "meshllm_router_kv_resyncs_total", args.workers), 120, "initial syncs")
            gc.collect()
            rss0 = rss_bytes(replicas[0].proc.proc.pid)
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
            # ---- memory
            lw = await RouterClient(channels, replicas[0].address).list_workers(MODEL)
            pairs = sum(x.indexed_blocks for x in lw.workers)
            rss1 = rss_bytes(replicas[0].proc.proc.pid)
            out["pairs"] = pairs
            out["router_rss_mb"] = rss1 / 2**20
            out["bytes_per_pair"] = (rss1 - rss0) / max(pairs, 1)
            log(
                f"{pairs:,} pairs indexed; router RSS {rss0 / 2**20:,.0f} → {rss1 / 2**20:,.0f} MB: "
                f"{out['bytes_per_pair']:.0f} B/pair"
            )
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
            lw1 = await clients[1].list_workers(MODEL)
            out["replica_same_index"] = {x.worker_id: x.indexed_blocks for x in lw.workers} == {
                x.worker_id: x.indexed_blocks for x in lw1.workers
            }
            log(
                f"Route p50 {out['route_rpc_ms']['p50']:.3f} ms, p99 {out['route_rpc_ms']['p99']:.3f} ms; "
                f"agreement {out['replica_agreement']:.3f}"
            )
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
        finally:
            for rep in replicas:
                await rep.proc.stop()
            await nc.close()
            await discovery.aclose()
            await servers.aclose()
    out["targets"] = verdicts(out)
    return out


async def _workers_seen(client: RouterClient, n: int) -> bool:
    try:
        return len((await client.list_workers(MODEL)).workers) >= n
    except Exception:
        return False


async def _loads_seen(channels: ChannelCache, rep: Replica, want: dict[str, int]) -> bool:
    workers = (await RouterClient(channels, rep.address).list_workers(MODEL)).workers
    return {w.worker_id: w.active_blocks for w in workers} == want


async def _subscribed(nats: MonitoredNats, n: int) -> bool:
    return await nats.subscriptions() >= n


async def _at_least(rep: Replica, name: str, n: float) -> bool:
    return await rep.value(name) >= n


async def _lag_ok(replicas: Sequence[Replica], offsets: Sequence[float], sent: int) -> bool:
    for rep, off in zip(replicas, offsets, strict=True):
        if sent - (await rep.value("meshllm_router_kv_events_applied_total") - off) > LAG_WINDOW:
            return False
    return True


def _connected(nc: Any) -> Any:
    async def check() -> bool:
        return bool(nc.is_connected)

    return check


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- report
def render(results: Sequence[dict[str, Any]], loads: Sequence[float] = ()) -> str:
    """The docs/benchmarks.md section of one or more runs (one row per fleet size)."""

    def mark(r: dict[str, Any], key: str) -> str:
        return "met" if r["targets"][key] else "**missed**"

    def ms(d: dict[str, float]) -> str:
        return f"{d['p50']:.2f} / {d['p90']:.2f} / {d['p99']:.2f}"

    def ms3(d: dict[str, float]) -> str:
        return " / ".join(f"{d[p]:.3f}" if p in d else "–" for p in ("p50", "p90", "p99"))

    lines = [
        "## Fleet routing",
        "",
        f"`.venv/bin/python bench/fleet.py --workers N --json OUT`, one run per fleet size, on {today()} ({machine()}). "
        "N simulated workers with full caches "
        "(bench/fleet.py's docstring): KV event streams from the Mooncake conversation trace (1 hash id = one 16-token "
        "block; ids in ≥ 1 % of rows shared fleet-wide, the rest renamed per copy of the trace, one copy per "
        f"{WORKERS_PER_COPY} workers), published through a real nats-server to two real `meshllm router` replicas "
        "(etcd discovery). *Decision*: the whole `kv` decision of an aggregated request (hash + `RouterCore.plan`), in "
        "one process, on an index fed the same events; *exhaustive*: the same decision scoring every worker (the "
        "scorer before ISSUE 39; same choice in the share shown); *Route RPC*: `Router.Route` round trips to the router "
        "process (gRPC and protobuf on both sides included). Percentiles over the prompts (3/4 trace rows of random "
        "copies, 1/4 fresh prompts). Targets (ISSUE 39, at 1,024 workers × 16,384 blocks): decision p99 ≤ 1 ms, "
        "≥ 1,000,000 block-events/s, ≤ 100 bytes per indexed pair, full resync ≤ 10 s, the index walk no slower than "
        "Dynamo's `find_matches`.",
    ]
    if loads:
        lines.append(load_sentence(loads))
    for r in results:
        if r.get("load"):
            label = f"{r['workers']:,} workers" + ("" if "route_rpc_ms" in r else " (`--reuse --in-process-only` run)")
            lines += ["", f"{label}: " + load_sentence(r["load"])]
    lines += [
        "",
        "| workers × blocks | decision p50 / p90 / p99 ms | exhaustive p50 / p90 / p99 ms (same choice) "
        "| Route RPC p50 / p90 / p99 ms | candidates scored (median) | block-events/s ingested (both replicas) "
        "| bytes per (worker, block) pair | resync one / all after a NATS outage (s) | replica agreement |",
        "|---|---|---|---|---:|---:|---:|---|---|",
    ]
    for r in [r for r in results if "route_rpc_ms" in r]:
        ex = r.get("exhaustive_ms")
        exhaustive = f"{ms(ex)} ({r['exhaustive_agreement'] * 100:.0f} %)" if ex else "–"
        lines.append(
            f"| {r['workers']:,} × {r['blocks_per_worker']:,} | {ms(r['decision_ms'])} ({mark(r, 'decision_p99_ms')}) "
            f"| {exhaustive} | {ms(r['route_rpc_ms'])} | {r['candidates_scored_median']:g} "
            f"| {r['events_per_s']:,.0f} ({mark(r, 'events_per_s')}; {r['in_process_events_per_s']:,.0f} in process) "
            f"| {r['bytes_per_pair']:.0f} ({mark(r, 'bytes_per_pair')}) "
            f"| {r['resync_one_s']:.3f} / {r['resync_all_s']:.2f} ({mark(r, 'resync_all_s')}"
            f"{'; ' + format(r['resubscribed_s'], '.1f') + ' s of it reconnecting' if 'resubscribed_s' in r else ''}) "
            f"| {r['replica_agreement'] * 100:.1f} %{'' if r['replica_same_index'] else ', indexes differ'} |"
        )
    full = [r for r in results if "route_rpc_ms" in r]  # in-process-only runs have no row in the process tables
    releases = sorted({r["dynamo"].get("version", "") for r in full if isinstance(r.get("dynamo"), dict)} - {""})
    dynamo = "Dynamo " + ", ".join(releases) if releases else "Dynamo"
    lines += ["", f"Index walk beside {dynamo}'s `RadixTree.find_matches` on the same stored events and prompts:", ""]
    lines += [
        "| workers × blocks | our walk p50 / p90 / p99 ms (depth groups; as a {worker: depth} dict) "
        "| `find_matches` p50 / p90 / p99 ms "
        "| same overlaps | walk no slower |"
    ]
    lines += ["|---|---|---|---:|---|"]
    for r in full:
        d = r["dynamo"]
        if isinstance(d, dict):
            ours, theirs = d["walk_ms"], d["find_matches_ms"]
            ok = "met" if ours["p99"] <= theirs["p99"] else "**missed**"
            as_dict = d.get("walk_dict_ms")
            dict_part = f" ({ms3(as_dict)} as a dict)" if as_dict and "p90" in as_dict else ""
            lines.append(
                f"| {r['workers']:,} × {r['blocks_per_worker']:,} | {ms3(ours)}{dict_part} | {ms3(theirs)} "
                f"| {d['same_overlaps'] * 100:.0f} % | {ok} (p99) |"
            )
        else:
            lines.append(f"| {r['workers']:,} × {r['blocks_per_worker']:,} | – | {d} | – | – |")
    reused = [r for r in results if "reused" in r]
    if reused:
        lines += [
            "",
            "With reused blocks spread through every eviction order (`--reuse`: every cached block routed again, in runs "
            "of 20 in random order, half the runs as reuses — no bound is exact, each candidate scored costs its "
            "evicted-block count; a run of its own, in process, the same prompts and loads as above):",
            "",
            "| workers × blocks | reused share | decision p50 / p90 / p99 ms | candidates scored p50 / p90 / p99 "
            "| exhaustive p50 / p90 / p99 ms (same choice) |",
            "|---|---:|---|---|---|",
        ]
        for r in reused:
            u = r["reused"]
            ex = u.get("exhaustive_ms")
            exhaustive = f"{ms(ex)} ({u['exhaustive_agreement'] * 100:.0f} %)" if ex else "–"
            sc = u["scored"]
            lines.append(
                f"| {r['workers']:,} × {r['blocks_per_worker']:,} | {u['hot_share'] * 100:.0f} % | {ms(u['decision_ms'])} "
                f"({'met' if u['decision_ms']['p99'] <= TARGETS['decision_p99_ms'] else '**missed**'}) "
                f"| {sc['p50']:g} / {sc['p90']:g} / {sc['p99']:g} | {exhaustive} |"
            )
    return "\n".join(lines) + "\n"


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

"""The simulated fleet of bench/fleet.py: Mooncake trace rows as KV event streams of N workers, the gRPC servers
that answer each simulated worker's `Worker.GetKvSnapshot`, and one run's `Fleet` (see bench/fleet.py's docstring)."""

from __future__ import annotations

import argparse
import asyncio
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import orjson

from meshllm.bench.trace import TraceScale, hash_id_tokens
from meshllm.protocol.kv import chain_hash, tokens_hash
from meshllm.v1 import events_pb2, worker_pb2

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
BLOCK_SIZE = 16
SHARED_SHARE = 0.01  # hash ids held by at least this share of trace rows are the same on every worker
WORKERS_PER_COPY = 8
COPY_STRIDE = 10_000_000  # renamed id = copy * COPY_STRIDE + trace id (trace ids are far below it)
EVENTS_PER_BATCH = 8


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
        ev.stored.block_hashes.extend(bh for bh, _ in new)  # packed, as a worker's sink publishes them
        ev.stored.tokens_hashes.extend(th for _, th in new)
        for bh, th in new:
            self.cache[bh] = th
        self.block_events += len(new)

    def _flush(self, batch: events_pb2.KvEventBatch) -> None:
        if batch.events:
            n = sum(len(ev.stored.block_hashes) + len(ev.removed.block_hashes) for ev in batch.events)
            self.batches.append((batch.SerializeToString(), n))

    def build_snapshot(self) -> None:
        """`Worker.GetKvSnapshot`'s answer for the cache as it is now."""
        snap = worker_pb2.KvSnapshot(worker_id=self.id, last_event_id=self.event_id)
        snap.ranks.add(dp_rank=0).block_hashes.extend(self.cache)  # as a worker's sink sends it
        self.snapshot = snap.SerializeToString()


def interleave(workers: Sequence[SimWorker]) -> list[tuple[bytes, int]]:
    """Every worker's pending batches, round-robin across workers (a fleet publishes at once), each worker in order."""
    out = []
    depth = max((len(w.batches) for w in workers), default=0)
    for i in range(depth):
        out.extend(w.batches[i] for w in workers if i < len(w.batches))
    return out


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

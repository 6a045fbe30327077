"""The worker's EngineSink: numbers, batches and publishes KV events and load.

Engines report cache changes here (from the event loop thread). The sink gives
each event the next per-worker event id, collects the events of one loop
iteration into one `KvEventBatch` per dp rank, publishes it, keeps a bounded
ring of recent events, and maintains the full block set of every tier that
answers `Worker.GetKvSnapshot`. Load samples are published at most every 100 ms (the
latest sample wins), and the latest again after `LOAD_REFRESH_S` without one: an
idle engine reports no change, so a router that starts or restarts after its
last sample would otherwise never learn its load, capacity or tiers.

A sample's `timestamp_ms` is when the engine took it, not when the throttle let
it go: a router subtracts the requests that ended after that time, and a sample
held back up to 100 ms while its requests ended would otherwise count them for
good (until the next sample; a burst of requests routed meanwhile all avoided
the worker). A republished sample is stamped anew: the engine reported no
change since.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from typing import cast

from meshllm.engine.base import KvTier, LoadMetrics
from meshllm.plane.events.base import EventBus
from meshllm.plane.events.batching import FlushPacer
from meshllm.protocol.names import kv_subject, load_subject
from meshllm.v1 import events_pb2, worker_pb2

__all__ = ["WorkerSink"]

LOAD_INTERVAL_S = 0.1
LOAD_REFRESH_S = 1.0  # the latest load sample is published again after this long without one
# KV events made within this long of the last batch wait and go in the next
# one: a fast engine's steps cost one NATS message (and one parse at every
# router) per interval, not one per step. The first events after a quiet
# period go at once.
KV_FLUSH_INTERVAL_S = 0.005


def _pb_tier(tier: KvTier) -> events_pb2.KvTier:
    return cast(events_pb2.KvTier, int(tier))


class WorkerSink:
    """EngineSink of one worker. Not thread-safe: call from the event loop."""

    def __init__(
        self,
        worker_id: str,
        bus: EventBus,
        *,
        namespace: str,
        component: str,
        ring_size: int = 4096,
        on_load: Callable[[LoadMetrics], None] | None = None,
        on_published: Callable[[int], None] | None = None,
    ) -> None:
        """`on_load(sample)` sees every load sample; `on_published(n)` counts the KV events of each published batch."""
        self.worker_id = worker_id
        self._on_load = on_load
        self._on_published = on_published
        self._bus = bus
        self._kv_subject = kv_subject(namespace, component)
        self._load_subject = load_subject(namespace, component)
        self.last_event_id = 0
        self.ring: collections.deque[events_pb2.KvEvent] = collections.deque(maxlen=ring_size)
        # (dp rank, tier) -> block_hash -> tokens_hash
        self._blocks: dict[tuple[int, KvTier], dict[int, int]] = collections.defaultdict(dict)
        self._pending: list[tuple[int, events_pb2.KvEvent]] = []
        self._pacer = FlushPacer(self._flush, KV_FLUSH_INTERVAL_S)
        self._latest_load: LoadMetrics | None = None
        self._latest_at = 0.0  # wall-clock seconds the latest sample was taken (or last republished)
        self._load_sent_at = 0.0
        self._load_timer: asyncio.TimerHandle | None = None
        self._refresh_timer: asyncio.TimerHandle | None = None
        self._closed = False
        self.events_published = 0

    # -- EngineSink
    def blocks_stored(
        self,
        blocks: Sequence[tuple[int, int]],
        parent_hash: int | None,
        dp_rank: int = 0,
        tier: KvTier = KvTier.DEVICE,
    ) -> None:
        if not blocks:
            return
        stored = events_pb2.BlocksStored(
            block_hashes=[bh for bh, _ in blocks], tokens_hashes=[th for _, th in blocks], tier=_pb_tier(tier)
        )
        if parent_hash is not None:
            stored.parent_hash = parent_hash
        resident = self._blocks[dp_rank, KvTier(tier)]
        for bh, th in blocks:
            resident[bh] = th
        self._add(dp_rank, events_pb2.KvEvent(stored=stored))

    def blocks_removed(self, block_hashes: Sequence[int], dp_rank: int = 0, tier: KvTier = KvTier.DEVICE) -> None:
        if not block_hashes:
            return
        resident = self._blocks[dp_rank, KvTier(tier)]
        for bh in block_hashes:
            resident.pop(bh, None)
        removed = events_pb2.BlocksRemoved(block_hashes=block_hashes, tier=_pb_tier(tier))
        self._add(dp_rank, events_pb2.KvEvent(removed=removed))

    def all_cleared(self, dp_rank: int = 0) -> None:
        for dp, tier in list(self._blocks):
            if dp == dp_rank:
                self._blocks[dp, tier].clear()
        self._add(dp_rank, events_pb2.KvEvent(cleared=events_pb2.AllCleared()))

    def load(self, metrics: LoadMetrics) -> None:
        self._latest_load, self._latest_at = metrics, time.time()
        if self._on_load is not None:
            self._on_load(metrics)
        if self._load_timer is not None:
            return
        wait = self._load_sent_at + LOAD_INTERVAL_S - time.monotonic()
        if wait <= 0:
            self._send_load()
        else:
            self._load_timer = asyncio.get_running_loop().call_later(wait, self._send_load)

    # -- snapshot
    def snapshot(self) -> worker_pb2.KvSnapshot:
        """Every block of every tier, per dp rank, as of `last_event_id` (flushes first)."""
        self._pacer.flush_now()
        snap = worker_pb2.KvSnapshot(worker_id=self.worker_id, last_event_id=self.last_event_id)
        ranks: dict[int, worker_pb2.KvRankSnapshot] = {}
        for (dp, tier), blocks in sorted(self._blocks.items()):
            rank = ranks.get(dp)
            if rank is None:
                rank = ranks[dp] = snap.ranks.add(dp_rank=dp)
            if tier == KvTier.DEVICE:
                rank.block_hashes.extend(blocks)
            elif blocks:
                rank.lower_tiers.add(tier=_pb_tier(tier)).block_hashes.extend(blocks)
        return snap

    @property
    def latest_load(self) -> LoadMetrics | None:
        return self._latest_load

    def block_count(self, tier: KvTier = KvTier.DEVICE) -> int:
        """Blocks held in `tier`, all dp ranks."""
        return sum(len(b) for (_, t), b in self._blocks.items() if t == tier)

    # -- internals
    def _add(self, dp_rank: int, event: events_pb2.KvEvent) -> None:
        self.last_event_id += 1
        event.event_id = self.last_event_id
        self.ring.append(event)
        self._pending.append((dp_rank, event))
        self._pacer.request()

    def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        batch: events_pb2.KvEventBatch | None = None
        for dp, ev in pending:
            if batch is None or batch.dp_rank != dp:
                if batch is not None:
                    self._publish_batch(batch)
                batch = events_pb2.KvEventBatch(worker_id=self.worker_id, dp_rank=dp)
            batch.events.append(ev)
        if batch is not None:
            self._publish_batch(batch)

    def _publish_batch(self, batch: events_pb2.KvEventBatch) -> None:
        self._bus.publish(self._kv_subject, batch)
        self.events_published += len(batch.events)
        if self._on_published is not None:
            self._on_published(len(batch.events))

    def _refresh_load(self) -> None:
        self._latest_at = time.time()
        self._send_load()

    def _send_load(self) -> None:
        self._load_timer = None
        m = self._latest_load
        if m is None:
            return
        self._load_sent_at = time.monotonic()
        if self._refresh_timer is not None:
            self._refresh_timer.cancel()
        if not self._closed:
            self._refresh_timer = asyncio.get_running_loop().call_later(LOAD_REFRESH_S, self._refresh_load)
        self._bus.publish(
            self._load_subject,
            events_pb2.LoadSnapshot(
                worker_id=self.worker_id,
                dp_rank=m.dp_rank,
                active_blocks=m.active_blocks,
                total_blocks=m.total_blocks,
                waiting=m.waiting,
                running=m.running,
                queued_prefill_tokens=m.queued_prefill_tokens,
                last_event_id=self.last_event_id,
                timestamp_ms=int(self._latest_at * 1000),
                tiers=[
                    events_pb2.KvTierUsage(
                        tier=_pb_tier(t.tier),
                        blocks=t.blocks,
                        bytes_used=t.bytes_used,
                        bytes_capacity=t.bytes_capacity,
                        block_bytes=t.block_bytes,
                        restore_bytes_per_s=t.restore_bytes_per_s,
                    )
                    for t in m.tiers
                ],
            ),
        )

    def close(self) -> None:
        """Publish what is pending (last events and load) and stop timers."""
        self._closed = True
        self._pacer.flush_now()
        if self._load_timer is not None:
            self._load_timer.cancel()
            self._send_load()
        if self._refresh_timer is not None:
            self._refresh_timer.cancel()
            self._refresh_timer = None

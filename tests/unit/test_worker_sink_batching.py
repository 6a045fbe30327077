"""WorkerSink batches KV events: the first after a quiet period at once, then at most one batch per interval."""

from __future__ import annotations

import asyncio

from meshllm.plane.events.base import EventBus, Message, Subscription
from meshllm.worker import sink as sink_mod
from meshllm.worker.sink import WorkerSink


class RecordingBus(EventBus):
    """Records what is published (a unit test of the sink alone)."""

    def __init__(self) -> None:
        self.published: list[Message] = []
        self.arrived = asyncio.Event()

    def publish(self, subject: str, message: Message) -> None:
        self.published.append(message)
        self.arrived.set()

    async def subscribe(self, subject: str, message_type: type) -> Subscription:  # type: ignore[type-arg]
        raise NotImplementedError

    async def flush(self, timeout_s: float = 5.0) -> None:
        pass

    async def _aclose(self) -> None:
        pass


async def test_first_events_go_at_once_and_a_burst_shares_one_batch() -> None:
    bus = RecordingBus()
    sink = WorkerSink("w1", bus, namespace="ns", component="backend")
    sink.blocks_stored([(1, 11)], None)
    await bus.arrived.wait()  # published on the next loop turn, no interval waited
    assert len(bus.published) == 1 and [e.event_id for e in bus.published[0].events] == [1]  # type: ignore[attr-defined]

    # A burst right after: all its events wait for the interval and travel as one batch, in order.
    bus.arrived.clear()
    for i in range(2, 12):
        sink.blocks_stored([(i, 10 + i)], i - 1)
    sink.blocks_removed([1])
    await asyncio.sleep(0)
    assert len(bus.published) == 1  # still inside the interval after the first batch
    await asyncio.wait_for(bus.arrived.wait(), timeout=5)
    assert len(bus.published) == 2
    assert [e.event_id for e in bus.published[1].events] == list(range(2, 13))  # type: ignore[attr-defined]


async def test_a_snapshot_flushes_waiting_events_first() -> None:
    bus = RecordingBus()
    sink = WorkerSink("w1", bus, namespace="ns", component="backend")
    sink.blocks_stored([(1, 11)], None)
    await bus.arrived.wait()
    sink.blocks_stored([(2, 12)], 1)
    snap = sink.snapshot()  # must not describe state the published events have not reached yet
    assert snap.last_event_id == 2
    assert [e.event_id for b in bus.published for e in b.events] == [1, 2]  # type: ignore[attr-defined]
    assert sink_mod.KV_FLUSH_INTERVAL_S > 0


async def test_lower_tier_events_carry_their_tier_and_the_snapshot_keeps_tiers_apart() -> None:
    from meshllm.engine.base import KvTier, LoadMetrics, TierUsage
    from meshllm.v1 import events_pb2

    bus = RecordingBus()
    sink = WorkerSink("w1", bus, namespace="ns", component="backend")
    sink.blocks_stored([(1, 11), (2, 12)], None)
    sink.blocks_stored([(1, 11)], None, tier=KvTier.HOST)  # offloaded copy; the device copy stays
    sink.blocks_stored([(3, 13)], 2, tier=KvTier.DISK)
    sink.blocks_removed([2])  # evicted from the device only
    snap = sink.snapshot()
    events = [e for b in bus.published for e in b.events]  # type: ignore[attr-defined]
    assert [(e.WhichOneof("data"), getattr(e, e.WhichOneof("data")).tier) for e in events] == [
        ("stored", events_pb2.KV_TIER_DEVICE),
        ("stored", events_pb2.KV_TIER_HOST),
        ("stored", events_pb2.KV_TIER_DISK),
        ("removed", events_pb2.KV_TIER_DEVICE),
    ]
    (rank,) = snap.ranks
    assert list(rank.block_hashes) == [1] and not rank.blocks  # packed, not StoredBlock messages
    assert {t.tier: list(t.block_hashes) for t in rank.lower_tiers} == {
        events_pb2.KV_TIER_HOST: [1],
        events_pb2.KV_TIER_DISK: [3],
    }
    assert (sink.block_count(), sink.block_count(KvTier.HOST), sink.block_count(KvTier.DISK)) == (1, 1, 1)

    sink.all_cleared()  # every tier
    snap = sink.snapshot()
    assert not snap.ranks[0].block_hashes and not snap.ranks[0].lower_tiers

    bus.published.clear()
    usage = TierUsage(KvTier.HOST, blocks=4, bytes_used=4096, bytes_capacity=8192, block_bytes=1024, restore_bytes_per_s=1e9)
    sink.load(LoadMetrics(active_blocks=1, total_blocks=8, waiting=0, running=1, tiers=(usage,)))
    (load,) = [m for m in bus.published if isinstance(m, events_pb2.LoadSnapshot)]
    (t,) = load.tiers
    assert (t.tier, t.blocks, t.bytes_used, t.bytes_capacity, t.block_bytes, t.restore_bytes_per_s) == (
        events_pb2.KV_TIER_HOST,
        4,
        4096,
        8192,
        1024,
        1e9,
    )


async def test_stored_events_carry_packed_hashes_in_order() -> None:
    """Locks: a stored event's blocks travel as packed `block_hashes` and `tokens_hashes` (not StoredBlock messages),
    with the parent hash, in prompt order."""
    bus = RecordingBus()
    sink = WorkerSink("w1", bus, namespace="ns", component="backend")
    sink.blocks_stored([(5, 15), (6, 16), (7, 17)], 4)
    await bus.arrived.wait()
    (ev,) = bus.published[0].events  # type: ignore[attr-defined]
    assert list(ev.stored.block_hashes) == [5, 6, 7] and list(ev.stored.tokens_hashes) == [15, 16, 17]
    assert ev.stored.parent_hash == 4 and not ev.stored.blocks

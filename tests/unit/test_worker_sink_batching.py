"""WorkerSink batches KV events: the first after a quiet period at once, then at most one batch per interval."""

from __future__ import annotations

import asyncio

from meshllm.plane.events import EventBus, Message, Subscription
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

"""Replica sync events travel in batches: the first at once, a burst in one batch per interval, the rest on close.

Locks: what one replica publishes reaches the other replica's load tracker
(over the in-memory broker, whose subscribers decode as they would over NATS);
a replica ignores its own batches; events made in one loop turn share one
message; events made right after a batch wait for the interval and share the
next; closing publishes what is pending. Presence: a replica that has heard
no other publishes no events (only its empty hello batches), two replicas
know each other as soon as the second has started, and one that falls silent
for its time to live is forgotten.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from meshllm.plane.events.base import MemoryBroker, MemoryEventBus, Subscription
from meshllm.router.policy.load import LoadTracker
from meshllm.router.sync import ReplicaSync
from meshllm.v1 import events_pb2


async def _events(spy: Subscription[events_pb2.RouterSyncBatch]) -> events_pb2.RouterSyncBatch:
    """The next batch with events (hellos, the empty batches, are skipped)."""
    while not (batch := await anext(spy)).events:
        pass
    return batch


async def _until(check: Callable[[], bool]) -> None:
    """Until `check()`: the other replica's subscription task applies what it has received (never more than 100 turns)."""
    for _ in range(100):
        if check():
            return
        await asyncio.sleep(0)  # one loop turn for the subscriber task; a turn bound, not a time-based wait
    raise AssertionError("the other replica did not apply the batch")


async def test_events_are_batched_and_reach_the_other_replica() -> None:
    broker = MemoryBroker()
    async with MemoryEventBus(broker) as bus1, MemoryEventBus(broker) as bus2, MemoryEventBus(broker) as spy_bus:
        spy: Subscription[events_pb2.RouterSyncBatch] = await spy_bus.subscribe(
            "meshllm.ns.router.backend", events_pb2.RouterSyncBatch
        )
        t1, t2 = LoadTracker(), LoadTracker()
        s1 = ReplicaSync(bus1, "ns", "backend", "r1", t1)
        s2 = ReplicaSync(bus2, "ns", "backend", "r2", t2)
        await s1.start()
        await s2.start()
        await _until(lambda: s1.peers == ["r2"] and s2.peers == ["r1"])

        s1.routed("q1", ("w", 0), prefill_tokens=64, blocks=6)
        s1.routed("q2", ("w", 0), prefill_tokens=32, blocks=3)  # same loop turn: same batch
        first = await _events(spy)
        assert first.router_id == "r1" and [e.request_id for e in first.events] == ["q1", "q2"]
        assert all(not e.router_id for e in first.events)
        await _until(lambda: t2.get(("w", 0)).active_blocks == 9)
        assert t1.get(("w", 0)).active_blocks == 0  # its own batch is not applied twice

        for i in range(5):  # right after a batch: they wait for the interval and travel together
            s1.completed("q1" if i == 0 else f"x{i}", ("w", 0))
            await asyncio.sleep(0)
        second = await _events(spy)
        assert len(second.events) == 5 and s1.batches_published == 2
        await _until(lambda: t2.get(("w", 0)).active_blocks == 3)

        s1.prefill_done("q2", ("w", 0))
        await s1.aclose()  # the pending event is published on close
        third = await _events(spy)
        assert [(e.kind, e.request_id) for e in third.events] == [(events_pb2.RouterSyncEvent.KIND_PREFILL_DONE, "q2")]
        await _until(lambda: t2.get(("w", 0)).queued_prefill_tokens == 0)
        s1.completed("q2", ("w", 0))  # after close: dropped, never published (nor scheduled)
        assert s1.batches_published == 3 and not s1._pacer.scheduled
        await s2.aclose()
        while spy.pending:  # only hellos are left
            assert not (await anext(spy)).events


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_lone_replica_publishes_no_events_until_it_hears_another() -> None:
    broker = MemoryBroker()
    clock = Clock()
    async with MemoryEventBus(broker) as bus1, MemoryEventBus(broker) as bus2, MemoryEventBus(broker) as spy_bus:
        spy: Subscription[events_pb2.RouterSyncBatch] = await spy_bus.subscribe(
            "meshllm.ns.router.backend", events_pb2.RouterSyncBatch
        )
        t1, t2 = LoadTracker(), LoadTracker()
        s1 = ReplicaSync(bus1, "ns", "backend", "r1", t1, hello_s=10.0, clock=clock)
        await s1.start()
        hello = await anext(spy)
        assert hello.router_id == "r1" and not hello.events  # its presence, nothing else
        s1.routed("alone", ("w", 0), prefill_tokens=64, blocks=6)
        s1.completed("alone", ("w", 0))
        assert s1.peers == [] and s1.unpublished == 0 and not s1._pacer.scheduled  # nobody to tell: not even batched

        s2 = ReplicaSync(bus2, "ns", "backend", "r2", t2, hello_s=10.0, clock=clock)
        await s2.start()
        # r1 answers the newcomer's hello at once (its own next hello is 10 s away)
        await _until(lambda: s1.peers == ["r2"] and s2.peers == ["r1"])
        s1.routed("q1", ("w", 0), prefill_tokens=64, blocks=6)
        batch = await _events(spy)
        assert [e.request_id for e in batch.events] == ["q1"]
        await _until(lambda: t2.get(("w", 0)).active_blocks == 6)

        await s2.aclose()
        clock.now += s1.peer_ttl_s  # r2 says nothing more: after its time to live it is gone
        assert s1.peers == []
        s1.completed("q1", ("w", 0))
        assert s1.unpublished == 0 and s1.batches_published == 1
        await s1.aclose()

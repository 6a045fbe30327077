"""The in-memory and null event buses keep the EventBus contract (meshllm.plane.events.base)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import cast

import pytest
from google.protobuf.message import Message

from meshllm.config import EventsKind, PlaneConfig
from meshllm.errors import InvalidArgument, Unavailable
from meshllm.plane.events.base import (
    EventBus,
    MemoryBroker,
    MemoryEventBus,
    NullEventBus,
    Subscription,
    open_events,
    subject_matches,
)
from meshllm.protocol.names import kv_subject, load_subject
from meshllm.v1.events_pb2 import BlocksStored, KvEvent, KvEventBatch, LoadSnapshot, StoredBlock

NS = "test"


def batch(event_id: int, worker: str = "w1") -> KvEventBatch:
    stored = BlocksStored(blocks=[StoredBlock(block_hash=event_id * 10, tokens_hash=event_id * 10 + 1)])
    return KvEventBatch(worker_id=worker, dp_rank=1, events=[KvEvent(event_id=event_id, stored=stored)])


async def take(sub: Subscription[KvEventBatch], n: int, timeout_s: float = 2.0) -> list[KvEventBatch]:
    got: list[KvEventBatch] = []
    async with asyncio.timeout(timeout_s):
        async for msg in sub:
            got.append(msg)
            if len(got) == n:
                break
    return got


class _Garbage:
    """Stands in for a foreign publisher's message: bytes that are no KvEventBatch."""

    def SerializeToString(self) -> bytes:
        return b"\n\x01\xff"  # field 1 (worker_id) with invalid UTF-8


async def test_a_published_message_reaches_a_subscriber_on_another_handle_decoded() -> None:
    """Locks: handles of one broker see each other's messages, as equal protobufs."""
    broker = MemoryBroker()
    async with MemoryEventBus(broker) as worker, MemoryEventBus(broker) as router:
        sub = await router.subscribe(kv_subject(NS, "backend"), KvEventBatch)
        worker.publish(kv_subject(NS, "backend"), batch(1))
        worker.publish(kv_subject(NS, "other"), batch(2))
        worker.publish(kv_subject(NS, "backend"), batch(3))
        assert await take(sub, 2) == [batch(1), batch(3)]
        assert sub.pending == 0


async def test_separate_brokers_do_not_share_messages() -> None:
    """Locks: a broker is the unit of sharing; two `meshllm run`s never see each other."""
    async with MemoryEventBus(MemoryBroker()) as a, MemoryEventBus(MemoryBroker()) as b:
        sub = await b.subscribe(kv_subject(NS, "backend"), KvEventBatch)
        a.publish(kv_subject(NS, "backend"), batch(1))
        assert sub.pending == 0


@pytest.mark.parametrize(
    ("pattern", "subject", "matches"),
    [
        ("meshllm.ns.kv.backend", "meshllm.ns.kv.backend", True),
        ("meshllm.ns.kv.*", "meshllm.ns.kv.backend", True),
        ("meshllm.ns.kv.*", "meshllm.ns.kv", False),
        ("meshllm.ns.kv.*", "meshllm.ns.kv.backend.x", False),
        ("meshllm.*.kv.*", "meshllm.other.kv.prefill", True),
        ("meshllm.ns.>", "meshllm.ns.kv.backend", True),
        ("meshllm.ns.>", "meshllm.ns.load.backend", True),
        ("meshllm.ns.>", "meshllm.ns", False),
        ("meshllm.ns.kv.backend", "meshllm.ns.kv.backend2", False),
    ],
)
def test_subject_matching_follows_nats_wildcards(pattern: str, subject: str, matches: bool) -> None:
    """Locks: `*` matches exactly one token, a trailing `>` one or more."""
    assert subject_matches(pattern, subject) is matches


async def test_a_wildcard_subscription_receives_every_matching_subject() -> None:
    """Locks: a router subscribes once to all components' KV events with `*`, to everything with `>`."""
    async with MemoryEventBus(MemoryBroker()) as bus:
        kv_all = await bus.subscribe(kv_subject(NS, "*"), KvEventBatch)
        everything = await bus.subscribe(f"meshllm.{NS}.>", KvEventBatch)
        bus.publish(kv_subject(NS, "prefill"), batch(1))
        bus.publish(kv_subject(NS, "decode"), batch(2))
        bus.publish(load_subject(NS, "decode"), batch(3))
        assert await take(kv_all, 2) == [batch(1), batch(2)]
        assert kv_all.pending == 0
        assert await take(everything, 3) == [batch(1), batch(2), batch(3)]


async def test_invalid_subjects_are_rejected_at_the_call() -> None:
    """Locks: a malformed subject is a programming error, raised at once (not a transport problem)."""
    async with MemoryEventBus(MemoryBroker()) as bus:
        for bad in ("", "a..b", "a b", "meshllm.ns.kv.*", "meshllm.>"):
            with pytest.raises(InvalidArgument):
                bus.publish(bad, batch(1))
        for bad in ("", "a.>.b", "a.b*", "a.>x"):
            with pytest.raises(InvalidArgument):
                await bus.subscribe(bad, KvEventBatch)


async def test_a_message_that_fails_to_decode_is_skipped_and_the_subscription_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Locks: garbage on a subject is logged and counted, and the next good message still arrives."""
    async with MemoryEventBus(MemoryBroker()) as bus:
        sub = await bus.subscribe(kv_subject(NS, "*"), KvEventBatch)
        bus.publish(kv_subject(NS, "backend"), cast(Message, _Garbage()))
        bus.publish(kv_subject(NS, "backend"), batch(2))
        with caplog.at_level(logging.WARNING, logger="meshllm.plane.events.base"):
            assert await take(sub, 1) == [batch(2)]
        assert sub.decode_errors == 1
        assert "not a meshllm.v1.KvEventBatch" in caplog.text


async def test_a_full_subscription_queue_drops_the_oldest_and_counts_it() -> None:
    """Locks: a slow consumer loses the oldest messages, never blocks the publisher; drops are counted."""
    broker = MemoryBroker(max_pending=3)
    async with MemoryEventBus(broker) as worker, MemoryEventBus(broker) as router:
        sub = await router.subscribe(kv_subject(NS, "backend"), KvEventBatch)
        for i in range(1, 11):
            worker.publish(kv_subject(NS, "backend"), batch(i))
        assert (sub.dropped, router.dropped, worker.dropped) == (7, 7, 0)
        assert await take(sub, 3) == [batch(8), batch(9), batch(10)]


async def test_publish_never_blocks_and_never_awaits() -> None:
    """Locks: publish is a plain function that returns at once, even with nobody consuming."""
    async with MemoryEventBus(MemoryBroker(max_pending=100)) as bus:
        assert not inspect.iscoroutinefunction(bus.publish)
        sub = await bus.subscribe(kv_subject(NS, "backend"), KvEventBatch)
        message = batch(1)
        for _ in range(20_000):
            bus.publish(kv_subject(NS, "backend"), message)
        assert sub.pending == 100
        assert bus.dropped == 19_900
        await bus.flush()  # nothing to wait for in memory


async def test_closing_a_subscription_ends_a_waiting_iteration() -> None:
    """Locks: `aclose()` wakes an idle consumer and its `async for` ends; closing twice is fine."""
    async with MemoryEventBus(MemoryBroker()) as bus:
        sub = await bus.subscribe(kv_subject(NS, "backend"), KvEventBatch)
        consumed: list[KvEventBatch] = []
        took_one = asyncio.Event()

        async def consume() -> None:
            async for msg in sub:
                consumed.append(msg)
                took_one.set()

        consumer = asyncio.create_task(consume())
        bus.publish(kv_subject(NS, "backend"), batch(1))
        async with asyncio.timeout(2):
            await took_one.wait()
        await sub.aclose()
        await sub.aclose()
        async with asyncio.timeout(2):
            await consumer
        bus.publish(kv_subject(NS, "backend"), batch(2))
        assert consumed == [batch(1)]
        assert sub.closed and sub.pending == 0


async def test_closing_the_bus_ends_its_subscriptions_and_later_publishes_are_dropped() -> None:
    """Locks: a bus owns its subscriptions; after close publish drops (counted) and subscribe refuses."""
    broker = MemoryBroker()
    other = MemoryEventBus(broker)
    bus = MemoryEventBus(broker)
    sub = await bus.subscribe(kv_subject(NS, "*"), KvEventBatch)
    consumer = asyncio.create_task(take(sub, 1, timeout_s=5))
    await bus.aclose()
    async with asyncio.timeout(2):
        assert await consumer == []
    other.publish(kv_subject(NS, "backend"), batch(1))  # nobody is subscribed any more
    assert sub.pending == 0
    bus.publish(kv_subject(NS, "backend"), batch(2))
    assert bus.dropped == 1
    with pytest.raises(Unavailable):
        await bus.subscribe(kv_subject(NS, "*"), KvEventBatch)
    await other.aclose()


async def test_the_subscription_type_decides_the_decoding() -> None:
    """Locks: messages travel as protobuf binary and are decoded as the subscriber's type."""
    async with MemoryEventBus(MemoryBroker()) as bus:
        sub = await bus.subscribe(load_subject(NS, "backend"), LoadSnapshot)
        snap = LoadSnapshot(worker_id="w1", active_blocks=5, total_blocks=100, waiting=2, running=3)
        bus.publish(load_subject(NS, "backend"), snap)
        async with asyncio.timeout(2):
            got = await anext(aiter(sub))
        assert isinstance(got, LoadSnapshot) and got == snap


async def test_the_null_bus_drops_publishes_and_its_subscriptions_wait_until_closed() -> None:
    """Locks: events kind "none" never delivers and never fails; close ends its subscriptions."""
    bus = NullEventBus()
    sub = await bus.subscribe(kv_subject(NS, "*"), KvEventBatch)
    consumer = asyncio.create_task(take(sub, 1, timeout_s=5))
    bus.publish(kv_subject(NS, "backend"), batch(1))
    await bus.flush()
    await asyncio.sleep(0)  # give the consumer a turn: it must still be waiting
    assert not consumer.done()
    await bus.aclose()
    async with asyncio.timeout(2):
        assert await consumer == []
    assert bus.dropped == 0


async def test_open_events_builds_the_configured_backend() -> None:
    """Locks: memory handles share the broker passed in; "none" is the null bus."""
    broker = MemoryBroker()
    config = PlaneConfig(events=EventsKind.MEMORY)
    a = await open_events(config, memory_broker=broker)
    b = await open_events(config, memory_broker=broker)
    assert isinstance(a, MemoryEventBus) and a.broker is broker
    assert isinstance(b, MemoryEventBus) and b.broker is broker
    private = await open_events(config)
    assert isinstance(private, MemoryEventBus) and private.broker is not broker
    null = await open_events(PlaneConfig(events=EventsKind.NONE))
    assert isinstance(null, NullEventBus)
    for bus in (a, b, private, null):
        await bus.aclose()


async def test_open_events_uses_the_opener_registered_for_the_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks: the events module knows no NATS code; meshllm.plane.backends registers it; a kind nobody registered
    is one clear error naming the fix, and a registered opener is what open_events calls."""
    import meshllm.plane.backends  # noqa: F401  (what the services import)
    from meshllm.plane.events import base as events

    assert not hasattr(events, "NatsEventBus")
    assert EventsKind.NATS in events._OPENERS
    made: list[str] = []

    async def opener(config: PlaneConfig, *, memory_broker: MemoryBroker | None, name: str) -> EventBus:
        made.append(name)
        return NullEventBus()

    monkeypatch.setitem(events._OPENERS, EventsKind.NATS, opener)
    bus = await open_events(PlaneConfig(events=EventsKind.NATS), name="replica-1")
    assert isinstance(bus, NullEventBus) and made == ["replica-1"]
    monkeypatch.delitem(events._OPENERS, EventsKind.NATS)
    with pytest.raises(InvalidArgument, match=r"'nats'.*import meshllm\.plane\.backends"):
        await open_events(PlaneConfig(events=EventsKind.NATS))

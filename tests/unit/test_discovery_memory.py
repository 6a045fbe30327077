"""The in-memory discovery backend: registration, snapshots, handles sharing one store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import pytest

from meshllm.config import DiscoveryKind, PlaneConfig
from meshllm.errors import InvalidArgument, Unavailable
from meshllm.plane.discovery.base import MemoryDiscovery, MemoryStore, SnapshotFeed, open_discovery
from meshllm.protocol.names import instance_key
from meshllm.v1 import discovery_pb2

T = TypeVar("T")
WAIT_S = 5.0


def instance(iid: str, component: str = "worker", endpoint: str = "generate", address: str = "") -> discovery_pb2.Instance:
    return discovery_pb2.Instance(
        id=iid, component=component, endpoint=endpoint, address=address or f"127.0.0.1:{1000 + len(iid)}"
    )


def card(name: str, iid: str) -> discovery_pb2.ModelCard:
    return discovery_pb2.ModelCard(name=name, instance_id=iid, kv_block_size=16)


async def next_matching(it: AsyncIterator[dict[str, T]], pred: Callable[[dict[str, T]], bool]) -> dict[str, T]:
    """The first snapshot from `it` that satisfies `pred` (bounded by WAIT_S)."""
    async with asyncio.timeout(WAIT_S):
        async for snapshot in it:
            if pred(snapshot):
                return snapshot
    raise AssertionError("watch ended before the expected snapshot")


async def test_watch_starts_with_the_current_state_even_when_empty() -> None:
    """Locks: the first snapshot is the current state, possibly empty."""
    async with MemoryDiscovery(MemoryStore()) as disc:
        it = disc.watch_instances()
        assert await anext(it) == {}
        await disc.register_instance(instance("a"))
        assert set(await anext(it)) == {"a"}
        it2 = disc.watch_instances()
        first = await anext(it2)
        assert set(first) == {"a"} and first["a"].address == instance("a").address


async def test_register_then_unregister_is_seen_by_a_watcher_of_another_handle() -> None:
    """Locks: handles on one store see each other; unregister removes everything the handle registered."""
    store = MemoryStore()
    async with MemoryDiscovery(store) as worker, MemoryDiscovery(store) as router:
        instances = router.watch_instances("worker", "generate")
        models = router.watch_models("org/model")
        assert await anext(instances) == {}
        assert await anext(models) == {}
        await worker.register_instance(instance("w1"))
        await worker.register_model(card("org/model", "w1"))
        assert set(await next_matching(instances, bool)) == {"w1"}
        got = await next_matching(models, bool)
        assert got["w1"].kv_block_size == 16
        await worker.unregister()
        assert await next_matching(instances, lambda s: not s) == {}
        assert await next_matching(models, lambda s: not s) == {}
        await worker.unregister()  # idempotent
        await worker.register_instance(instance("w1"))  # registration works again afterwards
        assert set(await next_matching(instances, bool)) == {"w1"}


async def test_closing_a_handle_removes_only_its_own_registrations() -> None:
    """Locks: aclose() acts like a lease revoke: the handle's records vanish, others stay."""
    store = MemoryStore()
    a, b = MemoryDiscovery(store), MemoryDiscovery(store)
    async with MemoryDiscovery(store) as watcher:
        await a.register_instance(instance("a"))
        await b.register_instance(instance("b"))
        it = watcher.watch_instances()
        assert set(await anext(it)) == {"a", "b"}
        await a.aclose()
        assert set(await next_matching(it, lambda s: "a" not in s)) == {"b"}
        await b.aclose()
        assert await next_matching(it, lambda s: not s) == {}


async def test_watches_filter_by_component_endpoint_and_model() -> None:
    """Locks: a watch sees only its component/endpoint (or model), keyed by instance id."""
    async with MemoryDiscovery(MemoryStore()) as disc:
        await disc.register_instance(instance("p1", component="prefill"))
        await disc.register_instance(instance("d1", component="decode"))
        await disc.register_instance(instance("d2", component="decode", endpoint="kv"))
        await disc.register_model(card("m1", "p1"))
        await disc.register_model(card("org/m2", "d1"))
        assert set(await anext(disc.watch_instances("decode"))) == {"d1", "d2"}
        assert set(await anext(disc.watch_instances("decode", "generate"))) == {"d1"}
        assert set(await anext(disc.watch_instances())) == {"p1", "d1", "d2"}
        assert set(await anext(disc.watch_models("org/m2"))) == {"d1"}
        assert set(await anext(disc.watch_models())) == {"p1", "d1"}
        assert set(await disc.list_instances("prefill")) == {"p1"}
        assert set(await disc.list_models("m1")) == {"p1"}
        assert (await disc.list_instances("decode"))["d1"].namespace == "meshllm"


async def test_namespaces_sharing_a_store_are_isolated() -> None:
    """Locks: a handle sees only its own namespace."""
    store = MemoryStore()
    async with MemoryDiscovery(store, "a") as disc_a, MemoryDiscovery(store, "b") as disc_b:
        await disc_a.register_instance(instance("x"))
        assert await disc_b.list_instances() == {}
        assert set(await disc_a.list_instances()) == {"x"}


async def test_watch_ends_when_the_discovery_is_closed() -> None:
    """Locks: every open watch iterator finishes when its Discovery closes."""
    disc = MemoryDiscovery(MemoryStore())
    seen: list[dict[str, discovery_pb2.Instance]] = []
    first = asyncio.Event()

    async def consume() -> None:
        async for snapshot in disc.watch_instances():
            seen.append(snapshot)
            first.set()

    task = asyncio.create_task(consume())
    async with asyncio.timeout(WAIT_S):
        await first.wait()
        await disc.aclose()
        await task
    assert seen == [{}]
    assert [s async for s in disc.watch_instances()] == []  # a watch opened after close ends at once
    await disc.aclose()  # idempotent


async def test_snapshots_are_copies_the_consumer_cannot_corrupt() -> None:
    """Locks: mutating a returned record or the registered message changes nothing stored."""
    async with MemoryDiscovery(MemoryStore()) as disc:
        mine = instance("a", address="1.1.1.1:1")
        await disc.register_instance(mine)
        mine.address = "changed"
        got = await disc.list_instances()
        got["a"].address = "also changed"
        assert (await disc.list_instances())["a"].address == "1.1.1.1:1"


async def test_bad_records_are_rejected_with_invalid_argument() -> None:
    """Locks: records that would break the key layout fail before anything is stored."""
    async with MemoryDiscovery(MemoryStore()) as disc:
        with pytest.raises(InvalidArgument):
            await disc.register_instance(instance("", component="worker"))
        with pytest.raises(InvalidArgument):
            await disc.register_instance(instance("a/b"))
        with pytest.raises(InvalidArgument):
            await disc.register_instance(discovery_pb2.Instance(id="a", component="worker", endpoint="g", namespace="x"))
        with pytest.raises(InvalidArgument):
            await disc.register_model(card("", "a"))
        with pytest.raises(InvalidArgument):
            await disc.register_model(card("m", ""))
        with pytest.raises(InvalidArgument):
            await disc.list_instances(endpoint="generate")
        assert await disc.list_instances() == {}


async def test_registering_on_a_closed_handle_is_unavailable() -> None:
    """Locks: a closed handle refuses new registrations instead of leaking them."""
    disc = MemoryDiscovery(MemoryStore())
    await disc.aclose()
    with pytest.raises(Unavailable):
        await disc.register_instance(instance("a"))


async def test_the_same_key_written_by_two_handles_belongs_to_the_last_writer() -> None:
    """Locks: like an etcd put under another lease, the last writer owns the key."""
    store = MemoryStore()
    async with MemoryDiscovery(store) as a, MemoryDiscovery(store) as b:
        await a.register_instance(instance("x", address="1.1.1.1:1"))
        await b.register_instance(instance("x", address="2.2.2.2:2"))
        await a.unregister()
        assert (await b.list_instances())["x"].address == "2.2.2.2:2"
        assert instance_key("meshllm", "worker", "generate", "x").endswith("/worker/generate/x")


async def test_a_slow_consumer_skips_to_the_newest_snapshot() -> None:
    """Locks: snapshots coalesce: a consumer that falls behind sees the latest complete state."""
    feed: SnapshotFeed[discovery_pb2.Instance] = SnapshotFeed()
    it = feed.snapshots()
    for n in range(5):
        feed.publish({str(i): instance(str(i)) for i in range(n + 1)})
    assert set(await anext(it)) == {"0", "1", "2", "3", "4"}
    feed.close()
    assert [s async for s in it] == []


async def test_a_failed_feed_raises_in_the_consumer() -> None:
    """Locks: a producer failure surfaces in the consumer instead of hanging it."""
    feed: SnapshotFeed[discovery_pb2.Instance] = SnapshotFeed()
    feed.fail(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        await anext(feed.snapshots())


async def test_open_discovery_builds_memory_handles_on_the_given_store() -> None:
    """Locks: the factory shares the process-wide store it is given."""
    store = MemoryStore()
    config = PlaneConfig(discovery=DiscoveryKind.MEMORY, namespace="ns")
    async with await open_discovery(config, memory_store=store) as a, await open_discovery(config, memory_store=store) as b:
        assert isinstance(a, MemoryDiscovery) and a.namespace == "ns"
        await a.register_instance(instance("a"))
        assert set(await b.list_instances()) == {"a"}
    async with await open_discovery(config) as private:
        assert await private.list_instances() == {}


async def test_open_discovery_uses_the_opener_registered_for_the_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks: the discovery module knows no etcd code; meshllm.plane.backends registers it; a kind nobody
    registered is one clear error naming the fix, and a registered opener is what open_discovery calls."""
    import meshllm.plane.backends  # noqa: F401  (what the services import)
    from meshllm.plane.discovery import base as discovery

    assert DiscoveryKind.ETCD in discovery._OPENERS
    store = MemoryStore()

    async def opener(config: PlaneConfig, args: discovery.OpenArgs) -> discovery.Discovery:
        return MemoryDiscovery(store, config.namespace)

    monkeypatch.setitem(discovery._OPENERS, DiscoveryKind.ETCD, opener)
    async with await open_discovery(PlaneConfig(discovery=DiscoveryKind.ETCD)) as disc:
        assert isinstance(disc, MemoryDiscovery) and disc.store is store
    monkeypatch.delitem(discovery._OPENERS, DiscoveryKind.ETCD)
    with pytest.raises(InvalidArgument, match=r"'etcd'.*import meshllm\.plane\.backends"):
        await open_discovery(PlaneConfig(discovery=DiscoveryKind.ETCD))

"""The static discovery backend: fixed records, registration is a no-op."""

from __future__ import annotations

import asyncio

import pytest

from meshllm.config import DiscoveryKind, PlaneConfig
from meshllm.errors import InvalidArgument
from meshllm.plane.discovery.base import StaticDiscovery, open_discovery
from meshllm.v1 import discovery_pb2

WAIT_S = 5.0

WORKERS = [
    discovery_pb2.Instance(id="w1", component="worker", endpoint="generate", address="10.0.0.1:9000"),
    discovery_pb2.Instance(id="w2", component="worker", endpoint="generate", address="10.0.0.2:9000"),
    discovery_pb2.Instance(id="r1", component="router", endpoint="generate", address="10.0.0.3:9000"),
]
MODELS = [discovery_pb2.ModelCard(name="org/model", instance_id="w1")]


async def test_static_lists_and_filters_the_fixed_records() -> None:
    """Locks: list_* answer from the records given at construction, filtered like the other backends."""
    async with StaticDiscovery("meshllm", WORKERS, MODELS) as disc:
        assert set(await disc.list_instances()) == {"w1", "w2", "r1"}
        assert set(await disc.list_instances("worker", "generate")) == {"w1", "w2"}
        assert (await disc.list_instances("worker"))["w2"].address == "10.0.0.2:9000"
        assert set(await disc.list_models("org/model")) == {"w1"}
        assert await disc.list_models("other") == {}


async def test_static_registration_is_a_no_op() -> None:
    """Locks: a static process registers nothing and unregister is harmless."""
    async with StaticDiscovery("meshllm", WORKERS, MODELS) as disc:
        await disc.register_instance(discovery_pb2.Instance(id="new", component="worker", endpoint="generate"))
        await disc.register_model(discovery_pb2.ModelCard(name="m", instance_id="new"))
        await disc.unregister()
        await disc.unregister()
        assert set(await disc.list_instances("worker")) == {"w1", "w2"}


async def test_static_watch_yields_once_and_ends_on_close() -> None:
    """Locks: a static watch yields the fixed snapshot once, then waits until the Discovery closes."""
    disc = StaticDiscovery("meshllm", WORKERS, MODELS)
    seen: list[set[str]] = []
    first = asyncio.Event()

    async def consume() -> None:
        async for snapshot in disc.watch_instances("worker"):
            seen.append(set(snapshot))
            first.set()

    task = asyncio.create_task(consume())
    async with asyncio.timeout(WAIT_S):
        await first.wait()
        assert not task.done()
        await disc.aclose()
        await task
    assert seen == [{"w1", "w2"}]


async def test_static_rejects_records_that_break_the_key_layout() -> None:
    """Locks: bad static records fail at construction, before anything starts."""
    with pytest.raises(InvalidArgument):
        StaticDiscovery("meshllm", [discovery_pb2.Instance(id="x", component="", endpoint="g")], [])
    with pytest.raises(InvalidArgument):
        StaticDiscovery("meshllm", [], [discovery_pb2.ModelCard(name="", instance_id="x")])


async def test_open_discovery_builds_static_from_the_given_records() -> None:
    """Locks: the factory hands the static records to the static backend."""
    config = PlaneConfig(discovery=DiscoveryKind.STATIC)
    async with await open_discovery(config, static_instances=WORKERS, static_models=MODELS) as disc:
        assert isinstance(disc, StaticDiscovery)
        assert set(await disc.list_models()) == {"w1"}

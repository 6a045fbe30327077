"""The etcd discovery backend against a real etcd: leases, watches, restarts, a registrant in another process."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Generic, NamedTuple, TypeVar

import pytest
import pytest_asyncio

from meshllm.config import DiscoveryKind, PlaneConfig
from meshllm.errors import CannotConnect
from meshllm.plane.discovery.base import open_discovery
from meshllm.plane.discovery.etcd import EtcdDiscovery
from meshllm.testing.servers import EtcdServer, free_port
from meshllm.v1 import discovery_pb2

pytestmark = pytest.mark.integration

T = TypeVar("T")
TTL_S = 3.0
WAIT_S = 30.0  # generous: the machine is small and shared; the bounds are asserted separately
REGISTRANT = Path(__file__).with_name("registrant.py")


class Seen(NamedTuple, Generic[T]):
    position: int
    at: float  # time.monotonic() of arrival
    snapshot: dict[str, T]


class Recorder(Generic[T]):
    """Consumes a watch in the background, stamping each snapshot with its arrival time."""

    def __init__(self, watch: AsyncIterator[dict[str, T]]) -> None:
        self.snapshots: list[tuple[float, dict[str, T]]] = []
        self._changed = asyncio.Condition()
        self._task = asyncio.create_task(self._consume(watch))

    async def _consume(self, watch: AsyncIterator[dict[str, T]]) -> None:
        async for snapshot in watch:
            async with self._changed:
                self.snapshots.append((time.monotonic(), snapshot))
                self._changed.notify_all()

    def mark(self) -> int:
        return len(self.snapshots)

    async def wait_for(self, pred: Callable[[dict[str, T]], bool], *, since: int = 0, within_s: float = WAIT_S) -> Seen[T]:
        """The first snapshot at index >= since that satisfies pred."""

        def found() -> Seen[T] | None:
            hits = (Seen(i, *self.snapshots[i]) for i in range(since, len(self.snapshots)))
            return next((hit for hit in hits if pred(hit.snapshot)), None)

        async with asyncio.timeout(within_s), self._changed:
            await self._changed.wait_for(lambda: found() is not None or self._task.done())
        hit = found()
        assert hit is not None, f"watch ended without a matching snapshot: {self.snapshots}"
        return hit

    async def finished(self) -> None:
        async with asyncio.timeout(WAIT_S):
            await self._task


@pytest_asyncio.fixture
async def watcher(etcd_server: EtcdServer) -> AsyncIterator[EtcdDiscovery]:
    async with await EtcdDiscovery.connect([etcd_server.endpoint], "meshllm", lease_ttl_s=TTL_S) as discovery:
        yield discovery


class Registrant:
    """tests/integration/registrant.py running in its own process; its stderr (logs) is kept in `log`."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.log: list[str] = []
        assert proc.stderr is not None
        self._drain = asyncio.create_task(self._collect(proc.stderr))

    async def _collect(self, stream: asyncio.StreamReader) -> None:
        async for line in stream:
            self.log.append(line.decode(errors="replace"))

    @classmethod
    async def start(cls, endpoint: str, iid: str, address: str) -> Registrant:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(REGISTRANT), "--etcd", endpoint, "--ttl", str(TTL_S), "--id", iid, "--address", address,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        self = cls(proc)
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(WAIT_S):
                line = await proc.stdout.readline()
            assert line.decode().strip() == f"registered {iid}", f"registrant failed: {line!r}"
        except BaseException:
            await self.kill()
            print(self.log_text(), file=sys.stderr)
            raise
        return self

    def log_text(self) -> str:
        return "".join(self.log)

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        async with asyncio.timeout(WAIT_S):
            await self.proc.wait()
            await self._drain


@pytest_asyncio.fixture
async def registrant(etcd_server: EtcdServer) -> AsyncIterator[Registrant]:
    proc = await Registrant.start(etcd_server.endpoint, "w1", "127.0.0.1:9001")
    try:
        yield proc
    finally:
        await proc.kill()


async def test_a_killed_registrants_instance_vanishes_within_the_lease_ttl(
    watcher: EtcdDiscovery, registrant: Registrant
) -> None:
    """Locks: an instance registered by another process is watched; kill -9 removes it within TTL + 2 s."""
    seen = Recorder(watcher.watch_instances("worker", "generate"))
    snapshot = (await seen.wait_for(lambda s: "w1" in s)).snapshot
    assert snapshot["w1"].address == "127.0.0.1:9001" and snapshot["w1"].namespace == "meshllm"

    mark, killed_at = seen.mark(), time.monotonic()
    await registrant.kill()
    gone_at = (await seen.wait_for(lambda s: "w1" not in s, since=mark)).at
    assert gone_at - killed_at <= TTL_S + 2, f"took {gone_at - killed_at:.1f}s to vanish"


@pytest.mark.parametrize("wipe", [True, False], ids=["data-wiped", "data-kept"])
async def test_a_live_registrant_is_visible_again_after_etcd_restarts(
    etcd_server: EtcdServer, watcher: EtcdDiscovery, registrant: Registrant, wipe: bool
) -> None:
    """Locks: after an etcd restart (even with its data gone) the watch resyncs and the registrant re-registers."""
    seen = Recorder(watcher.watch_instances("worker"))
    await seen.wait_for(lambda s: "w1" in s)
    mark = seen.mark()

    await etcd_server.restart(wipe=wipe)
    back_at = time.monotonic()
    seen_at, snapshot = (await seen.wait_for(lambda s: "w1" in s, since=mark))[1:]
    assert seen_at - back_at <= TTL_S + 2, f"took {seen_at - back_at:.1f}s to reappear"
    assert snapshot["w1"].address == "127.0.0.1:9001"
    assert registrant.proc.returncode is None, registrant.log_text()


async def test_a_registration_survives_etcd_unreachable_for_longer_than_the_ttl(
    etcd_server: EtcdServer, watcher: EtcdDiscovery
) -> None:
    """Locks: when etcd stops answering past the TTL (the lease expires there), the record comes back after."""
    seen = Recorder(watcher.watch_instances("worker"))
    async with await EtcdDiscovery.connect([etcd_server.endpoint], "meshllm", lease_ttl_s=TTL_S) as worker:
        await worker.register_instance(discovery_pb2.Instance(id="w4", component="worker", endpoint="generate"))
        await seen.wait_for(lambda s: "w4" in s)
        mark = seen.mark()
        pid = etcd_server.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # etcd frozen: calls time out instead of being refused
        try:
            await asyncio.sleep(TTL_S + 1.5)  # the length of the outage, not a synchronisation
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        gone = await seen.wait_for(lambda s: "w4" not in s, since=mark)  # the lease expired in etcd
        back_at = (await seen.wait_for(lambda s: "w4" in s, since=gone.position)).at
        assert back_at - resumed_at <= TTL_S + 2, f"took {back_at - resumed_at:.1f}s to come back"


async def test_values_in_etcd_are_protobuf_json_readable_with_etcdctl(etcd_server: EtcdServer) -> None:
    """Locks: `etcdctl get --prefix meshllm/v1/` shows each record as protobuf JSON under the documented key."""
    etcdctl = shutil.which("etcdctl")
    assert etcdctl is not None, "etcdctl is not installed"
    async with await EtcdDiscovery.connect([etcd_server.endpoint], "meshllm", lease_ttl_s=TTL_S) as disc:
        await disc.register_instance(
            discovery_pb2.Instance(id="w7", component="worker", endpoint="generate", address="10.1.2.3:4567")
        )
        proc = await asyncio.create_subprocess_exec(
            etcdctl, "--endpoints", f"http://{etcd_server.endpoint}", "get", "--prefix", "meshllm/v1/",
            env={**os.environ, "ETCDCTL_API": "3"}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        async with asyncio.timeout(WAIT_S):
            out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert lines[0] == "meshllm/v1/meshllm/instances/worker/generate/w7"
    value = json.loads(lines[1])
    assert value["address"] == "10.1.2.3:4567" and value["id"] == "w7" and value["namespace"] == "meshllm"


async def test_a_model_card_round_trips_through_etcd_and_unregister_removes_it(
    etcd_server: EtcdServer, watcher: EtcdDiscovery
) -> None:
    """Locks: register_model -> watch_models sees the card; unregister (lease revoke) removes it; re-register works."""
    config = PlaneConfig(discovery=DiscoveryKind.ETCD, etcd_endpoints=(etcd_server.endpoint,), lease_ttl_s=TTL_S)
    seen = Recorder(watcher.watch_models("org/model"))
    assert (await seen.wait_for(lambda s: True)).snapshot == {}
    async with await open_discovery(config) as worker:
        assert isinstance(worker, EtcdDiscovery)
        card = discovery_pb2.ModelCard(name="org/model", instance_id="w1", kv_block_size=16, eos_token_ids=[2, 7])
        await worker.register_model(card)
        assert (await seen.wait_for(lambda s: "w1" in s)).snapshot["w1"] == card
        assert set(await watcher.list_models()) == {"w1"}

        mark = seen.mark()
        await worker.unregister()
        await seen.wait_for(lambda s: not s, since=mark)
        await worker.unregister()  # idempotent
        mark = seen.mark()
        await worker.register_model(card)  # a new lease is granted
        await seen.wait_for(lambda s: "w1" in s, since=mark)
    await watcher.aclose()
    await seen.finished()  # the watch ends when its Discovery closes


async def test_closing_revokes_the_lease_so_records_vanish_before_the_ttl(
    etcd_server: EtcdServer, watcher: EtcdDiscovery
) -> None:
    """Locks: aclose() revokes the lease: watchers see the instance go at once, not after a long TTL."""
    long_ttl = 60.0
    seen = Recorder(watcher.watch_instances())
    worker = await EtcdDiscovery.connect([etcd_server.endpoint], "meshllm", lease_ttl_s=long_ttl)
    await worker.register_instance(discovery_pb2.Instance(id="w2", component="worker", endpoint="generate"))
    await seen.wait_for(lambda s: "w2" in s)
    mark = seen.mark()
    await worker.aclose()
    await seen.wait_for(lambda s: not s, since=mark, within_s=long_ttl / 2)
    await worker.aclose()  # idempotent


async def test_connecting_to_an_unreachable_etcd_raises_cannot_connect() -> None:
    """Locks: a dead endpoint is a clear CannotConnect at startup, not a hang."""
    with pytest.raises(CannotConnect, match="cannot reach etcd"):
        async with asyncio.timeout(WAIT_S):
            await EtcdDiscovery.connect([f"127.0.0.1:{free_port()}"], "meshllm")


async def test_connect_falls_over_to_the_next_endpoint(etcd_server: EtcdServer) -> None:
    """Locks: with several endpoints, the first one that answers is used."""
    dead = f"127.0.0.1:{free_port()}"
    async with await EtcdDiscovery.connect([dead, etcd_server.endpoint], "meshllm") as disc:
        assert disc.endpoint == etcd_server.endpoint
        await disc.register_instance(discovery_pb2.Instance(id="w3", component="worker", endpoint="generate"))
        assert set(await disc.list_instances("worker")) == {"w3"}

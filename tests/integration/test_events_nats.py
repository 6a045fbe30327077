"""The NATS event bus against a real nats-server: across processes, through restarts and outages."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import ModuleType

import nats
import pytest

from meshllm.errors import CannotConnect
from meshllm.plane.events.base import Subscription
from meshllm.plane.events.nats import NatsEventBus
from meshllm.protocol.names import kv_subject
from meshllm.testing.servers import NatsServer, free_port
from meshllm.v1.events_pb2 import KvEventBatch

pytestmark = pytest.mark.integration

NS = "itest"
PUBLISHER = Path(__file__).with_name("publisher.py")
DEADLINE_S = 20.0  # generous: the machine is small and shared; tests normally finish in well under a second


def _load_publisher() -> ModuleType:
    spec = importlib.util.spec_from_file_location("meshllm_test_publisher", PUBLISHER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


publisher = _load_publisher()


class Collector:
    """Consumes a subscription in the background so that tests can wait for conditions on what arrived."""

    def __init__(self, sub: Subscription[KvEventBatch]) -> None:
        self.sub = sub
        self.received: list[KvEventBatch] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for msg in self.sub:
            self.received.append(msg)
            self._changed.set()

    async def wait_for(self, condition: Callable[[list[KvEventBatch]], bool], timeout_s: float = DEADLINE_S) -> None:
        async with asyncio.timeout(timeout_s):
            while not condition(self.received):
                self._changed.clear()
                await self._changed.wait()

    async def aclose(self) -> None:
        await self.sub.aclose()
        await self._task


@contextlib.asynccontextmanager
async def collect(bus: NatsEventBus, subject: str) -> AsyncIterator[Collector]:
    collector = Collector(await bus.subscribe(subject, KvEventBatch))
    try:
        yield collector
    finally:
        await collector.aclose()


@contextlib.asynccontextmanager
async def publisher_process(url: str, subject: str, worker_id: str, *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(PUBLISHER), url, subject, worker_id, *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(DEADLINE_S):
            assert await proc.stdout.readline() == b"ready\n"
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def tell(proc: asyncio.subprocess.Process, line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(f"{line}\n".encode())
    await proc.stdin.drain()


async def wait_until(condition: Callable[[], bool], timeout_s: float = DEADLINE_S) -> None:
    """Poll a condition that no event announces (the client's connection state), bounded by a deadline."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - polling a state, there is no event to wait on
            await asyncio.sleep(0.02)


def _stopped(pid: int) -> bool:
    """Every thread of the process is stopped (state T in /proc)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
    return bool(states) and all(state in ("T", "t") for state in states)


async def test_a_batch_published_in_another_process_arrives_decoded_with_the_same_fields(
    nats_server: NatsServer,
) -> None:
    """Locks: KvEventBatch crosses processes as protobuf binary and decodes field for field."""
    subject = kv_subject(NS, "backend")
    async with await NatsEventBus.connect(nats_server.url) as bus, collect(bus, kv_subject(NS, "*")) as got:
        async with publisher_process(nats_server.url, subject, "worker-a", "--count", "5") as proc:
            async with asyncio.timeout(DEADLINE_S):
                assert await proc.wait() == 0
        await got.wait_for(lambda r: len(r) >= 5)
        assert got.received == [publisher.make_batch("worker-a", n) for n in range(1, 6)]
        assert got.received[0].events[0].stored.parent_hash == 2**64 - 2
        assert got.received[4].events[1].removed.block_hashes == [5, 6]


async def test_a_subscriber_keeps_receiving_after_nats_server_restarts(nats_server: NatsServer) -> None:
    """Locks: subscriptions survive a server restart; publishers in and out of process reconnect by themselves.

    Both publishers stamp their batches with a phase (dp_rank) switched to 1
    only after the restart returned, so a phase-1 batch can only have come
    through the new server.
    """
    subject = kv_subject(NS, "backend")
    url = nats_server.url
    async with (
        await NatsEventBus.connect(url, reconnect_wait_s=0.1) as sub_bus,
        await NatsEventBus.connect(url, reconnect_wait_s=0.1) as pub_bus,
        collect(sub_bus, kv_subject(NS, "*")) as got,
        publisher_process(url, subject, "remote", "--interval-ms", "20") as proc,
    ):
        phase = 0

        async def publish_locally() -> None:
            n = 0
            while True:
                n += 1
                pub_bus.publish(subject, publisher.make_batch("local", n, phase))
                await asyncio.sleep(0.02)  # publishing pace

        def seen(worker: str, in_phase: int) -> Callable[[list[KvEventBatch]], bool]:
            return lambda r: any(b.worker_id == worker and b.dp_rank == in_phase for b in r)

        local = asyncio.create_task(publish_locally())
        try:
            await got.wait_for(lambda r: seen("local", 0)(r) and seen("remote", 0)(r))
            await nats_server.restart()
            phase = 1
            await tell(proc, "phase 1")
            await got.wait_for(lambda r: seen("local", 1)(r) and seen("remote", 1)(r))
        finally:
            local.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await local
        await tell(proc, "stop")
        async with asyncio.timeout(DEADLINE_S):
            assert await proc.wait() == 0
        await wait_until(lambda: sub_bus.reconnects >= 1 and pub_bus.reconnects >= 1)


async def test_publish_while_the_server_is_down_buffers_and_the_rest_arrives_after_it_returns(
    nats_server: NatsServer,
) -> None:
    """Locks: publish neither blocks nor raises during an outage; the newest `max_buffered` go out after it.

    One bus both subscribes and publishes, so that on reconnect the client
    replays its subscription before the buffered messages.
    """
    subject = kv_subject(NS, "backend")
    async with (
        await NatsEventBus.connect(nats_server.url, reconnect_wait_s=0.1, max_buffered=4) as bus,
        collect(bus, subject) as got,
    ):
        bus.publish(subject, publisher.make_batch("w", 100))
        await got.wait_for(lambda r: len(r) == 1)
        await nats_server.stop()
        await wait_until(lambda: not bus.connected)
        for n in range(1, 11):
            bus.publish(subject, publisher.make_batch("w", n))
        assert (bus.buffered, bus.dropped) == (4, 6)
        with pytest.raises(TimeoutError):
            await bus.flush(timeout_s=0.2)
        await nats_server.start()
        await bus.flush(timeout_s=DEADLINE_S)
        await got.wait_for(lambda r: len(r) == 5)
        assert [b.events[0].event_id for b in got.received] == [2 * n - 1 for n in (100, 7, 8, 9, 10)]


async def test_a_flush_that_times_out_leaves_the_connection_working(nats_server: NatsServer) -> None:
    """Locks: a flush deadline never cancels the client's PONG wait (a late PONG would kill nats-py's reader).

    The server is frozen with SIGSTOP so that the PONG comes only after the
    deadline passed; afterwards the same connection must still deliver.
    """
    subject = kv_subject(NS, "backend")
    async with await NatsEventBus.connect(nats_server.url) as bus, collect(bus, subject) as got:
        pid = nats_server._proc.pid if nats_server._proc is not None else 0
        assert pid
        os.kill(pid, signal.SIGSTOP)
        try:
            await wait_until(lambda: _stopped(pid))  # SIGSTOP lands asynchronously, thread by thread
            bus.publish(subject, publisher.make_batch("w", 1))
            with pytest.raises(TimeoutError):
                await bus.flush(timeout_s=0.3)
        finally:
            os.kill(pid, signal.SIGCONT)
        await got.wait_for(lambda r: len(r) == 1)
        bus.publish(subject, publisher.make_batch("w", 2))
        await bus.flush(timeout_s=DEADLINE_S)
        await got.wait_for(lambda r: len(r) == 2)
        assert bus.connected and bus.reconnects == 0


async def test_close_flushes_what_was_just_published(nats_server: NatsServer) -> None:
    """Locks: `aclose()` hands pending messages to the server before it closes the connection."""
    subject = kv_subject(NS, "backend")
    async with await NatsEventBus.connect(nats_server.url) as sub_bus, collect(sub_bus, subject) as got:
        pub_bus = await NatsEventBus.connect(nats_server.url)
        for n in range(1, 51):
            pub_bus.publish(subject, publisher.make_batch("w", n))
        await pub_bus.aclose()
        await pub_bus.aclose()
        await got.wait_for(lambda r: len(r) == 50)
        assert pub_bus.dropped == 0


async def test_garbage_from_a_foreign_publisher_is_skipped(nats_server: NatsServer) -> None:
    """Locks: a payload that is no KvEventBatch is logged and skipped; the subscription goes on."""
    subject = kv_subject(NS, "backend")
    async with await NatsEventBus.connect(nats_server.url) as bus, collect(bus, subject) as got:
        foreign = await nats.connect(nats_server.url)
        try:
            await foreign.publish(subject, b"\n\x01\xff")
            await foreign.publish(subject, publisher.make_batch("w", 1).SerializeToString())
            await foreign.flush()
        finally:
            await foreign.close()
        await got.wait_for(lambda r: len(r) == 1)
        assert got.received == [publisher.make_batch("w", 1)]
        assert got.sub.decode_errors == 1


async def test_connecting_to_no_server_fails_with_cannot_connect() -> None:
    """Locks: the first connection is bounded; a wrong URL stops a service at startup with a clear error."""
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(CannotConnect, match=url):
        await NatsEventBus.connect(url, connect_timeout_s=0.5, reconnect_wait_s=0.1)

"""The worker runtime in-process: a real gRPC server around an engine, memory planes.

Locks the per-request clauses of issue 3: cancellation → context stopped and
abort called once; typed errors cross the wire; exactly one terminal chunk or
a gRPC error; draining → UNAVAILABLE; optional RPCs → UNIMPLEMENTED; KV
events numbered and snapshotted; the debug validator names broken clauses;
the shutdown order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, Self

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshllm import errors
from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.engine.base import Context, EngineConfig, TokenChunk, TokenRequest, terminal
from meshllm.engine.sample import SampleEngine
from meshllm.engine.worker_config import WorkerConfig
from meshllm.plane.discovery.base import MemoryDiscovery, MemoryStore
from meshllm.plane.events.base import MemoryBroker, MemoryEventBus
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.names import kv_subject
from meshllm.testing.waiting import wait_until
from meshllm.v1 import events_pb2
from meshllm.worker.client import WorkerClient
from meshllm.worker.runtime import Worker

PLANE = PlaneConfig(discovery=DiscoveryKind.MEMORY, events=EventsKind.MEMORY)


def config(**kw: Any) -> WorkerConfig:
    base: dict[str, Any] = {"engine": "test", "plane": PLANE, "grace_period_s": 0.0, "drain_timeout_s": 5.0}
    base.update(kw)
    return WorkerConfig(**base)


class RecordingEngine(SampleEngine):
    """The sample engine, recording aborts and lifecycle calls; emits KV events on demand."""

    calls: list[str]

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.calls = []
        self.aborted: list[str] = []
        self.abort_seen = asyncio.Event()
        self.started_streams = asyncio.Event()

    @classmethod
    async def from_args(cls, argv: Sequence[str]) -> tuple[Self, WorkerConfig]:
        return cls(), config()

    async def start(self, worker_id: str) -> EngineConfig:
        self.calls.append("start")
        return EngineConfig(model="rec", kv_block_size=4, total_kv_blocks=100)

    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        mode = request.get("annotations", {}).get("mode")
        if mode == "typed":
            raise errors.ContextLengthExceeded("prompt is 9000 tokens, context is 8192", param="prompt")
        if mode == "bare":
            raise KeyError("oops")
        if mode == "kv":
            self.sink.blocks_stored([(11, 1), (12, 2)], None)
            self.sink.blocks_stored([(13, 3)], 12)
            self.sink.blocks_removed([11])
        self.started_streams.set()
        async for chunk in super().generate(request, context):
            yield chunk

    async def abort(self, context: Context) -> None:
        self.aborted.append(context.id)
        self.abort_seen.set()

    async def drain(self) -> None:
        self.calls.append("drain")

    async def cleanup(self) -> None:
        self.calls.append("cleanup")


@pytest.fixture
async def planes() -> AsyncIterator[tuple[MemoryStore, MemoryBroker]]:
    yield MemoryStore(), MemoryBroker()


async def start(engine: RecordingEngine, planes: tuple[MemoryStore, MemoryBroker], **kw: Any) -> Worker:
    store, broker = planes
    return await Worker.start(engine, config(**kw), memory_store=store, memory_broker=broker)


async def collect(stream: AsyncIterator[TokenChunk]) -> list[TokenChunk]:
    return [c async for c in stream]


async def test_generate_streams_tokens_then_exactly_one_terminal(planes: tuple[MemoryStore, MemoryBroker]) -> None:
    engine = RecordingEngine()
    async with await start(engine, planes) as w, ChannelCache() as ch:
        chunks = await collect(
            WorkerClient(ch, w.address).generate({"request_id": "r1", "token_ids": [5], "stop": {"max_tokens": 4}})
        )
    tokens = [t for c in chunks for t in c.get("token_ids", [])]
    assert tokens == [6, 7, 8, 9]
    assert [c.get("finish_reason") for c in chunks].count("length") == 1 and "finish_reason" in chunks[-1]
    assert chunks[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "cached_tokens": 0}


async def test_worker_registers_instance_and_model_card_then_unregisters(planes: tuple[MemoryStore, MemoryBroker]) -> None:
    store, _ = planes
    async with MemoryDiscovery(store) as watcher:
        w = await start(RecordingEngine(), planes, model_name="my-model")
        instances = await watcher.list_instances("worker", "generate")
        models = await watcher.list_models("my-model")
        assert instances[w.id].address == w.address
        assert models[w.id].kv_block_size == 4 and models[w.id].name == "my-model"
        await w.aclose()
        assert await watcher.list_instances("worker") == {}


async def test_client_cancel_stops_context_and_calls_abort_once(planes: tuple[MemoryStore, MemoryBroker]) -> None:
    """Locks: gRPC cancellation → context stopped → engine.abort(context) called exactly once."""
    engine = RecordingEngine(token_delay_ms=20)
    async with await start(engine, planes) as w, ChannelCache() as ch:
        stream = WorkerClient(ch, w.address).generate({"request_id": "long", "token_ids": [1], "stop": {"max_tokens": 10_000}})
        got = [await anext(stream) for _ in range(3)]
        assert all(c["token_ids"] for c in got)
        await stream.aclose()  # drops the iterator → cancels the RPC
        async with asyncio.timeout(5):
            await engine.abort_seen.wait()
            await w.servicer.wait_idle()  # type: ignore[union-attr]
    assert engine.aborted == ["long"]


class SlowAbortEngine(RecordingEngine):
    """engine.abort waits for a gate: the worker's shutdown must wait for it before engine.cleanup."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.gate = asyncio.Event()
        self.drained = asyncio.Event()

    async def abort(self, context: Context) -> None:
        await super().abort(context)
        await self.gate.wait()
        self.calls.append("abort done")

    async def drain(self) -> None:
        await super().drain()
        self.drained.set()


async def test_shutdown_lets_an_abort_under_way_finish_before_engine_cleanup(planes: tuple[MemoryStore, MemoryBroker]) -> None:
    """Locks the shutdown order: an engine.abort still running is awaited (it is owned), then cleanup runs."""
    engine = SlowAbortEngine(token_delay_ms=20)
    w = await start(engine, planes)
    async with ChannelCache() as ch:
        stream = WorkerClient(ch, w.address).generate({"request_id": "a", "token_ids": [1], "stop": {"max_tokens": 10_000}})
        await anext(stream)
        await stream.aclose()
        async with asyncio.timeout(5):
            await engine.abort_seen.wait()
    closing = asyncio.create_task(w.aclose())
    async with asyncio.timeout(5):
        await engine.drained.wait()  # engine.drain comes just before the cleanup step
    await asyncio.sleep(0)
    assert "cleanup" not in engine.calls
    engine.gate.set()
    async with asyncio.timeout(10):
        await closing
    assert engine.calls.index("abort done") < engine.calls.index("cleanup")


async def test_abort_rpc_ends_the_stream_with_a_cancelled_terminal(planes: tuple[MemoryStore, MemoryBroker]) -> None:
    engine = RecordingEngine(token_delay_ms=20)
    async with await start(engine, planes) as w, ChannelCache() as ch:
        client = WorkerClient(ch, w.address)
        stream = client.generate({"request_id": "a1", "token_ids": [1], "stop": {"max_tokens": 10_000}})
        await anext(stream)
        assert await client.abort("a1") is True
        rest = await collect(stream)
        assert rest[-1]["finish_reason"] == "cancelled"
        assert await client.abort("a1") is False
    assert engine.aborted == ["a1"]


async def test_engine_errors_cross_the_wire(planes: tuple[MemoryStore, MemoryBroker]) -> None:
    """Locks: typed errors arrive as the same class; others become Unknown with their message."""
    async with await start(RecordingEngine(), planes) as w, ChannelCache() as ch:
        client = WorkerClient(ch, w.address)
        with pytest.raises(errors.ContextLengthExceeded, match="context is 8192"):
            await collect(client.generate({"request_id": "t", "token_ids": [1], "annotations": {"mode": "typed"}}))
        with pytest.raises(errors.Unknown, match="KeyError"):
            await collect(client.generate({"request_id": "b", "token_ids": [1], "annotations": {"mode": "bare"}}))
        with pytest.raises(errors.InvalidArgument):
            await collect(client.generate({"request_id": "e", "token_ids": []}))
        # the server is still serving after each failure
        assert (await collect(client.generate({"request_id": "ok", "token_ids": [1], "stop": {"max_tokens": 1}})))[-1][
            "finish_reason"
        ]


async def test_optional_rpcs_answer_unimplemented(planes: tuple[MemoryStore, MemoryBroker]) -> None:
    async with await start(RecordingEngine(), planes) as w, ChannelCache() as ch:
        client = WorkerClient(ch, w.address)
        with pytest.raises(errors.Unimplemented):
            [c async for c in client.pull_kv(b"h")]
        with pytest.raises(errors.Unimplemented):
            await client.get_model_files()
        with pytest.raises(errors.Unimplemented):
            await client.clear_kv_blocks()
        info = await client.get_info()
        assert info.engine.model == "rec" and info.instance.id == w.id


async def test_kv_events_are_numbered_published_and_snapshotted(planes: tuple[MemoryStore, MemoryBroker]) -> None:
    """Locks: per-worker monotonically increasing event ids; GetKvSnapshot = the resident block set."""
    _, broker = planes
    async with MemoryEventBus(broker) as bus:
        sub = await bus.subscribe(kv_subject("meshllm", "worker"), events_pb2.KvEventBatch)
        async with await start(RecordingEngine(), planes) as w, ChannelCache() as ch:
            client = WorkerClient(ch, w.address)
            await collect(client.generate({"request_id": "k", "token_ids": [1], "annotations": {"mode": "kv"}}))
            ids: list[int] = []
            async with asyncio.timeout(5):
                async for batch in sub:
                    assert batch.worker_id == w.id
                    ids.extend(e.event_id for e in batch.events)
                    if len(ids) >= 3:
                        break
            assert ids == [1, 2, 3]
            snap = await client.get_kv_snapshot()
            assert snap.last_event_id == 3
            assert sorted(snap.ranks[0].block_hashes) == [12, 13]


async def test_draining_worker_refuses_new_requests_and_finishes_inflight(planes: tuple[MemoryStore, MemoryBroker]) -> None:
    """Locks: shutdown order — unregister, stop admitting (UNAVAILABLE, NOT_SERVING), in-flight completes, drain, cleanup."""
    store, _ = planes
    engine = RecordingEngine(token_delay_ms=10)
    w = await start(engine, planes, grace_period_s=0.2)
    async with ChannelCache() as ch, MemoryDiscovery(store) as watcher:
        client = WorkerClient(ch, w.address)
        stream = client.generate({"request_id": "inflight", "token_ids": [1], "stop": {"max_tokens": 60}})
        await anext(stream)
        closing = asyncio.create_task(w.aclose())

        async def unregistered() -> bool:
            return not await watcher.list_instances("worker")

        await wait_until(unregistered, timeout_s=5, what="the instance to leave discovery")
        assert not closing.done()
        await wait_until(lambda: not w.servicer.admitting, timeout_s=5, what="admission to stop")  # type: ignore[union-attr]
        with pytest.raises(errors.EngineShutdown):
            await collect(client.generate({"request_id": "late", "token_ids": [1]}))
        health = await health_pb2_grpc.HealthStub(ch.get(w.address)).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        rest = await collect(stream)
        assert rest[-1]["finish_reason"] == "length" and rest[-1]["usage"]["completion_tokens"] == 60
        await closing
    assert engine.calls == ["start", "drain", "cleanup"]
    assert w.shutdown.completed == [
        "unregister", "grace period", "stop admitting", "wait for in-flight",
        "engine.drain", "engine.cleanup", "stop server", "close planes",
    ]  # fmt: skip
    assert w.metrics.cleanup_time._value.get() >= 0  # type: ignore[attr-defined]


class BrokenEngine(RecordingEngine):
    """Emits a chunk after its terminal chunk."""

    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        yield {"token_ids": [1]}
        yield terminal("length", {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0})
        yield {"token_ids": [2]}


async def test_validator_names_the_broken_clause(planes: tuple[MemoryStore, MemoryBroker]) -> None:
    async with await start(BrokenEngine(), planes, validate_streams=True) as w, ChannelCache() as ch:
        with pytest.raises(errors.Unknown, match="nothing after the terminal"):
            await collect(WorkerClient(ch, w.address).generate({"request_id": "v", "token_ids": [1]}))


class SickEngine(RecordingEngine):
    healthy = True

    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        if not self.healthy:
            raise errors.Unknown("GPU fell off the bus")
        async for c in super().generate(request, context):
            yield c


async def test_failing_canary_turns_health_not_serving(planes: tuple[MemoryStore, MemoryBroker]) -> None:
    engine = SickEngine()
    async with await start(engine, planes, health_check_interval_s=0.05) as w:
        stub = health_pb2_grpc.HealthStub(grpc.aio.insecure_channel(w.address))
        assert (await stub.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING

        async def serving() -> bool:
            return (await stub.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING

        engine.healthy = False
        await wait_until(lambda: _not(serving()), timeout_s=5, what="NOT_SERVING after failed canaries")
        engine.healthy = True
        await wait_until(serving, timeout_s=5, what="SERVING after a good canary")


async def _not(value: Awaitable[bool]) -> bool:
    return not await value

"""Helpers shared by the router component tests: in-process workers on memory planes and a RouterCore.

Not a test module of its own (it holds no tests); the router test modules import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.engine.base import DisaggregationMode, LLMEngine
from meshllm.engine.mocker import MockerConfig, MockerEngine
from meshllm.engine.worker_config import WorkerConfig
from meshllm.plane.discovery.base import MemoryDiscovery, MemoryStore
from meshllm.plane.events.base import MemoryBroker, MemoryEventBus
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.router.config import RouterConfig, RoutingTuning
from meshllm.router.core import RouterCore
from meshllm.worker.runtime import Worker

PLANE = PlaneConfig(discovery=DiscoveryKind.MEMORY, events=EventsKind.MEMORY)


def mocker(**kw: Any) -> MockerEngine:
    """A fast mocker: block size 16, high speedup unless told otherwise."""
    base: dict[str, Any] = {"block_size": 16, "num_gpu_blocks": 2048, "speedup_ratio": 50.0, "context_length": 4096}
    base.update(kw)
    return MockerEngine(MockerConfig(**base))


async def wait_for(
    predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition", state: Callable[[], object] | None = None
) -> None:
    """Poll `predicate` until it holds; AssertionError after `timeout_s` (a deadline, not a sleep).

    `state`, when given, describes what was seen instead; its value goes into the error.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            seen = f"; saw {state()}" if state is not None else ""
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}{seen}")
        await asyncio.sleep(0.01)


def router_config(**cfg: Any) -> RouterConfig:
    """A RouterConfig on the in-memory planes; the tuning fields (`RoutingTuning`'s) may be named directly."""
    tuning = {k: cfg.pop(k) for k in list(cfg) if k in RoutingTuning.__dataclass_fields__}
    return RouterConfig(plane=PLANE, tuning=RoutingTuning(**tuning), **cfg)


async def collect(stream: AsyncIterator[TokenChunk]) -> list[TokenChunk]:
    return [c async for c in stream]


async def collect_via(core: RouterCore, req: TokenRequest, via: str) -> tuple[list[TokenChunk], int]:
    """The caller's whole stream of `core.generate(req)` and how many chunks its iterator yielded.

    `via` "iterator": every chunk through the iterator (a Generate call, the frontend's embedded core);
    "sink": as the router's GenerateSession relays it, worker chunks to a sink, the rest through the iterator.
    """
    got: list[TokenChunk] = []
    yielded = 0
    async for chunk in core.generate(req, call=CallInfo(relay=got.append if via == "sink" else None)):
        got.append(chunk)
        yielded += 1
    return got, yielded


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.get("token_ids", ())]


def request(rid: str, tokens: list[int], max_tokens: int = 8, **kw: Any) -> TokenRequest:
    req: TokenRequest = {"request_id": rid, "token_ids": tokens, "stop": {"max_tokens": max_tokens, "ignore_eos": True}}
    req.update(kw)  # type: ignore[typeddict-item]
    return req


@dataclass
class Mesh:
    """Memory planes, workers and routers of one test; `aclose` stops everything."""

    store: MemoryStore = field(default_factory=MemoryStore)
    broker: MemoryBroker = field(default_factory=MemoryBroker)
    workers: list[Worker] = field(default_factory=list)
    cores: list[RouterCore] = field(default_factory=list)
    channels: ChannelCache = field(default_factory=ChannelCache)
    _closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def worker(
        self, engine: LLMEngine, *, role: str = "agg", model: str | None = None, instance_id: str | None = None
    ) -> Worker:
        cfg = WorkerConfig(
            engine="test", plane=PLANE, role=DisaggregationMode(role), grace_period_s=0.0, drain_timeout_s=5.0,
            model_name=model, instance_id=instance_id, health_check_interval_s=3600,
        )  # fmt: skip
        w = await Worker.start(engine, cfg, memory_store=self.store, memory_broker=self.broker)
        self.workers.append(w)
        return w

    async def router(self, *, wait_workers: int | None = None, wait_synced: bool = True, **cfg: Any) -> RouterCore:
        config = router_config(**cfg)
        discovery = MemoryDiscovery(self.store)
        bus = MemoryEventBus(self.broker)
        core = RouterCore(config, discovery, bus, self.channels)
        await core.start()
        self.cores.append(core)

        async def close() -> None:
            await core.aclose()
            await bus.aclose()
            await discovery.aclose()

        self._closers.append(close)
        if wait_synced:
            n = len(self.workers) if wait_workers is None else wait_workers
            await core.pool.wait_until(lambda: len(core.pool.all()) >= n, 10.0)
            await core.feed.wait_synced(10.0)
        return core

    async def close_router(self, core: RouterCore) -> None:
        i = self.cores.index(core)
        self.cores.pop(i)
        await self._closers.pop(i)()

    async def aclose(self) -> None:
        for close in reversed(self._closers):
            with contextlib.suppress(Exception):
                await close()
        for w in self.workers:
            with contextlib.suppress(Exception):
                await w.aclose()
        await self.channels.aclose()


@contextlib.asynccontextmanager
async def mesh() -> AsyncIterator[Mesh]:
    m = Mesh()
    try:
        yield m
    finally:
        await m.aclose()

"""Where the frontend sends token-level requests: the `Upstream` seam and its router-replica form.

An upstream is anything with the router's `generate` signature: the embedded
`meshllm.router.RouterCore`, one `RouterClient`, or `RouterReplicas` (several
router processes, `--router-address a,b`). The frontend never talks to
workers directly; the router picks them. `WorkerPool` is a minimal
round-robin upstream over discovered workers, for tests and for a frontend
without a router package.

Contract (the router's): the stream ends with exactly one terminal chunk;
an unknown model raises `NotFound`, no live worker `Unavailable`; dropping the
iterator cancels the request all the way to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from meshllm.errors import CannotConnect, NotFound, Unavailable
from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.discovery import Discovery
from meshllm.plane.transport import CallInfo, ChannelCache
from meshllm.protocol.types import GenerateChunk, GenerateRequest
from meshllm.v1 import discovery_pb2
from meshllm.worker.client import WorkerClient

__all__ = ["RouterReplicas", "Upstream", "WorkerPool"]

log = logging.getLogger(__name__)


class Upstream(Protocol):
    """The router's generate signature: token-level request in, chunks out."""

    def generate(self, request: GenerateRequest, *, call: CallInfo | None = None) -> AsyncIterator[GenerateChunk]: ...


class _Generating(Protocol):
    address: str

    def generate(self, request: GenerateRequest, *, call: CallInfo | None = None) -> AsyncIterator[GenerateChunk]: ...


async def _first_of(
    candidates: Sequence[_Generating], request: GenerateRequest, call: CallInfo | None
) -> AsyncIterator[GenerateChunk]:
    """Stream from the first candidate that answers; fail over on connection errors before the first chunk."""
    last: Unavailable | None = None
    for target in candidates:
        stream = target.generate(request, call=call)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            return
        except (CannotConnect, Unavailable) as exc:  # includes EngineShutdown: a draining peer
            log.debug("upstream %s unavailable: %s", target.address, exc.message)
            last = exc
            await _aclose(stream)
            continue
        try:
            yield first
            async for chunk in stream:
                yield chunk
        finally:
            await _aclose(stream)
        return
    raise last if last is not None else Unavailable("no upstream is configured")


async def _aclose(stream: AsyncIterator[GenerateChunk]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


class RouterReplicas:
    """Round-robin over router replicas (`--router-address a,b`), failing over before the first chunk."""

    def __init__(self, clients: Sequence[_Generating]) -> None:
        if not clients:
            raise ValueError("RouterReplicas needs at least one client")
        self._clients = list(clients)
        self._next = itertools.count()

    @classmethod
    def connect(
        cls, channels: ChannelCache, addresses: Sequence[str], client: Callable[[ChannelCache, str], _Generating]
    ) -> RouterReplicas:
        return cls([client(channels, a) for a in addresses])

    def generate(self, request: GenerateRequest, *, call: CallInfo | None = None) -> AsyncIterator[GenerateChunk]:
        start = next(self._next) % len(self._clients)
        order = self._clients[start:] + self._clients[:start]
        return _first_of(order, request, call)


class WorkerPool(AsyncCloseable):
    """Round-robin over the workers discovery lists for each model (no KV awareness, no migration)."""

    def __init__(self, discovery: Discovery, channels: ChannelCache, *, component: str = "worker") -> None:
        self._discovery = discovery
        self._channels = channels
        self._component = component
        self._by_model: dict[str, list[WorkerClient]] = {}
        self._next = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    async def start(self) -> WorkerPool:
        self._task = asyncio.create_task(self._watch(), name="worker-pool-watch")
        await self._ready.wait()
        return self

    async def _watch(self) -> None:
        clients: dict[str, WorkerClient] = {}
        try:
            async for snapshot in self._discovery.watch_instances(self._component):
                by_model: dict[str, list[WorkerClient]] = {}
                for inst in snapshot.values():
                    if inst.role == discovery_pb2.WORKER_ROLE_PREFILL:
                        continue
                    client = clients.get(inst.address) or WorkerClient(self._channels, inst.address)
                    clients[inst.address] = client
                    by_model.setdefault(inst.model, []).append(client)
                self._by_model = by_model
                self._ready.set()
        finally:
            self._ready.set()

    def models(self) -> list[str]:
        return sorted(self._by_model)

    async def generate(self, request: GenerateRequest, *, call: CallInfo | None = None) -> AsyncIterator[GenerateChunk]:
        model = request.get("model", "")
        pool = self._by_model.get(model)
        if not pool:
            raise NotFound(f"model {model!r} is not served", param="model") if pool is None else Unavailable(
                f"no live worker serves {model!r}"
            )
        start = next(self._next) % len(pool)
        async for chunk in _first_of(pool[start:] + pool[:start], request, call):
            yield chunk

    async def _aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

"""A small in-process mesh with every gRPC server of meshllm: a mocker worker, a router server, a frontend.

All on shared memory planes, with real gRPC (and the frontend's HTTP) on
loopback ports, so tests can talk to each server over the wire: the fuzz
tests (tests/faults) and the status-discipline component tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig, ServerConfig
from meshllm.engine.mocker import MockerConfig, MockerEngine
from meshllm.engine.worker_config import WorkerConfig
from meshllm.frontend.config import FrontendConfig
from meshllm.frontend.main import Frontend
from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.auth import MeshSecurity
from meshllm.plane.discovery.base import MemoryStore
from meshllm.plane.events.base import MemoryBroker
from meshllm.router.config import RouterConfig
from meshllm.router.main import RouterServer
from meshllm.worker.runtime import Worker

__all__ = ["CONTEXT_LENGTH", "MODEL", "VOCAB_SIZE", "MiniMesh", "start_mini_mesh"]

PLANE = PlaneConfig(discovery=DiscoveryKind.MEMORY, events=EventsKind.MEMORY)
MODEL = "mocker"
CONTEXT_LENGTH = 2048
VOCAB_SIZE = 32000


@dataclass
class MiniMesh:
    """One mocker worker, a router server and a frontend on shared memory planes."""

    worker: Worker
    router: RouterServer
    frontend: Frontend

    @property
    def worker_address(self) -> str:
        return self.worker.address

    @property
    def router_address(self) -> str:
        return self.router.address

    @property
    def frontend_grpc(self) -> str:
        address = self.frontend.grpc_address
        assert address is not None
        return address

    async def aclose(self) -> None:
        await self.frontend.aclose()
        await self.router.aclose()
        await self.worker.aclose()


async def start_mini_mesh(
    *,
    engine: MockerEngine | None = None,
    security: Callable[[str], MeshSecurity] | None = None,
    via_router: bool = False,
    **frontend: Any,
) -> MiniMesh:
    """Start the three servers; returns once the frontend and the router know the worker.

    `security(role)` ("worker", "router", "frontend") gives each server its TLS / mesh token; with
    `via_router` the frontend calls the router server instead of its embedded routing core;
    `frontend` overrides FrontendConfig fields.
    """
    store, broker = MemoryStore(), MemoryBroker()
    sec = security or (lambda role: MeshSecurity())
    if engine is None:
        engine = MockerEngine(
            MockerConfig(
                block_size=16, num_gpu_blocks=4096, speedup_ratio=1000.0, context_length=CONTEXT_LENGTH, vocab_size=VOCAB_SIZE
            )
        )
    worker = await Worker.start(
        engine,
        WorkerConfig(engine="mocker", plane=PLANE, grace_period_s=0.0, health_check_interval_s=3600, security=sec("worker")),
        memory_store=store,
        memory_broker=broker,
    )
    started: list[AsyncCloseable] = [worker]
    try:
        router = await RouterServer.start(
            RouterConfig(plane=PLANE, security=sec("router")), memory_store=store, memory_broker=broker
        )
        started.append(router)
        fields: dict[str, Any] = {"router_mode": "round-robin", "max_inflight": 256, "security": sec("frontend")}
        if via_router:
            fields["router_addresses"] = (router.address,)
        config = FrontendConfig(plane=PLANE, http_port=0, grpc=ServerConfig(port=0), **{**fields, **frontend})
        frontend_server = await Frontend.start(config, memory_store=store, memory_broker=broker)
        started.append(frontend_server)
        assert frontend_server.registry is not None and router.core is not None
        await frontend_server.registry.wait_for(MODEL, timeout_s=30)
        core = router.core
        await core.pool.wait_until(lambda: len(core.pool.all()) == 1)
    except BaseException:
        for s in reversed(started):
            await s.aclose()
        raise
    return MiniMesh(worker, router, frontend_server)

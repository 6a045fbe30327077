"""A frontend in front of router processes (`--router-address a,b`): requests flow through RouterClient, and a
replica that does not answer is skipped before the first chunk."""

from __future__ import annotations

import socket

from frontend_support import PLANE, Mesh, request

from meshllm.config import ServerConfig
from meshllm.frontend.config import FrontendConfig
from meshllm.frontend.main import Frontend
from meshllm.plane.discovery.base import MemoryStore
from meshllm.plane.events.base import MemoryBroker
from meshllm.router import RouterConfig, RouterMode
from meshllm.router.main import RouterServer


def _dead_address() -> str:
    """A loopback port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def test_requests_go_through_router_replicas_and_skip_a_dead_one() -> None:
    store, broker = MemoryStore(), MemoryBroker()
    router = await RouterServer.start(
        RouterConfig(plane=PLANE, mode=RouterMode.ROUND_ROBIN), memory_store=store, memory_broker=broker
    )
    config = FrontendConfig(
        plane=PLANE, http_port=0, grpc=ServerConfig(port=0), router_addresses=(_dead_address(), router.address)
    )
    fe = await Frontend.start(config, memory_store=store, memory_broker=broker)
    mesh = Mesh(store, broker, fe)
    try:
        await mesh.add_worker()
        assert fe.registry is not None
        await fe.registry.wait_for("echo", timeout_s=30)
        for _ in range(3):  # round-robin over replicas: the dead one comes first at least once
            r = await request(
                mesh.url,
                "/v1/chat/completions",
                {"model": "echo", "messages": [{"role": "user", "content": "ECHO:via router"}]},
            )
            assert r.status == 200, r.body
            assert r.json()["choices"][0]["message"]["content"] == "via router"
    finally:
        await mesh.aclose()
        await router.aclose()

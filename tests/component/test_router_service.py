"""The Router gRPC service in-process (RouterServer on port 0) driven by RouterClient.

Locks: Generate/Route/ListWorkers over the wire; errors arrive as the same
meshllm.errors class; a client cancel reaches the worker's engine; static
mode needs no discovery or events and routes approximately; the metrics
endpoint serves the router's registry; shutdown runs in order.
"""

from __future__ import annotations

import asyncio

import pytest
from test_router_support import PLANE, collect, mesh, mocker, request, tokens_of, wait_for

from meshllm import errors
from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.engine.sample import SampleEngine
from meshllm.router.client import RouterClient
from meshllm.router.config import RouterConfig, StaticEndpoint
from meshllm.router.main import RouterServer
from meshllm.testing.servers import free_port
from meshllm.v1 import discovery_pb2


async def test_generate_route_and_list_workers_over_grpc() -> None:
    async with mesh() as m:
        await m.worker(mocker(), instance_id="w1")
        server = await RouterServer.start(RouterConfig(plane=PLANE), memory_store=m.store, memory_broker=m.broker)
        try:
            core = server.core
            assert core is not None
            await core.pool.wait_until(lambda: len(core.pool.all()) == 1)
            client = RouterClient(m.channels, server.address)
            p = list(range(3, 200))
            chunks = await collect(client.generate(request("g1", p, max_tokens=6, model="mocker")))
            assert len(tokens_of(chunks)) == 6 and chunks[-1]["finish_reason"] == "length"
            assert chunks[-1]["usage"]["prompt_tokens"] == len(p)
            await wait_for(lambda: core.index.worker_blocks("w1") >= 12, what="KV events")
            d = await client.route("mocker", p, {"allowed_worker_ids": ["w1"]})
            assert d.worker_id == "w1" and d.candidates[0].overlap_blocks == 12
            assert d.role == discovery_pb2.WORKER_ROLE_AGGREGATED
            listed = await client.list_workers("mocker")
            assert [w.worker_id for w in listed.workers] == ["w1"] and listed.workers[0].indexed_blocks >= 12
            assert (await client.list_workers("other")).workers == []
            with pytest.raises(errors.NotFound):
                await collect(client.generate(request("g2", p, model="nope")))
            with pytest.raises(errors.NotFound):
                await client.route("nope", p)
        finally:
            await server.aclose()
        assert server.shutdown.completed == [
            "unregister", "stop server", "close core", "close channels", "close planes", "stop metrics",
        ]  # fmt: skip


async def test_a_client_cancel_reaches_the_workers_engine() -> None:
    async with mesh() as m:
        w = await m.worker(SampleEngine(token_delay_ms=10))
        server = await RouterServer.start(RouterConfig(plane=PLANE), memory_store=m.store, memory_broker=m.broker)
        try:
            assert server.core is not None
            core = server.core
            await core.pool.wait_until(lambda: len(core.pool.all()) == 1)
            stream = RouterClient(m.channels, server.address).generate(request("c1", [1], max_tokens=10_000, model="sample"))
            await stream.__anext__()
            assert w.servicer is not None and "c1" in w.servicer.inflight
            await stream.aclose()  # type: ignore[attr-defined]
            await wait_for(lambda: w.servicer is not None and not w.servicer.inflight, 5.0, "the worker request to stop")
        finally:
            await server.aclose()


async def test_static_mode_routes_to_given_workers_without_discovery_or_events() -> None:
    async with mesh() as m:
        w1 = await m.worker(mocker(), instance_id="s1")
        w2 = await m.worker(mocker(), instance_id="s2")
        port = free_port()
        cfg = RouterConfig(
            plane=PlaneConfig(discovery=DiscoveryKind.STATIC, events=EventsKind.NONE),
            static_endpoint=StaticEndpoint.parse("meshllm.worker.generate"),
            static_workers=(w1.address, w2.address), model_name="public-name", metrics_port=port,
        )  # fmt: skip
        server = await RouterServer.start(cfg)
        try:
            assert server.core is not None
            core = server.core
            assert core.mode.value == "approximate"  # no events: the router predicts from what it routed
            await core.pool.wait_until(lambda: len(core.pool.all()) == 2)
            client = RouterClient(m.channels, server.address)
            p = list(range(5, 300))
            first = await collect(client.generate(request("s-a", p, max_tokens=3, model="public-name")))
            assert len(tokens_of(first)) == 3
            d = await client.route("public-name", p)
            chosen = d.worker_id
            assert {c.worker_id for c in d.candidates} == {"s1", "s2"}
            assert max(c.overlap_blocks for c in d.candidates) == len(p) // 16
            again = await collect(client.generate(request("s-b", p, max_tokens=3, model="public-name")))
            assert again[-1]["usage"]["cached_tokens"] >= 16 * (len(p) // 16)
            assert chosen in {"s1", "s2"}
            body = await http_get(port, "/metrics")
            assert "meshllm_router_decisions_total" in body and 'policy="approximate"' in body
        finally:
            await server.aclose()


async def http_get(port: int, path: str) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return data.decode(errors="replace")

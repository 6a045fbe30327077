"""Every HTTP route and gRPC method that answers without credentials is in docs/security.md's table (issue 36).

A worker, a router server and a frontend (HTTP + Inference gRPC) with a mesh
token and API keys, on real loopback servers. The HTTP routes are the app's
own route table (a route with an id in its path is called with one); the gRPC
methods are whatever each server lists through its own reflection, resolved
in the descriptor pool. Each is called with no credential and an empty
request; anything but 401 / UNAUTHENTICATED (or UNIMPLEMENTED: a method the
proto declares and the server has no handler for, such as
`grpc.health.v1.Health/List`) counts as open, and the open set
must equal the table's rows for that configuration, both without and with
`--open-metrics`.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx2
import pytest
import pytest_asyncio
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from meshllm.frontend.http.app import OpenAIApp
from meshllm.frontend.http.auth import ApiKeys
from meshllm.frontend.http.server import HttpServer
from meshllm.plane.auth import MeshSecurity
from meshllm.testing.minimesh import MiniMesh, start_mini_mesh

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
KEYS = ApiKeys.parse(["ops:sk-ops-0123456789abcdef0"], source="test")
TOKEN = MeshSecurity(token="mesh-secret-0123456789abcdef")


def table() -> dict[str, str]:
    """`API route` → `when`, from the rows of the section "What answers without credentials"."""
    text = DOC.read_text()
    section = text.split("## What answers without credentials", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (HTTP|gRPC) \| `([^`]+)` \| ([^|]+?) \|", section, flags=re.M)
    assert rows, "docs/security.md has no open-paths table"
    return {f"{api} {route}": when.strip("` ") for api, route, when in rows}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh() -> AsyncIterator[MiniMesh]:
    m = await start_mini_mesh(security=lambda role: TOKEN, via_router=True, api_keys=KEYS)
    yield m
    for s in (m.frontend, m.router, m.worker):
        await s.aclose()


async def open_http_routes(app: OpenAIApp) -> set[str]:
    routes = [(m, p) for m, p in app._routes] + [(m, prefix + "some-id") for m, prefix in app._prefix_routes]
    opened = set()
    async with await HttpServer.start(app, "127.0.0.1", 0) as server, httpx2.AsyncClient(base_url=server.url) as c:
        for method, path in routes:
            kw = {"json": {}} if method == "POST" else {}
            status = (await c.request(method, path, **kw)).status_code
            if status != 401:
                shown = next((prefix + "{id}" for m, prefix in app._prefix_routes if path == prefix + "some-id"), path)
                opened.add(f"HTTP {method} {shown}")
    return opened


async def open_grpc_methods(address: str) -> set[str]:
    pool = descriptor_pool.Default()
    opened = set()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        calls = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        services = [s.name async for reply in calls for s in reply.list_services_response.service]
        assert "grpc.health.v1.Health" in services, services
        for name in services:
            for method in pool.FindServiceByName(name).methods:
                path = f"/{name}/{method.name}"
                code = await call_empty(channel, path, method.client_streaming, method.server_streaming)
                if code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED):  # no handler: not open
                    opened.add(f"gRPC {name}/{method.name}")
    return opened


async def call_empty(channel: grpc.aio.Channel, path: str, client_stream: bool, server_stream: bool) -> grpc.StatusCode:
    """The status of one call with an empty request (OK once a first reply arrives: the handler ran)."""
    ident = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        if client_stream:
            call = channel.stream_stream(path, **ident)(iter([b""]), timeout=5)
            async for _ in call:
                break
        elif server_stream:
            async for _ in channel.unary_stream(path, **ident)(b"", timeout=5):
                break
        else:
            await channel.unary_unary(path, **ident)(b"", timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_the_open_paths_are_exactly_the_documented_ones(mesh: MiniMesh) -> None:
    documented = table()
    grpc_open: set[str] = set()
    for address in (mesh.worker.address, mesh.router.address, mesh.frontend.grpc_address):
        assert address
        grpc_open |= await open_grpc_methods(address)
    http_open = await open_http_routes(mesh.frontend.app)
    always = {k for k, when in documented.items() if when == "always"}
    assert http_open | grpc_open == always, "open but not documented: " + ", ".join(sorted((http_open | grpc_open) - always))


async def test_open_metrics_opens_exactly_its_documented_rows(mesh: MiniMesh) -> None:
    documented = table()
    app = OpenAIApp(mesh.frontend.core, api_keys=KEYS, open_metrics=True, dashboard=mesh.frontend.dashboard)
    expected = {k for k, when in documented.items() if k.startswith("HTTP") and when in ("always", "--open-metrics")}
    assert await open_http_routes(app) == expected

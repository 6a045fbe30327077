"""The live mesh page's endpoints (frontend/http/dashboard.py) over an in-process mesh.

Locks: the page, script and style are served from the package and name no
other host; /dashboard/state shows every worker with its health and load,
the routing decisions with each candidate's cost terms (one chosen, the one
the request went to), a chart point with the request rate and latency
percentiles, and workers joining and leaving as events; behind a remote
router, the router's ListWorkers view and a note; access follows
/metrics (open, or the API key under --metrics-auth) while the page itself
stays open. The browser side is tests/integration/test_dashboard_browser.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from frontend_support import PLANE, Mesh, request, start_mesh

from meshllm.config import ServerConfig
from meshllm.frontend.config import FrontendConfig
from meshllm.frontend.http.app import OpenAIApp
from meshllm.frontend.http.auth import ApiKeys
from meshllm.frontend.http.dashboard import ASSETS, Dashboard, read_counts
from meshllm.frontend.http.server import HttpServer
from meshllm.frontend.main import Frontend
from meshllm.plane.discovery.base import MemoryStore
from meshllm.plane.events.base import MemoryBroker
from meshllm.router import RouterConfig, RouterMode
from meshllm.router.main import RouterServer
from meshllm.testing.servers import free_port
from meshllm.testing.waiting import wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "ECHO:hello dashboard"}], "max_tokens": 8}
KEY = "sk-dashboard-0123456789abcdef"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    m = await start_mesh(workers=2)
    yield m
    await m.aclose()


def dashboard(mesh: Mesh) -> Dashboard:
    assert mesh.frontend.dashboard is not None
    return mesh.frontend.dashboard


async def test_the_page_and_its_files_come_from_the_package(mesh: Mesh) -> None:
    types = {"/dashboard": "text/html", "/dashboard/app.js": "text/javascript", "/dashboard/style.css": "text/css"}
    assert set(types) == set(ASSETS)
    for path, content_type in types.items():
        reply = await request(mesh.url, path, b"", method="GET")
        assert reply.status == 200, (path, reply.body[:200])
        assert reply.headers["content-type"].startswith(content_type)
        assert b"://" not in reply.body.replace(b"http://www.w3.org/2000/svg", b""), path  # no CDN, no other host
    page = (await request(mesh.url, "/dashboard/", b"", method="GET")).body
    assert b'src="/dashboard/app.js"' in page and b'href="/dashboard/style.css"' in page


async def test_state_shows_workers_decisions_and_rates_after_requests(mesh: Mesh) -> None:
    for _ in range(3):
        assert (await request(mesh.url, "/v1/chat/completions", CHAT)).status == 200
    await dashboard(mesh).sample()
    state = (await request(mesh.url, "/dashboard/state", b"", method="GET")).json()

    ids = sorted(w.id for w in mesh.workers)
    assert sorted(w["id"] for w in state["workers"]) == ids
    for w in state["workers"]:
        assert (w["model"], w["role"], w["health"]) == ("echo", "agg", "healthy")
        assert {"kv_usage", "running", "waiting", "in_flight", "queued_prefill_tokens", "indexed_blocks"} <= set(w)
    assert state["router"]["kind"] == "embedded" and state["frontend"]["models"] == ["echo"]

    decisions = state["decisions"]
    assert len(decisions) >= 3
    for d in decisions[:3]:
        assert d["model"] == "echo" and d["leg"] == "agg" and d["policy"] == "round-robin"
        assert sorted(c["worker_id"] for c in d["candidates"]) == ids
        chosen = [c for c in d["candidates"] if c["chosen"]]
        assert [c["worker_id"] for c in chosen] == [d["worker_id"]]
        assert {"overlap_blocks", "prefill_tokens", "decode_blocks", "pressure", "evicted_hot_blocks", "cost"} <= set(chosen[0])
    assert len({d["worker_id"] for d in decisions[:2]}) == 2  # round robin: both workers were chosen

    last = state["series"][-1]
    assert last["rps"] > 0 and last["failed_ps"] == 0 and last["tokens_ps"] > 0
    assert last["ttft_p50"] is not None and 0 < last["ttft_p50"] <= last["ttft_p99"] <= last["e2e_p99"]
    joined = {e["worker_id"] for e in state["events"] if e["kind"] == "worker-joined"}
    assert joined == set(ids)


async def test_a_failed_request_counts_as_failed_and_the_page_is_not_a_request(mesh: Mesh) -> None:
    def counts() -> tuple[float, float]:
        c = read_counts(mesh.frontend.metrics.registry.collect(), 0.0)
        return c.requests, c.failed

    before = counts()
    for _ in range(3):
        await request(mesh.url, "/dashboard/state", b"", method="GET")
    assert (await request(mesh.url, "/v1/chat/completions", {**CHAT, "model": "nope"})).status == 404
    after = counts()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
    await dashboard(mesh).sample()
    assert dashboard(mesh).state()["series"][-1]["failed_ps"] > 0


async def test_a_worker_that_leaves_is_gone_from_the_state_and_an_event(mesh: Mesh) -> None:
    extra = await mesh.add_worker()
    router = mesh.frontend.router
    assert router is not None
    await router.pool.wait_until(lambda: router.pool.get(extra.id) is not None)
    await dashboard(mesh).sample()
    assert extra.id in {w["id"] for w in dashboard(mesh).state()["workers"]}

    mesh.workers.remove(extra)
    await extra.aclose()
    await router.pool.wait_until(lambda: router.pool.get(extra.id) is None)
    await dashboard(mesh).sample()
    state = (await request(mesh.url, "/dashboard/state", b"", method="GET")).json()
    assert extra.id not in {w["id"] for w in state["workers"]}
    left = [e for e in state["events"] if e["kind"] == "worker-left"]
    assert left and left[0]["worker_id"] == extra.id and extra.id in left[0]["text"]


@pytest.mark.parametrize("open_metrics", [False, True])
async def test_the_page_and_its_state_are_governed_like_metrics(mesh: Mesh, open_metrics: bool) -> None:
    assert mesh.frontend.core is not None
    keys = ApiKeys.parse([KEY], source="test")
    app = OpenAIApp(mesh.frontend.core, api_keys=keys, open_metrics=open_metrics, dashboard=dashboard(mesh))
    server = await HttpServer.start(app, "127.0.0.1", 0)
    try:
        for path in (*ASSETS, "/dashboard/state", "/metrics"):
            assert (await request(server.url, path, b"", method="GET")).status == (200 if open_metrics else 401), path
        if not open_metrics:
            authorised = await _get_with_key(server.url, "/dashboard/state")
            assert authorised.startswith(b"HTTP/1.1 200")
    finally:
        await server.aclose()


async def test_without_a_dashboard_the_routes_are_not_there(mesh: Mesh) -> None:
    assert mesh.frontend.core is not None
    server = await HttpServer.start(OpenAIApp(mesh.frontend.core), "127.0.0.1", 0)
    try:
        assert (await request(server.url, "/dashboard/state", b"", method="GET")).status == 404
    finally:
        await server.aclose()


async def test_sampling_goes_on_by_itself(mesh: Mesh) -> None:
    d = dashboard(mesh)
    before = len(d.state()["series"])
    await wait_until(lambda: len(d.state()["series"]) > before, timeout_s=10, what="a new chart point")


async def _get_with_key(url: str, path: str) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n\r\n".encode())
    async with asyncio.timeout(10):
        raw = await reader.read()
    writer.close()
    return raw


async def test_behind_a_remote_router_the_workers_are_the_routers_view() -> None:
    store, broker = MemoryStore(), MemoryBroker()
    router = await RouterServer.start(
        RouterConfig(plane=PLANE, mode=RouterMode.ROUND_ROBIN), memory_store=store, memory_broker=broker
    )
    dead = f"127.0.0.1:{free_port()}"
    config = FrontendConfig(plane=PLANE, http_port=0, grpc=ServerConfig(port=0), router_addresses=(dead, router.address))
    fe = await Frontend.start(config, memory_store=store, memory_broker=broker)
    mesh = Mesh(store, broker, fe)
    try:
        worker = await mesh.add_worker()
        assert fe.dashboard is not None
        await wait_until(lambda: router.core.pool.get(worker.id) is not None, timeout_s=10, what="the router sees the worker")
        await fe.dashboard.sample()
        state = (await request(mesh.url, "/dashboard/state", b"", method="GET")).json()
        assert state["router"]["kind"] == "remote" and state["router"]["addresses"] == [dead, router.address]
        assert [(w["id"], w["health"], w["role"]) for w in state["workers"]] == [(worker.id, "unknown", "agg")]
        assert state["decisions"] == [] and "router process" in state["router"]["note"]
    finally:
        await mesh.aclose()
        await router.aclose()

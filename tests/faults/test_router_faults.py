"""Fault: `meshllm router` processes killed under a frontend (`--router-address`), seen through HTTP.

Real etcd, nats-server, mocker `meshllm worker` processes, `meshllm router`
processes and a `meshllm frontend` process in front of them. Locks:

- kill -9 of one of two router replicas while 16 streamed completions run:
  all 16 complete (200, "length", every token, `[DONE]`); the frontend
  resumed exactly the streams that replica carried on the other one, and
  each stream's text and token counts equal an undisturbed run of the same
  request (the mocker's output depends only on the prompt, so a resumed
  stream that duplicated or skipped a token would differ).
- kill -9 of the only router while 8 streams run, 8 more requests arriving
  while it is down, then a new router on the same port: no request fails —
  all 16 wait in the frontend (`--router-wait-s`) and complete, the 8 cut
  streams token-exactly.

The longest wait any stream saw for its next event is reported (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from meshllm.plane.request.channels import ChannelCache
from meshllm.router.client import RouterClient
from meshllm.testing.mesh import Completion, ProcessMesh, StreamSet, metric, report, scrape, stream_completion
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.servers import EtcdServer, NatsServer, free_port
from meshllm.testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MAX_TOKENS = 150
RESUMED = "; re-sending (attempt"  # the frontend's warning for each resumed stream (it has no embedded core here)


def body(i: int) -> dict[str, Any]:
    prompt = [(i * 7919 + k * 104729) % 30000 + 3 for k in range(64 + i)]
    return {"model": "mocker", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}


class Mesh:
    """Workers, routers and a frontend as processes; `router()` waits until the router sees the workers."""

    def __init__(self, procs: ProcessMesh, channels: ChannelCache) -> None:
        self.procs, self.channels = procs, channels
        self.workers = 0

    async def start_workers(self, n: int) -> None:
        await asyncio.gather(*(self.procs.worker(f"w{i}") for i in range(n)))
        self.workers = n

    async def router(self, port: int = 0) -> tuple[MeshllmProcess, str]:
        proc, address = await self.procs.router("--port", str(port), "--router-mode", "round-robin")
        address = address.replace("0.0.0.0", "127.0.0.1")
        client = RouterClient(self.channels, address)

        async def sees_workers() -> bool:
            return len((await client.list_workers("mocker")).workers) == self.workers

        await wait_until(sees_workers, timeout_s=30, what=f"router {address} to see the workers")
        return proc, address

    async def frontend(self, routers: list[str], wait_s: float) -> tuple[MeshllmProcess, str]:
        proc, url = await self.procs.frontend("--router-address", ",".join(routers), "--router-wait-s", f"{wait_s:g}")

        async def serves_mocker() -> bool:
            return '"mocker"' in await scrape(*host_port(url), "/v1/models")

        await wait_until(serves_mocker, timeout_s=30, what="the frontend to serve the mocker model")
        return proc, url


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    async with (
        EtcdServer() as etcd,
        NatsServer() as nats,
        ProcessMesh(etcd.endpoint, nats.url) as procs,
        ChannelCache() as channels,
    ):
        yield Mesh(procs, channels)


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def undisturbed(url: str, n: int) -> list[Completion]:
    return list(await asyncio.wait_for(asyncio.gather(*(stream_completion(url, body(i)) for i in range(n))), 60))


def assert_complete_and_exact(results: list[Completion], baseline: list[Completion]) -> None:
    for i, (got, want) in enumerate(zip(results, baseline, strict=True)):
        assert got.ok and want.ok, (i, got.status, got.error, want.error)
        assert got.finish_reason == "length" and got.usage and got.usage["completion_tokens"] == MAX_TOKENS, (i, got.usage)
        assert got.text == want.text, f"stream {i} differs from the undisturbed run"
        assert got.usage["prompt_tokens"] == want.usage["prompt_tokens"], i  # type: ignore[index]


def resumed(frontend: MeshllmProcess) -> int:
    return frontend.stderr_tail(10_000_000).count(RESUMED)


async def test_kill_9_of_one_of_two_router_replicas_resumes_its_16_streams_token_exactly(mesh: Mesh) -> None:
    await mesh.start_workers(2)
    (r1, a1), (_, a2) = await asyncio.gather(mesh.router(), mesh.router())
    fe, url = await mesh.frontend([a1, a2], wait_s=10)
    n = 16
    streams = StreamSet.completions(url, [body(i) for i in range(n)])
    await wait_until(lambda: streams.under_way(3), timeout_s=30, what="every stream to be under way")
    assert max(len(a) for a in streams.arrivals) < MAX_TOKENS // 2  # the kill comes mid-stream
    fault_at = time.monotonic()
    r1.kill9()
    results = await streams.results(60)
    assert await r1.wait(5) == -signal.SIGKILL
    assert [(i, r.error) for i, r in enumerate(results) if not r.ok] == []
    assert resumed(fe) == n // 2, fe.stderr_tail()  # the frontend round-robins: r1 carried half of the streams
    assert_complete_and_exact(results, await undisturbed(url, n))
    report("router replica kill -9 (one of two)", streams=n, lost=0, resumed=n // 2,
           recovery_s=round(streams.recovery_s(fault_at), 3))  # fmt: skip


async def test_requests_wait_while_the_only_router_restarts_and_all_complete(mesh: Mesh) -> None:
    await mesh.start_workers(1)
    port = free_port()
    old, address = await mesh.router(port)
    fe, url = await mesh.frontend([address], wait_s=30)
    host, http_port = host_port(url)
    cut = StreamSet.completions(url, [body(i) for i in range(8)])
    await wait_until(lambda: cut.under_way(3), timeout_s=30, what="every stream to be under way")
    assert max(len(a) for a in cut.arrivals) < MAX_TOKENS // 2  # the kill comes mid-stream
    fault_at = time.monotonic()
    old.kill9()
    await old.wait(10)
    late = StreamSet.completions(url, [body(i) for i in range(8, 16)])  # arrive while no router is up

    async def all_waiting() -> bool:
        return metric(await scrape(host, http_port), "meshllm_frontend_inflight_requests") == 16

    await wait_until(all_waiting, timeout_s=15, what="all 16 requests to wait in the frontend")
    assert not any(t.done() for t in (*cut.tasks, *late.tasks))
    await mesh.router(port)  # the restart, on the same address
    back_at = time.monotonic()
    results = await cut.results(60) + await late.results(60)
    assert [(i, r.error) for i, r in enumerate(results) if not r.ok] == []
    assert resumed(fe) == 8
    assert_complete_and_exact(results, await undisturbed(url, 16))
    report("single router restart (kill -9, new process on the same port)", streams=16, lost=0, resumed=8,
           router_down_s=round(back_at - fault_at, 3), recovery_s=round(cut.recovery_s(fault_at), 3))  # fmt: skip

"""Fault: etcd or nats-server down for a few seconds while requests flow through a `meshllm router` process.

Real etcd, nats-server, two mocker workers and a KV-mode router, all separate
processes. Four client loops send requests back to back; the server is
killed (SIGKILL), stays down OUTAGE_S seconds, and is restarted on the same
port (etcd with its data). Locks: no request fails before, during or after;
for etcd, the workers are still registered afterwards and a worker started
after the outage is seen by the router (its discovery watch recovered); for
NATS, the KV events of a prompt sent after the restart reach the router's
index (events resumed). The recovery times are reported (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

import meshllm.plane.backends  # noqa: F401  (registers the etcd and NATS openers)
from meshllm.config import DiscoveryKind, PlaneConfig
from meshllm.plane.discovery.base import open_discovery
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.types import TokenRequest
from meshllm.router.client import RouterClient
from meshllm.testing.mesh import ProcessMesh, report
from meshllm.testing.servers import EtcdServer, NatsServer
from meshllm.testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

OUTAGE_S = 3.0
BLOCK = 16
_ids = itertools.count()


def request(max_tokens: int = 16) -> TokenRequest:
    i = next(_ids)
    prompt = [(i * 7919 + k * 104729) % 30000 + 3 for k in range(4 * BLOCK)]
    return {"request_id": f"r{i}", "model": "mocker", "token_ids": prompt, "stop": {"max_tokens": max_tokens, "ignore_eos": True}}


@dataclass
class Traffic:
    """Client loops sending requests back to back until stopped; counts what completed and what failed."""

    client: RouterClient
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    running: bool = True

    async def loop(self) -> None:
        while self.running:
            req = request()
            try:
                tokens = [t async for c in self.client.generate(req) for t in c.get("token_ids", ())]
            except Exception as exc:  # every failure is the finding
                self.failures.append(f"{type(exc).__name__}: {exc}")
                continue
            if len(tokens) == 16:
                self.ok += 1
            else:
                self.failures.append(f"{req['request_id']}: {len(tokens)} tokens")


@dataclass
class Mesh:
    etcd: EtcdServer
    nats: NatsServer
    procs: ProcessMesh
    client: RouterClient


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    async with EtcdServer() as etcd, NatsServer() as nats, ProcessMesh(etcd.endpoint, nats.url) as procs, ChannelCache() as ch:
        await asyncio.gather(procs.worker("w1"), procs.worker("w2"))
        _, address = await procs.router("--router-mode", "kv")
        client = RouterClient(ch, address)
        await wait_until(lambda: workers_seen(client, 2), timeout_s=30, what="the router to see both workers")
        yield Mesh(etcd, nats, procs, client)


async def workers_seen(client: RouterClient, n: int) -> bool:
    return len((await client.list_workers("mocker")).workers) == n


async def under_traffic(mesh: Mesh, server: EtcdServer | NatsServer) -> tuple[Traffic, float, float]:
    """4 client loops running while `server` is killed, kept down OUTAGE_S, restarted: (traffic, seconds down, back at)."""
    traffic = Traffic(mesh.client)
    loops = [asyncio.create_task(traffic.loop()) for _ in range(4)]
    try:
        await wait_until(lambda: traffic.ok >= 8, timeout_s=20, what="traffic to flow")
        await server.kill()
        down_at, ok_before = time.monotonic(), traffic.ok
        await wait_until(lambda: traffic.ok > ok_before, timeout_s=20, what="requests to complete during the outage")
        await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))  # the outage's length, not a wait
        await server.start()
        up_at, ok_after = time.monotonic(), traffic.ok
        await wait_until(lambda: traffic.ok >= ok_after + 8, timeout_s=20, what="traffic after the outage")
    finally:
        traffic.running = False
        await asyncio.wait_for(asyncio.gather(*loops), 30)
    return traffic, up_at - down_at, up_at


async def test_etcd_outage_fails_no_request_and_discovery_recovers(mesh: Mesh) -> None:
    traffic, down_s, _ = await under_traffic(mesh, mesh.etcd)
    assert not traffic.failures, traffic.failures[:5]
    await mesh.procs.worker("w3")  # registers after the outage: the router's watch must have recovered to see it
    seen_s = await wait_until(lambda: workers_seen(mesh.client, 3), timeout_s=30, what="the router to see w3")
    async with await open_discovery(
        PlaneConfig(discovery=DiscoveryKind.ETCD, etcd_endpoints=(mesh.etcd.endpoint,), lease_ttl_s=3)
    ) as disc:
        ids = {i.id for i in (await disc.list_instances("worker")).values()}
    assert ids == {"w1", "w2", "w3"}, ids
    report("etcd outage", outage_s=round(down_s, 2), requests_ok=traffic.ok,
           requests_failed=len(traffic.failures), new_worker_seen_s=round(seen_s, 2))  # fmt: skip


async def test_nats_outage_fails_no_request_and_kv_events_resume(mesh: Mesh) -> None:
    traffic, down_s, back_at = await under_traffic(mesh, mesh.nats)
    assert not traffic.failures, traffic.failures[:5]

    async def fresh_prompt_indexed() -> bool:
        """A prompt sent now reaches the router's KV index within 2 s: events flow worker → NATS → router again."""
        req = request(max_tokens=1)
        [c async for c in mesh.client.generate(req)]

        async def indexed() -> bool:
            decision = await mesh.client.route("mocker", req["token_ids"])
            return any(c.overlap_blocks == len(req["token_ids"]) // BLOCK for c in decision.candidates)

        try:
            await wait_until(indexed, timeout_s=2, what="the prompt's blocks in the index")
        except AssertionError:
            return False  # sent while the publisher was still reconnecting: try a new prompt
        return True

    await wait_until(fresh_prompt_indexed, timeout_s=30, what="KV events to reach the router again")
    assert await workers_seen(mesh.client, 2)
    report("NATS outage", outage_s=round(down_s, 2), requests_ok=traffic.ok, requests_failed=len(traffic.failures),
           kv_events_resumed_s=round(time.monotonic() - back_at, 2))  # fmt: skip

"""Network faults: a partition between two hosts; latency, loss, resets and a blackhole on the frontend → worker path.

Partition: a second "host" is a network namespace joined to the root
namespace by a veth pair (`meshllm.testing.netns`). Worker w2 runs inside it;
etcd, nats-server, worker w1 and a KV-mode `meshllm router` run in the root
namespace. With 16 streams of 300 tokens under way on both workers, both
ends of the link go down and stay down until the router has dropped w2 (its
etcd lease expired) and at least PARTITION_S, then come back. Locks: every stream completes with
exactly the tokens of an undisturbed run (migrated, or resumed when the link
returned), and w2 re-registers and is back in the router's pool.

Through proxies: both workers are reached through `TcpProxy`s (each worker
advertises its proxies' host) from a `meshllm frontend`, their streams on
their TCP session ports or, in the grpc variants, on GenerateSession calls. Latency and loss:
20-30 ms per chunk each way, 5% of chunks 200 ms late, and midway every
connection to one worker is reset. Blackhole: one worker's proxy forwards
nothing and closes nothing until the streams are done, then heals. Locks:
16 streamed HTTP completions all complete, text-identical to an undisturbed
run, and the blackholed worker serves again after the heal.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.types import TokenRequest
from meshllm.router.client import RouterClient
from meshllm.testing.mesh import Completion, ProcessMesh, StreamSet, metric, report, scrape, stream_completion
from meshllm.testing.netns import NetnsHost, netns_unavailable
from meshllm.testing.servers import EtcdServer, NatsServer, free_port
from meshllm.testing.tcpproxy import TcpProxy
from meshllm.testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

N = 16
PARTITION_S = 4.0  # at least; longer if the router takes longer to drop the worker


class SharedEtcd(EtcdServer):
    """etcd that also listens on `also_host` (the root end of the veth pair), for the namespace's processes."""

    def __init__(self, also_host: str) -> None:
        super().__init__()
        self.also_host = also_host

    def _argv(self) -> list[str]:
        argv = super()._argv()
        i = argv.index("--listen-client-urls") + 1
        argv[i] += f",http://{self.also_host}:{self.port}"
        return argv


def request(i: int, max_tokens: int, tag: str = "") -> TokenRequest:
    prompt = [(i * 7919 + k * 104729) % 30000 + 3 for k in range(64 + i)]
    return {"request_id": f"{tag}{i}", "model": "mocker", "token_ids": prompt,
            "stop": {"max_tokens": max_tokens, "ignore_eos": True}}  # fmt: skip


async def tokens(client: RouterClient, req: TokenRequest, tick: Callable[[], None] | None = None) -> list[int]:
    out: list[int] = []
    async for chunk in client.generate(req):
        out += chunk.get("token_ids", ())
        if tick is not None:
            tick()
    return out


@pytest.fixture
async def host() -> AsyncIterator[NetnsHost]:
    reason = await asyncio.to_thread(netns_unavailable)
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    async with NetnsHost() as h:
        yield h


async def test_a_partitioned_worker_loses_no_stream_and_rejoins_the_mesh(host: NetnsHost) -> None:
    max_tokens = 300
    async with (
        SharedEtcd(host.gateway_ip) as etcd,
        NatsServer() as nats,
        TcpProxy("127.0.0.1", nats.port, listen_host=host.gateway_ip) as nats_gateway,  # NATS for the namespace
        ProcessMesh(etcd.endpoint, nats.url) as procs,
        ChannelCache() as channels,
    ):
        await asyncio.gather(
            procs.worker("w1"),
            procs.worker("w2", "--host", host.ip, prefix=host.exec_prefix,
                         etcd_endpoint=f"{host.gateway_ip}:{etcd.port}", nats_url=f"nats://{nats_gateway.address}"),
        )  # fmt: skip
        metrics_port = free_port()
        _, address = await procs.router("--router-mode", "kv", "--metrics-port", str(metrics_port))
        client = RouterClient(channels, address)

        async def both() -> bool:
            return {w.worker_id for w in (await client.list_workers("mocker")).workers} == {"w1", "w2"}

        async def w2_dropped() -> bool:
            return "w2" not in {w.worker_id for w in (await client.list_workers("mocker")).workers}

        await wait_until(both, timeout_s=30, what="the router to see both workers")
        baseline = await asyncio.gather(*(tokens(client, request(i, max_tokens, "u")) for i in range(N)))

        streams = StreamSet([lambda tick, i=i: tokens(client, request(i, max_tokens), tick) for i in range(N)])
        rejoin: asyncio.Task[float] | None = None
        try:
            await wait_until(lambda: streams.under_way(3), timeout_s=30, what="every stream to be under way")
            load = {w.worker_id: w.in_flight for w in (await client.list_workers()).workers}
            assert load.get("w1", 0) > 0 and load.get("w2", 0) > 0, load
            cut_at = time.monotonic()
            await host.partition()
            dropped_s = await wait_until(w2_dropped, timeout_s=30, what="the router to drop w2")
            await asyncio.sleep(max(0.0, PARTITION_S - (time.monotonic() - cut_at)))  # the partition's length, not a wait
            await host.heal()
            healed_at = time.monotonic()
            rejoin = asyncio.create_task(wait_until(both, timeout_s=30, what="w2 back in the pool"))
            results = await streams.results(60)
            rejoined_s = await rejoin
        finally:
            await host.heal()
            await streams.aclose()
            if rejoin is not None:
                rejoin.cancel()
        for i, got in enumerate(results):
            assert len(got) == max_tokens and got == baseline[i], f"stream {i} differs from the undisturbed run"
        after = await asyncio.gather(*(tokens(client, request(i, 8, "a")) for i in range(8)))
        assert all(len(t) == 8 for t in after)
        migrations = metric(await scrape("127.0.0.1", metrics_port), "meshllm_router_migrations_total")
        report("partition (netns, link down)", streams=N, lost=0, partition_s=round(healed_at - cut_at, 2),
               dropped_from_pool_s=round(dropped_s, 2), recovery_s=round(streams.recovery_s(cut_at), 2),
               migrations=migrations, rejoined_after_heal_s=round(rejoined_s, 2))  # fmt: skip


@contextlib.asynccontextmanager
async def proxied_mesh(carrier: str) -> AsyncIterator[tuple[str, list[TcpProxy]]]:
    """Two workers reached through TcpProxys, and a frontend: (its URL, the proxies its Generate streams go through).

    Each worker listens on 127.0.0.1:P (gRPC) and 127.0.0.1:Q (its TCP session port) and advertises 127.0.0.2,
    where a proxy listens on each port. Its streams take the session port (`carrier` "tcp", the default) or, with
    `--session-port -1`, a GenerateSession call on the gRPC port ("grpc"); the faults go on that path's proxies.
    """
    async with EtcdServer() as etcd, NatsServer() as nats, ProcessMesh(etcd.endpoint, nats.url) as procs:
        ports = [(free_port(), free_port()) for _ in range(2)]
        proxies = [
            TcpProxy("127.0.0.1", port, listen_host="127.0.0.2", listen_port=port, seed=port)
            for pair in ports for port in pair
        ]  # fmt: skip
        try:
            for proxy in proxies:
                await proxy.start()
            await asyncio.gather(*(
                procs.worker(f"w{i}", "--host", "127.0.0.1", "--port", str(p), "--advertise-host", "127.0.0.2",
                             "--session-port", str(q) if carrier == "tcp" else "-1")
                for i, (p, q) in enumerate(ports)
            ))  # fmt: skip
            _, url = await procs.frontend(workers=2)
            streams_through = proxies[1::2] if carrier == "tcp" else proxies[0::2]
            yield url, streams_through
        finally:
            for proxy in proxies:
                await proxy.aclose()


def completion(i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": "mocker", "prompt": f"partition {i} " * (8 + i), "max_tokens": max_tokens, "ignore_eos": True}


async def undisturbed(url: str, proxies: list[TcpProxy], max_tokens: int) -> list[Completion]:
    baseline = await asyncio.gather(*(stream_completion(url, completion(i, max_tokens)) for i in range(N)))
    assert all(r.ok for r in baseline), [r.error for r in baseline if not r.ok]
    assert all(p.stats.bytes_down > 0 for p in proxies)  # both workers serve, through their proxies
    return list(baseline)


def assert_exact(results: list[Completion], baseline: list[Completion], max_tokens: int) -> None:
    for i, (got, want) in enumerate(zip(results, baseline, strict=True)):
        assert got.ok and got.usage and got.usage["completion_tokens"] == max_tokens, (i, got.error, got.usage)
        assert got.text == want.text, f"stream {i} differs from the undisturbed run"


@pytest.mark.parametrize("carrier", ["tcp", "grpc"])
async def test_latency_loss_and_resets_between_frontend_and_workers_lose_no_stream(carrier: str) -> None:
    max_tokens = 100
    async with proxied_mesh(carrier) as (url, proxies):
        baseline = await undisturbed(url, proxies, max_tokens)
        for proxy in proxies:
            proxy.latency_s, proxy.jitter_s, proxy.loss, proxy.rto_s = 0.02, 0.01, 0.05, 0.2
        streams = StreamSet.completions(url, [completion(i, max_tokens) for i in range(N)])
        try:
            await wait_until(lambda: streams.under_way(3), timeout_s=30, what="every stream to be under way")
            cut_at = time.monotonic()
            assert await proxies[0].cut() > 0
            results = await streams.results(60)
        finally:
            await streams.aclose()
        assert_exact(results, baseline, max_tokens)
        report(f"latency 20-30 ms + 5% loss (200 ms) + connection reset, sessions on {carrier}", streams=N, lost=0,
               recovery_s=round(streams.recovery_s(cut_at), 3),
               delayed_chunks=sum(p.stats.delayed_chunks for p in proxies))  # fmt: skip


@pytest.mark.parametrize("carrier", ["tcp", "grpc"])
async def test_a_blackholed_worker_connection_loses_no_stream_and_the_worker_serves_again(carrier: str) -> None:
    """Packets to a worker vanish but nothing is closed (the proxy still ACKs): only liveness checks can tell."""
    max_tokens = 300
    async with proxied_mesh(carrier) as (url, proxies):
        baseline = await undisturbed(url, proxies, max_tokens)
        sent = [p.stats.bytes_down for p in proxies]
        streams = StreamSet.completions(url, [completion(i, max_tokens) for i in range(N)])
        try:
            await wait_until(lambda: streams.under_way(3), timeout_s=30, what="every stream to be under way")
            assert all(p.stats.bytes_down > n for p, n in zip(proxies, sent, strict=True))  # both workers stream
            assert not any(task.done() for task in streams.tasks)
            cut_at = time.monotonic()
            proxies[0].blackhole()
            results = await streams.results(60)
        finally:
            proxies[0].heal()  # resets the connections that lost bytes
            await streams.aclose()
        healed_at = time.monotonic()
        assert_exact(results, baseline, max_tokens)
        assert proxies[0].stats.bytes_dropped > 0
        before = proxies[0].stats.bytes_down

        probes = itertools.count(100)

        async def w0_serves_again() -> bool:
            # Fresh prompts each round: the kv router sends a prompt it saw back to the worker that cached it, so
            # repeating the first round's prompts (served by w1 while w0 was still busy) would never reach w0.
            done = await asyncio.gather(*(stream_completion(url, completion(next(probes), 4)) for _ in range(4)))
            assert all(r.ok for r in done), [r.error for r in done if not r.ok]
            return proxies[0].stats.bytes_down > before

        back_s = await wait_until(w0_serves_again, timeout_s=30, what="the frontend to use w0 again")
        report(f"blackholed worker connection (TcpProxy), sessions on {carrier}", streams=N, lost=0,
               recovery_s=round(streams.recovery_s(cut_at), 2), blackhole_s=round(healed_at - cut_at, 2),
               serving_again_after_heal_s=round(back_s, 2))  # fmt: skip

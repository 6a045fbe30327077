"""`meshllm router` with mocker worker processes over real etcd and nats-server.

Locks: `kill -9` of one of two workers while 16 streams run — every stream
completes through the router with the right token count and exactly the
tokens of an undisturbed run (migration); the router process finds workers
through etcd, indexes their KV events from NATS (ListWorkers shows indexed
blocks), and shuts down in order on SIGTERM; bad static flags get one line
and exit status 2.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from net_support import holds_connection

from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.router.client import RouterClient
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.servers import EtcdServer, NatsServer, free_port
from meshllm.testing.waiting import wait_until
from meshllm.worker.client import WorkerClient

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MOCKER = ["--block-size", "16", "--num-gpu-blocks", "4096", "--speedup-ratio", "1"]


def plane_flags(etcd: EtcdServer, nats: NatsServer) -> list[str]:
    return ["--discovery", "etcd", "--etcd-endpoints", etcd.endpoint, "--nats-url", nats.url, "--lease-ttl", "3"]


async def start_worker(etcd: EtcdServer, nats: NatsServer, instance_id: str, *extra: str) -> tuple[MeshllmProcess, str]:
    p = MeshllmProcess("worker", "--engine", "mocker", "--instance-id", instance_id, "--port", "0", "--grace-period", "0",
                *MOCKER, *plane_flags(etcd, nats), *extra)  # fmt: skip
    return p, await p.address()


async def collect(stream: AsyncIterator[TokenChunk]) -> list[TokenChunk]:
    return [c async for c in stream]


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.get("token_ids", ())]


async def metric(port: int, name: str) -> float:
    """One sample of the router's /metrics (summed over label sets)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
    await writer.drain()
    body = (await asyncio.wait_for(reader.read(), 10)).decode()
    writer.close()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name))


def request(i: int, max_tokens: int) -> TokenRequest:
    prompt = [(i * 7919 + k * 104729) % 30000 + 3 for k in range(96 + i)]
    return {"request_id": f"s{i}", "model": "mocker", "token_ids": prompt, "stop": {"max_tokens": max_tokens, "ignore_eos": True}}


@pytest.mark.parametrize("carrier", ["grpc", "tcp"])
async def test_kill_9_of_a_worker_mid_stream_migrates_all_16_streams_token_identically(carrier: str) -> None:
    """Also with the workers' sessions on TCP (`--session-port`, advertised in etcd): the router process then streams
    from each worker over a TCP connection to that port, and a killed worker's streams migrate as over gRPC."""
    extra = ["--session-port", "0" if carrier == "tcp" else "-1"]  # -1: sessions on gRPC only
    async with EtcdServer() as etcd, NatsServer() as nats, ChannelCache() as channels:
        procs: list[MeshllmProcess] = []
        try:
            (w1, a1), (w2, a2) = await asyncio.gather(
                start_worker(etcd, nats, "w1", *extra), start_worker(etcd, nats, "w2", *extra)
            )
            procs += [w1, w2]
            metrics_port = free_port()
            router = MeshllmProcess("router", "--port", "0", "--metrics-port", str(metrics_port), *plane_flags(etcd, nats))
            procs.append(router)
            client = RouterClient(channels, await router.address())

            async def both_workers() -> bool:
                return len((await client.list_workers("mocker")).workers) == 2

            await wait_until(both_workers, timeout_s=30, what="the router to see both workers")
            n, max_tokens = 16, 300
            received = [0] * n

            async def stream(i: int) -> list[TokenChunk]:
                chunks = []
                async for chunk in client.generate(request(i, max_tokens)):
                    chunks.append(chunk)
                    received[i] += len(chunk.get("token_ids", ()))
                return chunks

            tasks = [asyncio.create_task(stream(i)) for i in range(n)]
            await wait_until(lambda: min(received) >= 5, timeout_s=60, what="every stream to be under way")
            status = {w.worker_id: w.in_flight for w in (await client.list_workers()).workers}
            assert status["w1"] > 0 and status["w2"] > 0, status  # both workers carry streams
            for address in (a1, a2):
                session = (await WorkerClient(channels, address).get_info(timeout_s=5)).instance.session_address
                assert bool(session) == (carrier == "tcp"), session
                if session:
                    assert holds_connection(router.proc.pid, session), session
            at_kill = list(received)
            w1.kill9()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert max(at_kill) < max_tokens  # the kill happened mid-stream
            migrations = await metric(metrics_port, "meshllm_router_migrations_total")
            assert migrations >= status["w1"], (migrations, status)
            # the undisturbed run: the same requests on the surviving worker alone
            undisturbed = [
                tokens_of(chunks)
                for chunks in await asyncio.gather(
                    *(collect(client.generate({**request(i, max_tokens), "request_id": f"u{i}"})) for i in range(n))
                )
            ]
            for i, chunks in enumerate(results):
                assert chunks[-1]["finish_reason"] == "length", chunks[-1]
                assert sum("finish_reason" in c for c in chunks) == 1
                assert len(tokens_of(chunks)) == max_tokens and chunks[-1]["usage"]["completion_tokens"] == max_tokens
                assert chunks[-1]["usage"]["prompt_tokens"] == len(request(i, max_tokens)["token_ids"])
                assert tokens_of(chunks) == undisturbed[i], f"stream {i} differs from the undisturbed run"
            assert await w1.wait(5) == -signal.SIGKILL
        finally:
            for p in reversed(procs):
                await p.stop()


async def test_the_router_process_indexes_kv_events_from_nats_and_stops_in_order_on_sigterm() -> None:
    async with EtcdServer() as etcd, NatsServer() as nats, ChannelCache() as channels:
        procs: list[MeshllmProcess] = []
        try:
            w, _ = await start_worker(etcd, nats, "w1")
            procs.append(w)
            router = MeshllmProcess("router", "--port", "0", "--router-mode", "kv", *plane_flags(etcd, nats))
            procs.append(router)
            client = RouterClient(channels, await router.address())

            async def one_worker() -> bool:
                return len((await client.list_workers("mocker")).workers) == 1

            await wait_until(one_worker, timeout_s=30, what="the router to see the worker")
            req = request(1, 4)
            chunks = await collect(client.generate(req))
            assert len(tokens_of(chunks)) == 4

            async def indexed() -> bool:
                return (await client.list_workers()).workers[0].indexed_blocks >= len(req["token_ids"]) // 16

            await wait_until(indexed, timeout_s=30, what="the worker's KV events to reach the router's index")
            d = await client.route("mocker", req["token_ids"])
            assert d.worker_id == "w1" and d.candidates[0].overlap_blocks == len(req["token_ids"]) // 16
            router.proc.send_signal(signal.SIGTERM)
            assert await router.wait(30) == 0
        finally:
            for p in reversed(procs):
                await p.stop()


def test_bad_static_flags_get_one_line_and_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "meshllm", "router", "--static-endpoint", "a.b", "--static-workers", "127.0.0.1:1",
         "--model-name", "m"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshllm router: error:") and "--static-endpoint" in lines[0]

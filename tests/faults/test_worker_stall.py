"""Fault: a worker frozen with SIGSTOP while it carries streams, seen through the HTTP frontend.

Real etcd, nats-server, two mocker `meshllm worker` processes (discovery
lease 10 s, the default, so the lease is not what rescues the streams) and a
`meshllm frontend` process with its embedded routing core, all with default
stall detection. 24 streamed completions of 300 tokens run; once every stream
is under way and both workers carry some, one worker is stopped (SIGSTOP: the
process neither answers nor closes its connections, like a hung host).

Locks: every stream completes (200, `finish_reason` "length", 300 completion
tokens, `[DONE]`) with exactly the text of an undisturbed run of the same
request (the mocker's output depends only on the prompt, so a migrated stream
that duplicated or skipped a token would differ); no stream waits more than
5 s for its next event from the stall on; the frontend's routing core takes
the stopped worker out of routing (a failed health check) before its lease
expires; and new requests sent meanwhile are served by the other worker.
Also: gRPC keepalive alone fails a quiet call to a stopped server process
within keepalive time + timeout (3-5 s; grpc's own ping timeout is 60 s).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.transport import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from meshllm.testing.mesh import Completion, ProcessMesh, StreamSet, metric, report, scrape, stream_completion
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.servers import EtcdServer, NatsServer, free_port
from meshllm.testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

N, MAX_TOKENS = 24, 300
LEASE_TTL_S = 10.0
TARGET_S = 5.0  # the longest a stream may wait for its next event once its worker froze


def body(i: int) -> dict[str, Any]:
    return {"model": "mocker", "prompt": f"stall {i}: " + "once upon a time " * (3 + i), "max_tokens": MAX_TOKENS,
            "ignore_eos": True}  # fmt: skip


class Mesh:
    """Two workers with metrics ports and a frontend."""

    def __init__(self, workers: list[MeshllmProcess], metrics_ports: list[int], frontend: MeshllmProcess, url: str) -> None:
        self.workers, self.metrics_ports, self.frontend, self.url = workers, metrics_ports, frontend, url

    async def inflight(self, i: int) -> float:
        return metric(await scrape("127.0.0.1", self.metrics_ports[i]), "meshllm_worker_inflight_requests")


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    async with (
        EtcdServer() as etcd,
        NatsServer() as nats,
        ProcessMesh(etcd.endpoint, nats.url, lease_ttl_s=LEASE_TTL_S) as procs,
    ):
        ports = [free_port(), free_port()]
        started = await asyncio.gather(*(procs.worker(f"w{i}", "--metrics-port", str(ports[i])) for i in range(2)))
        frontend, url = await procs.frontend(workers=2)  # else the undisturbed run may all go to one
        workers = [p for p, _ in started]
        try:
            yield Mesh(workers, ports, frontend, url)
        finally:
            for w in workers:  # a stopped worker must run again to exit when the mesh closes
                w.send_signal(signal.SIGCONT)
            workers[0].kill9()


async def test_sigstop_of_a_worker_mid_stream_migrates_every_stream_within_5_s(mesh: Mesh) -> None:
    t = time.monotonic()
    baseline = await asyncio.gather(*(stream_completion(mesh.url, body(i)) for i in range(N)))
    normal_s = time.monotonic() - t  # the longest an undisturbed stream took
    assert all(r.ok for r in baseline), [(r.status, r.error) for r in baseline if not r.ok]

    streams = StreamSet.completions(mesh.url, [body(i) for i in range(N)])
    try:
        await wait_until(lambda: streams.under_way(3), timeout_s=30, what="every stream to be under way")
        loads = [await mesh.inflight(0), await mesh.inflight(1)]
        assert all(n > 0 for n in loads), loads  # both workers carry streams
        mesh.workers[0].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        # Taken out of routing by a failed health check while its discovery lease still runs.
        out_of_routing = asyncio.create_task(
            wait_until(
                lambda: "worker w0" in (tail := mesh.frontend.stderr_tail(20_000)) and "taken out of routing" in tail,
                timeout_s=LEASE_TTL_S - 1, interval_s=0.1, what="the frontend to take the stopped worker out of routing",
            )
        )  # fmt: skip
        results: list[Completion] = await streams.results(60)
        recovery_s = streams.recovery_s(stopped_at)
        out_s = await out_of_routing
        t = time.monotonic()
        after = await asyncio.gather(*(stream_completion(mesh.url, body(i)) for i in range(4)))
        after_s = time.monotonic() - t
        still_in_lease = time.monotonic() - stopped_at < LEASE_TTL_S
    finally:
        await streams.aclose()

    assert min(len(a) for a in streams.arrivals) > 3  # the stall was mid-stream
    for i, (got, want) in enumerate(zip(results, baseline, strict=True)):
        assert got.ok, (i, got.status, got.error, got.finish_reason)
        assert got.usage and got.usage["completion_tokens"] == MAX_TOKENS, (i, got.usage)
        assert got.text == want.text, f"stream {i} differs from the undisturbed run"
    assert recovery_s <= TARGET_S, f"a stream waited {recovery_s:.2f} s for its next event after the stall"
    assert max(a[-1] for a in streams.arrivals) - stopped_at <= normal_s + TARGET_S
    assert [r.text for r in after] == [b.text for b in baseline[:4]], [(r.status, r.error) for r in after]
    assert after_s < TARGET_S + normal_s
    assert still_in_lease  # the new requests did not wait for discovery to drop the worker
    report("worker SIGSTOP", streams=N, lost=sum(not r.ok for r in results), recovery_s=round(recovery_s, 3),
           out_of_routing_s=round(out_s, 2), normal_stream_s=round(normal_s, 2))  # fmt: skip


SERVER = """
import asyncio
from meshllm.config import ServerConfig
from meshllm.plane.request.server import start_server

async def main():
    server = await start_server(ServerConfig(host="127.0.0.1", port=0), [])
    print(server.port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_keepalive_fails_a_quiet_call_to_a_stopped_process_within_its_bound() -> None:
    """Locks: a Health/Watch call (one message, then nothing) to a meshllm gRPC server fails UNAVAILABLE within
    keepalive time + timeout once the server process is stopped — no session watchdog involved."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", SERVER, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int(await asyncio.wait_for(proc.stdout.readline(), 30))
        async with ChannelCache() as channels:
            watch = health_pb2_grpc.HealthStub(channels.get(f"127.0.0.1:{port}")).Watch(health_pb2.HealthCheckRequest())
            first = await asyncio.wait_for(watch.read(), 10)
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            proc.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            bound_s = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await asyncio.wait_for(watch.read(), bound_s + 10)  # the grace only catches a regression, at 60 s
            waited = time.monotonic() - stopped_at
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
        assert waited <= bound_s + 2.0, f"keepalive noticed the stopped server after {waited:.1f} s"
        report("keepalive, stopped server", detected_s=round(waited, 2))
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        await asyncio.wait_for(proc.wait(), 10)

"""`meshllm worker` as a real subprocess, with real etcd and nats-server.

Locks issue 3's integration clauses: registration in etcd, a typed client
streaming Generate, cancellation reaching the engine's abort, the SIGTERM
shutdown order (leave etcd first, finish in-flight, refuse new calls, exit 0),
`--static` without etcd, and an engine module outside services/.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from meshllm import errors
from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.plane.discovery.base import Discovery, open_discovery
from meshllm.plane.events.base import open_events
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.names import load_subject
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.servers import EtcdServer, NatsServer
from meshllm.testing.waiting import wait_until
from meshllm.v1 import discovery_pb2, events_pb2
from meshllm.worker.client import WorkerClient

pytestmark = pytest.mark.integration

ENGINES = Path(__file__).parent / "engines"
ROOT = Path(__file__).resolve().parents[2]


def WorkerProcess(*args: str, env: dict[str, str] | None = None) -> MeshllmProcess:
    """`meshllm worker ARGS` with tests/integration/engines importable (for --engine module:Class)."""
    path = f"{ENGINES}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return MeshllmProcess("worker", *args, env={"PYTHONPATH": path, **(env or {})})


@pytest.fixture
async def mesh() -> AsyncIterator[tuple[EtcdServer, NatsServer]]:
    async with EtcdServer() as etcd, NatsServer() as nats:
        yield etcd, nats


def plane_args(etcd: EtcdServer, nats: NatsServer) -> list[str]:
    return ["--discovery", "etcd", "--etcd-endpoints", etcd.endpoint, "--nats-url", nats.url, "--lease-ttl", "3"]


async def wait_instances(
    watch: AsyncIterator[dict[str, discovery_pb2.Instance]], pred: object, timeout_s: float
) -> dict[str, discovery_pb2.Instance]:
    async with asyncio.timeout(timeout_s):
        async for snap in watch:
            if pred(snap):  # type: ignore[operator]
                return snap
    raise AssertionError("watch ended")


async def etcd_discovery(etcd: EtcdServer) -> Discovery:
    return await open_discovery(PlaneConfig(discovery=DiscoveryKind.ETCD, etcd_endpoints=(etcd.endpoint,), lease_ttl_s=3))


async def test_worker_registers_streams_and_cancel_reaches_engine_abort(
    mesh: tuple[EtcdServer, NatsServer], tmp_path: Path
) -> None:
    etcd, nats = mesh
    probe = tmp_path / "aborts.txt"
    w = WorkerProcess(
        "--engine", "abort_probe:AbortProbeEngine", *plane_args(etcd, nats), "--token-delay-ms", "20",
        env={"ABORT_PROBE_FILE": str(probe)},
    )  # fmt: skip
    try:
        address = await w.address()
        async with await etcd_discovery(etcd) as disc, ChannelCache() as ch:
            snap = await wait_instances(
                disc.watch_instances("worker"), lambda s: any(i.address == address for i in s.values()), 10
            )
            (inst,) = snap.values()
            assert inst.role == discovery_pb2.WORKER_ROLE_AGGREGATED
            models = await disc.list_models()
            assert models[inst.id].name == "sample"

            client = WorkerClient(ch, address)
            chunks = [c async for c in client.generate({"request_id": "full", "token_ids": [10, 20], "stop": {"max_tokens": 5}})]
            assert [t for c in chunks for t in c.get("token_ids", [])] == [21, 22, 23, 24, 25]
            assert chunks[-1]["finish_reason"] == "length"

            # the sample engine publishes load snapshots; watch running go up then back to 0
            async with await open_events(PlaneConfig(events=EventsKind.NATS, nats_url=nats.url)) as bus:
                sub = await bus.subscribe(load_subject("meshllm", "worker"), events_pb2.LoadSnapshot)
                stream = client.generate({"request_id": "to-cancel", "token_ids": [1], "stop": {"max_tokens": 100_000}})
                await anext(stream)
                await stream.aclose()  # cancel mid-stream
                await wait_until(lambda: probe.exists() and "to-cancel" in probe.read_text(), what="the engine's abort")
                async with asyncio.timeout(10):
                    async for load in sub:
                        if load.worker_id == inst.id and load.running == 0:
                            break
            assert probe.read_text().splitlines() == ["to-cancel"]
    finally:
        await w.stop()


async def test_sigterm_leaves_etcd_first_finishes_inflight_refuses_new_and_exits_0(mesh: tuple[EtcdServer, NatsServer]) -> None:
    etcd, nats = mesh
    w = WorkerProcess("--engine", "sample", *plane_args(etcd, nats), "--token-delay-ms", "20", "--grace-period", "1")
    try:
        address = await w.address()
        async with await etcd_discovery(etcd) as disc, ChannelCache() as ch:
            watch = disc.watch_instances("worker")
            await wait_instances(watch, lambda s: len(s) == 1, 10)
            client = WorkerClient(ch, address)
            stream = client.generate({"request_id": "long", "token_ids": [1], "stop": {"max_tokens": 200}})
            first = await anext(stream)
            tokens = list(first["token_ids"])
            w.send_signal(signal.SIGTERM)

            events: list[str] = []

            async def consume() -> None:
                async for chunk in stream:
                    tokens.extend(chunk.get("token_ids", []))
                    if "finish_reason" in chunk:
                        events.append(f"terminal:{chunk['finish_reason']}")

            async def watch_gone() -> None:
                await wait_instances(watch, lambda s: len(s) == 0, 10)
                events.append("unregistered")

            async def refused() -> None:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    try:
                        [
                            c
                            async for c in client.generate(
                                {"request_id": f"new-{time.monotonic()}", "token_ids": [1], "stop": {"max_tokens": 1}}
                            )
                        ]
                    except errors.Unavailable:
                        events.append("refused")
                        return
                    await asyncio.sleep(0.05)  # retry a probe until the worker stops admitting

            await asyncio.gather(consume(), watch_gone(), refused())
            assert events.index("unregistered") < events.index("terminal:length")
            assert "refused" in events
            assert len(tokens) == 200 and tokens == [(1 + 1 + i) % 32000 for i in range(200)]
        assert await w.wait() == 0
    finally:
        await w.stop()


async def test_static_worker_serves_with_no_etcd_running() -> None:
    w = WorkerProcess("--engine", "sample", "--static", "--discovery", "etcd", "--etcd-endpoints", "127.0.0.1:1")
    try:
        address = await w.address()
        async with ChannelCache() as ch:
            chunks = [
                c
                async for c in WorkerClient(ch, address).generate(
                    {"request_id": "s", "token_ids": [3], "stop": {"max_tokens": 2}}
                )
            ]
        assert [t for c in chunks for t in c.get("token_ids", [])] == [4, 5]
        w.send_signal(signal.SIGTERM)
        assert await w.wait() == 0
    finally:
        await w.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "nope"], "--engine 'nope' is neither a built-in"),
        (["--engine", "no_such_module:X"], "cannot import"),
        (["--engine", "sample", "--role", "boss"], "--role: invalid choice"),
        (["--engine", "sample", "--static", "--health-check-payload", "{bad"], "--health-check-payload is not JSON"),
        (["--engine", "sample", "--static", "--component", "a.b"], "--component 'a.b'"),
    ],
)
async def test_bad_flags_stop_startup_with_one_line(args: list[str], message: str) -> None:
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "meshllm", "worker", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr


async def test_drain_rpc_shuts_the_worker_process_down_with_exit_0() -> None:
    """Locks: Worker.Drain starts the ordered shutdown and the process exits by itself."""
    w = WorkerProcess("--engine", "sample", "--static", "--grace-period", "0")
    try:
        address = await w.address()
        async with ChannelCache() as ch:
            assert await WorkerClient(ch, address).drain() == 0
        assert await w.wait() == 0
    finally:
        await w.stop()

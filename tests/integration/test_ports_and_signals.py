"""Real `meshllm` processes: a taken port is one line and a non-zero exit; a second Ctrl-C forces the exit (issue 14).

Ports: gRPC servers bind exclusively (no SO_REUSEPORT), so a second worker,
router, frontend or `meshllm run` on a port another process holds exits 2
within seconds, printing exactly one line that names the flag and its
MESHLLM_* variable, and no traceback. Signals: a worker kept draining by a
long request in flight (long --drain-timeout) exits at once on a second
SIGINT with status 130 and "meshllm worker: forced exit".
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from mesh_run import ROOT, clean_env

from meshllm import errors
from meshllm.lifecycle import FORCED_EXIT_STATUS
from meshllm.plane.request.channels import ChannelCache
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.waiting import wait_until
from meshllm.v1 import worker_pb2
from meshllm.worker.client import WorkerClient

pytestmark = pytest.mark.integration

STATIC_ROUTER = ["--discovery", "static", "--static-endpoint", "meshllm.worker.generate", "--model-name", "m"]
STATIC_FRONTEND = [*STATIC_ROUTER, "--static-workers", "127.0.0.1:9"]
# (command line with PORT where the taken port goes, the flag the one line must name)
TAKEN = {
    "worker --port": (["worker", "--engine", "mocker", "--static", "--port", "PORT"], "--port"),
    "worker --metrics-port": (["worker", "--engine", "mocker", "--static", "--metrics-port", "PORT"], "--metrics-port"),
    "router --port": (["router", *STATIC_ROUTER, "--static-workers", "127.0.0.1:9", "--port", "PORT"], "--port"),
    "frontend --http-port": (["frontend", *STATIC_FRONTEND, "--http-port", "PORT"], "--http-port"),
    "frontend --grpc-port": (["frontend", *STATIC_FRONTEND, "--http-port", "0", "--grpc-port", "PORT"], "--grpc-port"),
    "frontend --workers 2": (["frontend", *STATIC_FRONTEND, "--workers", "2", "--http-port", "PORT"], "--http-port"),
    "run --http-port": (["run", "--http-port", "PORT"], "--http-port"),
    "run --router-port": (["run", "--http-port", "0", "--router-port", "PORT"], "--router-port"),
}
EXIT_BOUND_S = 10.0  # the exit takes well under 2 s (interpreter start included); the bound allows for a loaded machine


@pytest.fixture(scope="module")
def held_port() -> Iterator[int]:
    """A port a real `meshllm worker` serves gRPC on."""
    worker = MeshllmProcess("worker", "--engine", "mocker", "--static", "--port", "0", env=clean_env())
    try:
        yield int(asyncio.run(worker.address()).rsplit(":", 1)[1])
    finally:
        asyncio.run(worker.stop())


@pytest.mark.parametrize("case", list(TAKEN))
async def test_a_taken_port_stops_the_process_with_one_line_naming_the_flag(held_port: int, case: str) -> None:
    argv, flag = TAKEN[case]
    argv = [str(held_port) if a == "PORT" else a for a in argv]
    t0 = time.monotonic()
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "meshllm", *argv], cwd=ROOT, env=clean_env(),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    command = argv[0]
    var = "MESHLLM_" + flag.removeprefix("--").replace("-", "_").upper()
    expected = f"meshllm {command}: error: port {held_port} is already in use; choose another with {flag} or {var}"
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [expected], done.stderr
    assert "Traceback" not in done.stdout + done.stderr and not done.stdout.strip()
    assert elapsed < EXIT_BOUND_S, f"{case} took {elapsed:.1f}s to give up"


async def test_a_second_ctrl_c_while_draining_forces_an_immediate_exit() -> None:
    worker = MeshllmProcess(
        "worker", "--engine", "mocker", "--static", "--port", "0", "--drain-timeout", "120", "--grace-period", "0",
        "--speedup-ratio", "0.05", env=clean_env(MESHLLM_LOG_LEVEL="INFO"),
    )  # fmt: skip
    try:
        address = await worker.address()
        async with ChannelCache() as channels:
            client = WorkerClient(channels, address)
            stream = client.generate({"request_id": "long", "token_ids": list(range(10, 74)), "stop": {"max_tokens": 4000}})
            assert (await anext(stream)).get("token_ids")
            worker.send_signal(signal.SIGINT)

            async def draining() -> bool:
                return (await client.get_info()).state == worker_pb2.WORKER_STATE_DRAINING

            await wait_until(draining, timeout_s=15, what="the worker to start draining")
            assert worker.proc.poll() is None  # still waiting for the request in flight (up to --drain-timeout)
            t0 = time.monotonic()
            worker.send_signal(signal.SIGINT)
            status = await worker.wait(timeout_s=EXIT_BOUND_S)
            elapsed = time.monotonic() - t0
            with pytest.raises(errors.MeshError):  # the stream in flight ends with an error, not a normal end
                async with asyncio.timeout(10):
                    async for chunk in stream:
                        assert "finish_reason" not in chunk, chunk
        assert status == FORCED_EXIT_STATUS
        stderr = worker.stderr_tail(20_000)
        assert stderr.strip().splitlines()[-1] == "meshllm worker: forced exit", stderr[-2000:]
        assert "Traceback" not in stderr
        assert elapsed < 5.0, f"the forced exit took {elapsed:.1f}s"
    finally:
        await worker.stop()

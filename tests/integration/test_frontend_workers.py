"""`meshllm frontend --workers 2` as a real process group over real etcd + nats-server, two mocker worker processes.

Locks: both frontend processes accept connections on the one HTTP port and serve requests (40 requests, each on its
own connection, all complete; each process's own counter file shows requests); any process's /metrics is the group's
total; a child killed with SIGKILL is reported and replaced while the group keeps serving; SIGTERM stops every child
and then the parent, all with status 0.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
import pytest_asyncio
from prometheus_client.multiprocess import MultiProcessCollector

from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.servers import EtcdServer, NatsServer
from meshllm.testing.waiting import wait_until

pytestmark = pytest.mark.integration

CHAT = {"model": "mocker", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "ignore_eos": True}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def plane() -> AsyncIterator[list[str]]:
    """etcd + NATS with two mocker workers registered; yields the plane flags."""
    async with EtcdServer() as etcd, NatsServer() as nats:
        flags = ["--discovery", "etcd", "--etcd-endpoints", etcd.endpoint, "--nats-url", nats.url, "--lease-ttl", "3"]
        mocker = ["--engine", "mocker", "--port", "0", "--grace-period", "0", "--speedup-ratio", "100", *flags]
        workers = [MeshllmProcess("worker", "--instance-id", f"w{i}", *mocker) for i in range(2)]
        try:
            await asyncio.gather(*(w.address() for w in workers))
            yield flags
        finally:
            for w in workers:
                await w.stop()


async def start_group(flags: list[str], metrics_dir: Path) -> tuple[MeshllmProcess, str, list[int]]:
    """`meshllm frontend --workers 2`; its URL and child pids once every child serves the model."""
    frontend = MeshllmProcess(
        "frontend", "--workers", "2", "--http-host", "127.0.0.1", "--http-port", "0", "--grpc-host", "127.0.0.1", *flags,
        env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)},
    )  # fmt: skip
    lines = [await frontend.line(120) for _ in range(3)]
    url = re.search(r"OpenAI HTTP API on (http://\S+)/v1", lines[0])
    pids = re.search(r"2 processes, pids (\d+) (\d+)", lines[2])
    assert url and pids and "Inference gRPC on" in lines[1], lines
    await wait_until(lambda: every_process_serves(url[1]), timeout_s=60, what="both processes to serve the model")
    return frontend, url[1], [int(p) for p in pids.groups()]


async def every_process_serves(url: str) -> bool:
    """20 fresh connections all healthy: the kernel spreads them over the processes (a miss is 2**-19 likely)."""
    answers = await asyncio.gather(*(fresh(url, "GET", "/health") for _ in range(20)))
    return all(status == 200 for status, _ in answers)


async def fresh(url: str, method: str, path: str, body: object = None) -> tuple[int, bytes]:
    """One HTTP/1.0 request on a connection of its own: (status, body)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    data = orjson.dumps(body) if body is not None else b""
    head = f"{method} {path} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    writer.write(head.encode() + data)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 60)
    writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def chat_requests(metrics_dir: Path, pid: int) -> float:
    """Chat requests answered 200 by one process, from its own prometheus_client counter file."""
    path = metrics_dir / f"counter_{pid}.db"
    if not path.exists():
        return 0.0
    return sum(
        s.value
        for family in MultiProcessCollector.merge([str(path)], accumulate=True)
        for s in family.samples
        if s.name == "meshllm_frontend_requests_total"
        and s.labels.items() >= {"route": "/v1/chat/completions", "status": "200"}.items()
    )


def gauge_files(metrics_dir: Path, pid: int) -> list[Path]:
    return list(metrics_dir.glob(f"gauge_*_{pid}.db"))


def group_chat_requests(metrics_text: str) -> float:
    line = r'^meshllm_frontend_requests_total\{model="[^"]*",route="/v1/chat/completions",status="200"\} (\S+)$'
    return sum(float(v) for v in re.findall(line, metrics_text, re.M))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.asyncio(loop_scope="module")
async def test_two_processes_share_the_port_the_requests_and_one_metrics_view(plane: list[str], tmp_path: Path) -> None:
    frontend, url, pids = await start_group(plane, tmp_path)
    try:
        results = await asyncio.gather(*(fresh(url, "POST", "/v1/chat/completions", CHAT) for _ in range(40)))
        assert [status for status, _ in results] == [200] * 40
        assert all(orjson.loads(body)["usage"]["completion_tokens"] == 8 for _, body in results)
        per_process = {pid: chat_requests(tmp_path, pid) for pid in pids}
        assert all(n > 0 for n in per_process.values()) and sum(per_process.values()) == 40, per_process
        views = await asyncio.gather(*(fresh(url, "GET", "/metrics") for _ in range(6)))
        assert [group_chat_requests(body.decode()) for _, body in views] == [40.0] * 6  # whichever process answers
        frontend.send_signal(signal.SIGTERM)
        assert await frontend.wait(90) == 0, frontend.stderr_tail()
        assert not [pid for pid in pids if alive(pid)]
    finally:
        await frontend.stop()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_killed_process_is_reported_and_replaced_while_the_group_serves(plane: list[str], tmp_path: Path) -> None:
    frontend, url, pids = await start_group(plane, tmp_path)
    try:
        os.kill(pids[0], signal.SIGKILL)
        await wait_until(lambda: "restarted as pid" in frontend.stderr_tail(20_000), timeout_s=120, what="the restart")
        log = frontend.stderr_tail(20_000)
        assert f"frontend process 0 (pid {pids[0]}) was killed by SIGKILL" in log, log
        new_pid = int(re.findall(r"frontend process 0 restarted as pid (\d+)", log)[-1])
        assert alive(new_pid) and alive(pids[1]) and new_pid != pids[0]
        await wait_until(lambda: every_process_serves(url), timeout_s=60, what="the new process to serve the model")
        results = await asyncio.gather(*(fresh(url, "POST", "/v1/chat/completions", CHAT) for _ in range(20)))
        assert [status for status, _ in results] == [200] * 20
        assert chat_requests(tmp_path, new_pid) > 0
        assert not gauge_files(tmp_path, pids[0])  # the dead process's in-flight gauge left the view
        frontend.send_signal(signal.SIGTERM)
        assert await frontend.wait(90) == 0, frontend.stderr_tail()
        assert not alive(new_pid) and not alive(pids[1])
    finally:
        await frontend.stop()

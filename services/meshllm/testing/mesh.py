"""Real-process meshes for fault tests: `meshllm` workers, router and frontend over real etcd and nats-server.

    async with EtcdServer() as etcd, NatsServer() as nats, ProcessMesh(etcd.endpoint, nats.url) as mesh:
        w1, address = await mesh.worker("w1", "--metrics-port", str(free_port()))
        url = await mesh.frontend()                       # embedded routing core
        result = await stream_completion(url, {"model": "mocker", "prompt": "hi", "max_tokens": 50})
        ...
    # closing the mesh stops every process it started (SIGTERM, SIGKILL after a bound)

`stream_completion` streams one completion over `meshllm.bench.http` (a lean
HTTP/1.1 client) and records what a client on the wire sees: the status,
every event (with a callback per event, for arrival times), an in-stream
error, the final usage, `[DONE]`. `report()` prints a fault's measured
figures (visible with `pytest -s`) and appends them as one JSON line to
`$MESHLLM_FAULT_REPORT` when that is set; docs/reliability.md quotes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import orjson

from meshllm.bench.http import Connection, Endpoint, HttpError
from meshllm.lifecycle import AsyncCloseable
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.waiting import wait_until

__all__ = ["MOCKER", "Completion", "ProcessMesh", "StreamSet", "metric", "report", "scrape", "stream_completion"]

# A mocker that decodes about one token per 10 ms at speedup 1 (see docs/engines/mocker.md).
MOCKER = ("--engine", "mocker", "--block-size", "16", "--num-gpu-blocks", "4096", "--speedup-ratio", "1")
REPORT_ENV = "MESHLLM_FAULT_REPORT"
T = TypeVar("T")


class ProcessMesh(AsyncCloseable):
    """Starts `meshllm` processes against one etcd and one NATS; closing stops them all, newest first."""

    def __init__(self, etcd_endpoint: str, nats_url: str, *, lease_ttl_s: float = 3.0) -> None:
        self.etcd_endpoint, self.nats_url, self.lease_ttl_s = etcd_endpoint, nats_url, lease_ttl_s
        self.procs: list[MeshllmProcess] = []

    def plane_flags(self, *, etcd_endpoint: str | None = None, nats_url: str | None = None) -> list[str]:
        return [
            "--discovery", "etcd", "--etcd-endpoints", etcd_endpoint or self.etcd_endpoint,
            "--nats-url", nats_url or self.nats_url, "--lease-ttl", f"{self.lease_ttl_s:g}",
        ]  # fmt: skip

    def spawn(self, *args: str, prefix: Sequence[str] = ()) -> MeshllmProcess:
        """`meshllm ARGS` (logging at WARNING), stopped when the mesh closes."""
        proc = MeshllmProcess(*args, env={"MESHLLM_LOG_LEVEL": "WARNING"}, prefix=prefix)
        self.procs.append(proc)
        return proc

    async def worker(
        self,
        instance_id: str,
        *extra: str,
        prefix: Sequence[str] = (),
        etcd_endpoint: str | None = None,
        nats_url: str | None = None,
        timeout_s: float = 60.0,
    ) -> tuple[MeshllmProcess, str]:
        """A mocker `meshllm worker` (grace period 0) and its address, once it serves; `extra` overrides defaults."""
        proc = self.spawn(
            "worker", *MOCKER, "--instance-id", instance_id, "--port", "0", "--grace-period", "0",
            *self.plane_flags(etcd_endpoint=etcd_endpoint, nats_url=nats_url), *extra, prefix=prefix,
        )  # fmt: skip
        return proc, await proc.address(timeout_s)

    async def router(self, *extra: str, timeout_s: float = 60.0) -> tuple[MeshllmProcess, str]:
        """A `meshllm router` and its gRPC address."""
        proc = self.spawn("router", "--port", "0", *self.plane_flags(), *extra)
        return proc, await proc.address(timeout_s)

    async def frontend(self, *extra: str, workers: int = 0, timeout_s: float = 60.0) -> tuple[MeshllmProcess, str]:
        """A `meshllm frontend` (embedded routing core unless `--router-address` is in `extra`) and its HTTP base URL.

        With `workers`, it returns once the embedded routing core's pool holds that many workers (its
        `meshllm_router_workers` on the frontend's /metrics): requests sent earlier may all go to the first found.
        """
        proc = self.spawn("frontend", "--http-host", "127.0.0.1", "--http-port", "0", "--grpc-port", "-1",
                          *self.plane_flags(), *extra)  # fmt: skip
        line = await proc.line(timeout_s)
        m = re.search(r"OpenAI HTTP API on (https?://([^:/]+):(\d+))/v1", line)
        assert m, line
        if workers:
            host, port = m[2], int(m[3])

            async def pool_full() -> bool:
                return metric(await scrape(host, port), "meshllm_router_workers") >= workers

            await wait_until(pool_full, timeout_s=timeout_s, what=f"the frontend to see {workers} workers")
        return proc, m[1]

    async def _aclose(self) -> None:
        for proc in reversed(self.procs):
            await proc.stop()


# ---------------------------------------------------------------- HTTP


@dataclass
class Completion:
    """What one streamed completion delivered, as the client saw it."""

    status: int = 0
    text: str = ""
    events: int = 0
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: Any = None
    done: bool = False  # saw `data: [DONE]`

    @property
    def ok(self) -> bool:
        """Status 200, no error event, a finish reason, [DONE]."""
        return self.status == 200 and self.error is None and self.finish_reason is not None and self.done


async def stream_completion(
    url: str,
    body: dict[str, Any],
    *,
    on_event: Callable[[Completion], None] | None = None,
    timeout_s: float = 60.0,
    chat: bool = False,
) -> Completion:
    """POST /v1/completions (`chat`: /v1/chat/completions) with `stream: true` (and usage); `on_event` sees the
    result after every event.

    A connection that breaks mid-stream is a result too (`error` says how), never an exception.
    """
    result = Completion()
    payload = orjson.dumps({**body, "stream": True, "stream_options": {"include_usage": True}})
    conn = Connection(Endpoint.parse(url))
    try:
        async with asyncio.timeout(timeout_s):
            resp = await conn.post("/chat/completions" if chat else "/completions", payload)
            result.status = resp.status
            if resp.status != 200:
                result.error = (await resp.read()).decode(errors="replace")
                return result
            async for data in resp.events():
                if data == b"[DONE]":
                    result.done = True
                    break
                event = orjson.loads(data)
                result.events += 1
                if "error" in event:
                    result.error = event["error"]
                for choice in event.get("choices") or ():
                    result.text += (choice.get("delta") or {}).get("content") or "" if chat else choice.get("text") or ""
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                result.usage = event.get("usage") or result.usage
                if on_event is not None:
                    on_event(result)
    except HttpError as exc:
        result.error = f"HttpError: {exc}"
    finally:
        await conn.close()
    return result


async def scrape(host: str, port: int, path: str = "/metrics") -> str:
    """GET `path` over HTTP/1.0: the body ('' when nothing answers)."""
    try:
        async with asyncio.timeout(10):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            await writer.drain()
            raw = await reader.read()
            writer.close()
    except (OSError, TimeoutError):
        return ""
    return raw.partition(b"\r\n\r\n")[2].decode(errors="replace")


def metric(text: str, name: str) -> float:
    """A Prometheus sample (`name` or `name{...}`), summed over its label sets; 0 when absent."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            with contextlib.suppress(ValueError):
                total += float(line.rsplit(" ", 1)[1])
    return total


def report(fault: str, **figures: object) -> None:
    """Print one fault's measured figures; also append them as a JSON line to $MESHLLM_FAULT_REPORT if set."""
    line = orjson.dumps({"fault": fault, **figures}).decode()
    print(f"\nFAULT {line}")
    if path := os.environ.get(REPORT_ENV):
        with open(path, "a") as f:
            f.write(line + "\n")


class StreamSet(Generic[T]):
    """Concurrent streams with the arrival time of every event, for faults injected mid-stream.

    streams = StreamSet.completions(url, bodies)          # or StreamSet([lambda tick: my_stream(i, tick), ...])
    await wait_until(lambda: streams.under_way(3), ...)
    t = time.monotonic(); inject_fault()
    results = await streams.results(60)
    streams.recovery_s(t)          # the longest wait for an event that any stream saw from the fault on
    """

    def __init__(self, starts: Sequence[Callable[[Callable[[], None]], Awaitable[T]]]) -> None:
        """Each start(tick) runs one stream and calls tick() on every event it receives."""
        self.arrivals: list[list[float]] = [[] for _ in starts]
        self.tasks = [asyncio.create_task(_awaited(start(self._recorder(i)))) for i, start in enumerate(starts)]

    @staticmethod
    def completions(
        url: str, bodies: Sequence[dict[str, Any]], *, timeout_s: float = 60.0, chat: bool = False
    ) -> StreamSet[Completion]:
        """`stream_completion` of each body."""

        def start(body: dict[str, Any]) -> Callable[[Callable[[], None]], Awaitable[Completion]]:
            return lambda tick: stream_completion(url, body, on_event=lambda _: tick(), timeout_s=timeout_s, chat=chat)

        return StreamSet([start(body) for body in bodies])

    def _recorder(self, i: int) -> Callable[[], None]:
        return lambda: self.arrivals[i].append(time.monotonic())

    def under_way(self, min_events: int) -> bool:
        """Every stream has delivered at least `min_events` events."""
        return all(len(a) >= min_events for a in self.arrivals)

    async def results(self, timeout_s: float) -> list[T]:
        async with asyncio.timeout(timeout_s):
            return list(await asyncio.gather(*self.tasks))

    def recovery_s(self, fault_at: float) -> float:
        """Max over streams of the longest gap between events (or since the last one before the fault) after `fault_at`."""
        worst = 0.0
        for arrivals in self.arrivals:
            before = [t for t in arrivals if t < fault_at]
            after = [t for t in arrivals if t >= fault_at]
            if not after:
                continue
            times = [before[-1] if before else fault_at, *after]
            worst = max(worst, *(b - a for a, b in itertools.pairwise(times)))
        return worst

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable

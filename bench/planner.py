"""The SLA planner against static provisioning on a Mooncake trace whose rate swings 4× (issue 40).

    .venv/bin/python bench/planner.py            # print the section
    .venv/bin/python bench/planner.py --write    # and put it in docs/benchmarks.md

One script, the systems one after the other on the same requests and the same arrival times:

1. `meshllm planner profile` measures one mocker worker (the flags below) through the mesh.
2. The load: the first rows of ../shared/traces/mooncake/conversation_trace.jsonl, scaled (16 tokens per hash id,
   output capped), sent open loop at times that follow the trace's own gaps, warped so the rate follows
   quiet → ramp → peak (4× quiet) → ramp down → quiet. The quiet rate is set from the profile so that the peak
   needs `--peak-decode` decode workers.
3. Each system gets a fresh etcd, NATS and frontend (embedded KV router), disaggregated mocker workers:
   - `planner`: `meshllm planner --connector local`, starting at its minimum, scaling every `--interval-s`;
   - `static peak` / `static mean`: the workers the same sizing (decide.needed) asks for at the peak's and at
     the run's mean load, started before the load and kept.
4. Per 30-s window of arrivals: TTFT p90 and ITL p90 as the client measured them (a request's gaps count in its
   arrival's window), met when both are within the targets. Worker-seconds: worker processes (draining ones
   included) counted in /proc once a second. Streams broken: requests that did not end with a finish.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import dataclasses
import os
import shlex
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from harness.doc import publish
from harness.runinfo import LoadMonitor, load_sentence, machine, today
from planner_report import SystemRun, report

from meshllm.bench.http import Endpoint
from meshllm.bench.load import run_trace
from meshllm.bench.trace import TraceRequest, TraceScale, load_trace
from meshllm.planner.decide import needed
from meshllm.planner.model import Load
from meshllm.planner.profile import Profile
from meshllm.testing.mesh import ProcessMesh, metric, scrape
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.servers import EtcdServer, NatsServer
from meshllm.testing.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
HEADING = "## SLA planner against static provisioning (issue 40)"
MOCKER = "--engine mocker --speedup-ratio 0.1 --block-size 16 --max-num-seqs 8 --num-gpu-blocks 4096"


@dataclasses.dataclass(frozen=True)
class Phases:
    """Seconds of quiet, ramp up, peak, ramp down, quiet; the rate factor goes 1 → 4 → 1."""

    durations: tuple[float, float, float, float, float]

    @property
    def total_s(self) -> float:
        return sum(self.durations)

    def factor(self, t: float) -> float:
        q1, up, peak, down, _ = self.durations
        if t < q1:
            return 1.0
        if t < q1 + up:
            return 1.0 + 3.0 * (t - q1) / up
        if t < q1 + up + peak:
            return 4.0
        if t < q1 + up + peak + down:
            return 4.0 - 3.0 * (t - q1 - up - peak) / down
        return 1.0


def warp(trace_s: Sequence[float], phases: Phases, quiet_rate: float) -> list[float]:
    """Send times that keep the trace's gaps (its burstiness) but follow rate quiet_rate × factor(t).

    The i-th request arrives when the expected count ∫ quiet_rate × factor reaches its trace position
    (trace time × the trace's mean rate): Λ(t_i) = u_i, inverted on a 50-ms grid."""
    mean_rate = (len(trace_s) - 1) / (trace_s[-1] - trace_s[0])
    step = 0.05
    grid, cum = [0.0], [0.0]
    while grid[-1] < phases.total_s:
        t = grid[-1]
        cum.append(cum[-1] + quiet_rate * phases.factor(t + step / 2) * step)
        grid.append(t + step)
    out = []
    for ts in trace_s:
        u = (ts - trace_s[0]) * mean_rate
        k = bisect.bisect_left(cum, u)
        if k >= len(cum):
            break
        lo = max(k - 1, 0)
        frac = 0.0 if cum[k] == cum[lo] else (u - cum[lo]) / (cum[k] - cum[lo])
        out.append(grid[lo] + frac * (grid[k] - grid[lo]))
    return out


def requests_for(phases: Phases, quiet_rate: float, max_osl: int) -> list[TraceRequest]:
    expected = int(quiet_rate * sum(phases.factor(t) for t in range(int(phases.total_s)))) + 50
    rows = load_trace(TRACE, TraceScale(tokens_per_block=16, max_isl=1024, max_osl=max_osl, limit=expected * 2))
    times = warp([r.arrival_s for r in rows], phases, quiet_rate)
    return [dataclasses.replace(r, arrival_s=t) for r, t in zip(rows, times, strict=False)]


async def measure_profile(mocker: str, out: Path) -> Profile:
    argv = [sys.executable, "-m", "meshllm", "planner", "profile", "--engine", "mocker", "--out", str(out),
            "--isl", "128,384,1024", "--context", "384,768", "--concurrency", "1,4,8,12", "--osl", "64",
            "--requests", "2", "--", *shlex.split(mocker)[2:]]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(*argv)
    if await proc.wait() != 0:
        raise SystemExit("bench/planner.py: the profile failed")
    return Profile.load(out)


class WorkerCounter:
    """This run's worker processes (draining ones too: those that name its etcd) by role, counted in /proc once a
    second."""

    def __init__(self, etcd_endpoint: str) -> None:
        self.mark = etcd_endpoint.encode()
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._task: asyncio.Task[None] | None = None

    def count(self) -> dict[str, int]:
        counts = {"prefill": 0, "decode": 0, "agg": 0}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"meshllm" in argv and b"worker" in argv and b"--engine" in argv and self.mark in argv:
                role = argv[argv.index(b"--role") + 1].decode() if b"--role" in argv else "agg"
                counts[role] = counts.get(role, 0) + 1
        return counts

    async def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), self.count()))
            await asyncio.sleep(1.0)  # a sampling period

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[WorkerCounter]:
        self._task = asyncio.create_task(self._run())
        try:
            yield self
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def run_system(name: str, requests: list[TraceRequest], args: argparse.Namespace, counts: dict[str, int] | None,
                     profile_path: Path) -> SystemRun:  # fmt: skip
    async with EtcdServer() as etcd, NatsServer() as nats, ProcessMesh(etcd.endpoint, nats.url) as mesh:
        _, url = await mesh.frontend()
        worker_flags = [*shlex.split(args.mocker), "--port", "0", "--grace-period", "0", "--drain-timeout", "10",
                        *mesh.plane_flags()]  # fmt: skip
        planner = None
        if counts is None:
            planner = MeshllmProcess(
                "planner", "--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms), "--interval-s",
                str(args.interval_s), "--profile", str(profile_path), "--frontend-url", url, "--etcd-endpoints",
                etcd.endpoint, "--worker-flags", shlex.join(worker_flags), "--stop-workers-on-exit",
                "--max-prefill", str(args.max_prefill), "--max-decode", str(args.max_decode),
                "--predictor", args.predictor, "--down-cooldown-s", str(args.interval_s * 2),
                "--worker-log-dir", tempfile.mkdtemp(prefix="planner-bench-"), env={"MESHLLM_LOG_LEVEL": "INFO"},
            )  # fmt: skip
            mesh.procs.append(planner)
            await planner.line(60)
            expect = {"prefill": 1, "decode": 1}
        else:
            extra = [*shlex.split(args.mocker)[2:], "--drain-timeout", "10"]  # over mesh.worker's mocker defaults
            for role, n in counts.items():
                for i in range(n):
                    await mesh.worker(f"{name.replace(' ', '-')}-{role}-{i}", "--role", role, *extra)
            expect = counts
        await _until_pool(url, sum(expect.values()))
        counter = WorkerCounter(etcd.endpoint)
        async with counter.running():
            result = await run_trace(Endpoint.parse(url), "mocker", requests, progress=False, deadline_s=None,
                                     max_consecutive_errors=None)  # fmt: skip
        if planner is not None:
            log = Path(tempfile.gettempdir()) / "planner-bench-decisions.log"
            log.write_text(planner.stderr_tail(5_000_000))
            print(f"  the planner's log: {log}", flush=True)
            await planner.stop()
    return SystemRun(name, requests, result.records, counter.samples, result.duration_s)


async def _until_pool(url: str, n: int) -> None:
    host, port = url.split("//", 1)[1].rsplit(":", 1)

    async def full() -> bool:
        return metric(await scrape(host, int(port)), "meshllm_router_workers") >= n

    await wait_until(full, timeout_s=120, what=f"{n} workers in the frontend's pool")


def sizing(profile: Profile, load: Load, args: argparse.Namespace) -> dict[str, int]:
    need = needed(load, profile, args.ttft_ms / 1e3, args.itl_ms / 1e3, mode="disagg")
    return {role: max(1, -int(-n // 1)) for role, (n, _) in need.items()}


async def main(args: argparse.Namespace) -> None:
    phases = Phases(tuple(float(x) for x in args.phases.split(",")))  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as tmp, LoadMonitor() as load:
        profile_path = Path(args.profile) if args.profile else Path(tmp) / "profile.json"
        profile = Profile.load(profile_path) if args.profile else await measure_profile(args.mocker, profile_path)
        osl = args.max_osl * 0.9  # most conversation rows exceed the cap
        cap = profile.decode_capacity(384 + osl / 2, args.itl_ms / 1e3).tokens_per_s
        quiet_rate = args.peak_decode * cap / (4 * osl)
        requests = requests_for(phases, quiet_rate, args.max_osl)
        isl = sum(len(r.prompt_token_ids) for r in requests) / len(requests)
        osl = sum(r.max_tokens for r in requests) / len(requests)
        mean_rate = len(requests) / phases.total_s
        static = {
            "static peak": sizing(profile, Load(4 * quiet_rate, isl, osl), args),
            "static mean": sizing(profile, Load(mean_rate, isl, osl), args),
        }
        runs = []
        for name in args.systems.split(","):
            counts = None if name == "planner" else static[name]
            print(f"{name}: {counts or 'planner'} …", flush=True)
            runs.append(await run_system(name, requests, args, counts, profile_path))
    text = report(runs, args=args, profile=profile, phases=phases, quiet_rate=quiet_rate, static=static,
                  when=today(), host=machine(), load=load_sentence(load.samples))  # fmt: skip
    publish(HEADING, text, write=args.write)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--phases", default="60,90,120,90,60", help="seconds of quiet, ramp, peak, ramp down, quiet")
    p.add_argument("--peak-decode", type=float, default=6.0, help="decode workers the peak needs (sets the rate)")
    p.add_argument("--ttft-ms", type=float, default=2000.0)
    p.add_argument("--itl-ms", type=float, default=150.0)
    p.add_argument("--profile", default="", help="use this profile instead of measuring one")
    p.add_argument("--interval-s", type=float, default=10.0, help="the planner's interval")
    p.add_argument("--predictor", default="holt-winters")
    p.add_argument("--max-prefill", type=int, default=4)
    p.add_argument("--max-decode", type=int, default=8)
    p.add_argument("--max-osl", type=int, default=96)
    p.add_argument("--mocker", default=MOCKER, help="the workers' engine flags")
    p.add_argument("--systems", default="planner,static peak,static mean")
    p.add_argument("--window-s", type=float, default=30.0)
    p.add_argument("--write", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse(sys.argv[1:])))

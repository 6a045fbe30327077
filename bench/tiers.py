"""Benchmark KV tiers on the mocker: the scaled Mooncake conversation trace, tiers off vs on, same `kv` router.

    .venv/bin/python bench/tiers.py               # 3 repeats, update docs/benchmarks.md (## KV tiers (mocker))
    .venv/bin/python bench/tiers.py --quick       # 1 repeat, a shorter window, prints only
    .venv/bin/python bench/tiers.py --device-fractions small=0.003 --repeats 1 --no-write

8 mocker workers (block size 16, --speedup-ratio 1: real simulated time),
routed by an embedded `RouterCore` in `kv` mode over real gRPC, in-memory
discovery and events — the harness of bench/routing.py. Each worker's device
cache holds a fraction of the trace's working set (two sizes by default,
printed); "tiers on" adds a host tier (4× the device) and a disk tier (16×)
per worker (budgets and bandwidths printed).
Runs alternate off, on, off, on … on fresh workers so both share the
machine's noise; figures are medians over the repeats.

What is measured, per run: hit rate per tier = prompt tokens served from the
device cache / restored from host / restored from disk ÷ prompt tokens
(counted by the mockers at each request's first admission,
`MockerEngine.stats`; the same tokens the responses report as
`cached_tokens`); TTFT = first token's arrival at the caller minus the
request's trace arrival (p50, p90, p99); prefill tokens computed = prompt
tokens the workers' steps computed (recomputes after preemption included).
The `kv` router indexes the workers' lower tiers from their events and
prices a prefix held there by its restore cost (docs/routing.md, "Lower KV
tiers"), so with tiers on it also sends a conversation's next turn back to
the worker that offloaded its prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.doc import write_section
from harness.runinfo import LoadMonitor, load_sentence, machine, today, versions
from harness.stats import pct
from routing import PLANE, TRACE, Arrival, Result

from meshllm.bench.trace import TraceScale, load_trace, sample_sessions, token_arrivals, trace_stats
from meshllm.engine.mocker import MockerConfig, MockerEngine
from meshllm.engine.mocker.config import DEFAULT_KV_BYTES_PER_TOKEN
from meshllm.engine.worker_config import WorkerConfig
from meshllm.plane.discovery.base import MemoryDiscovery, MemoryStore
from meshllm.plane.events.base import MemoryBroker, MemoryEventBus
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.kv import block_hashes
from meshllm.protocol.types import TokenRequest
from meshllm.router.config import RouterConfig, RouterMode
from meshllm.router.core import RouterCore
from meshllm.worker.runtime import Worker

HEADING = "## KV tiers (mocker)"
SATURATED_MS = 1000.0  # a TTFT p50 above this is a queue: an idle mocker prefills 4,096 tokens in ~86 ms
GIB = 2**30


@dataclass(frozen=True, slots=True)
class Trace:
    requests: list[Arrival]
    describe: str
    working_set: int  # distinct blocks of the selection (at the mocker's block size)
    ceiling: float


@dataclass(frozen=True, slots=True)
class Setup:
    workers: int = 8
    block_size: int = 16
    speedup_ratio: float = 1.0
    device_blocks: int = 0
    host_blocks: int = 0
    disk_blocks: int = 0
    context_length: int = 4096 + 16

    def mocker(self, tiers: bool) -> MockerConfig:
        block_bytes = self.block_size * DEFAULT_KV_BYTES_PER_TOKEN
        return MockerConfig(
            block_size=self.block_size, num_gpu_blocks=self.device_blocks, speedup_ratio=self.speedup_ratio,
            context_length=self.context_length, max_num_seqs=64,
            kv_host_bytes=self.host_blocks * block_bytes if tiers else 0,
            kv_disk_bytes=self.disk_blocks * block_bytes if tiers else 0,
        )  # fmt: skip


@dataclass(slots=True)
class Run:
    tiers: bool
    result: Result
    prompt: int = 0
    device: int = 0
    host: int = 0
    disk: int = 0
    prefill: int = 0
    per_request: dict[str, tuple[float, int]] = field(default_factory=dict)  # request id -> (TTFT ms, cached tokens)

    def rate(self, tokens: int) -> float:
        return tokens / self.prompt if self.prompt else 0.0

    @property
    def total(self) -> float:
        return self.rate(self.device + self.host + self.disk)


@dataclass(slots=True)
class Row:
    tiers: bool
    runs: list[Run] = field(default_factory=list)

    def med(self, f: object) -> float:
        return statistics.median(f(r) for r in self.runs)  # type: ignore[operator]


def mooncake(window_s: float, keep: float, speedup: float, block_size: int) -> Trace:
    """A time window of the conversation trace, a seeded sample of its sessions (kept whole), scaled."""
    scale = TraceScale(tokens_per_block=64, speedup=speedup, duration_s=window_s, max_isl=4096, max_osl=16, seed=0)
    picked = sample_sessions(load_trace(TRACE, scale), keep)
    out: list[Arrival] = token_arrivals(picked, "mocker")
    stats = trace_stats(picked)
    working_set = stats.unique_hash_ids * scale.tokens_per_block // block_size
    describe = f"conversation trace, {scale.describe()}; {keep:.0%} of the sessions of the window (seeded); {stats.describe()}"
    return Trace(out, describe, working_set, stats.reuse_ceiling)


async def run_once(setup: Setup, trace: Trace, tiers: bool) -> Run:
    """The trace once through fresh workers (tiers on or off), routed by `kv`."""
    store, broker = MemoryStore(), MemoryBroker()
    engines = [MockerEngine(setup.mocker(tiers)) for _ in range(setup.workers)]
    workers: list[Worker] = []
    run = Run(tiers, Result("kv"))
    async with ChannelCache() as channels, MemoryDiscovery(store) as discovery, MemoryEventBus(broker) as bus:
        try:
            for i, engine in enumerate(engines):
                cfg = WorkerConfig(
                    engine="mocker", plane=PLANE, grace_period_s=0.0, instance_id=f"w{i}", health_check_interval_s=3600
                )
                workers.append(await Worker.start(engine, cfg, memory_store=store, memory_broker=broker))
            core = RouterCore(RouterConfig(plane=PLANE, mode=RouterMode.KV), discovery, bus, channels)
            await core.start()
            try:
                await core.pool.wait_until(lambda: len(core.pool.all()) == setup.workers)
                await core.feed.wait_synced()
                await drive(core, trace.requests, run)
            finally:
                await core.aclose()
        finally:
            for w in workers:
                await w.aclose()
    for e in engines:
        st = e.stats
        run.prompt += st.prompt_tokens
        run.device += st.device_hit_tokens
        run.host += st.host_hit_tokens
        run.disk += st.disk_hit_tokens
        run.prefill += st.prefill_tokens
    return run


async def drive(core: RouterCore, reqs: list[Arrival], run: Run) -> None:
    """Send every request at its trace arrival (open loop); record TTFT, e2e and cached tokens per request."""
    start = time.monotonic()
    result = run.result

    async def one(offset: float, req: TokenRequest) -> None:
        delay = start + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # the request's arrival time
        t0 = time.monotonic()
        first = None
        cached = 0
        async for chunk in core.generate(req):
            if first is None and chunk.get("token_ids"):
                first = time.monotonic()
            if "finish_reason" in chunk:
                usage = chunk["usage"]
                result.prompt_tokens += usage["prompt_tokens"]
                cached = usage["cached_tokens"]
                result.cached_tokens += cached
        end = time.monotonic()
        ttft = ((first or end) - t0) * 1000
        result.ttft_ms.append(ttft)
        result.e2e_ms.append((end - t0) * 1000)
        run.per_request[req["request_id"]] = (ttft, cached)

    await asyncio.gather(*(one(t, r) for t, r in reqs))
    result.seconds = time.monotonic() - start


def returning_ids(requests: list[Arrival], block_size: int, fleet_device_blocks: int) -> frozenset[str]:
    """The requests lower tiers are for, chosen from the trace before any run: a prefix back after the device forgot it.

    A request is returning when its prompt starts with at least one block an
    earlier request stored, and since that prefix was last used the fleet
    stored more new blocks than all its device caches hold together
    (`fleet_device_blocks`): spread over the workers, every device cache has
    turned over by then. Nothing measured decides the choice, so it favours
    neither tiers on nor off.
    """
    last_use: dict[int, int] = {}  # block hash -> new blocks stored fleet-wide before its last use
    stored = 0
    out: set[str] = set()
    for _, req in sorted(requests, key=lambda a: a[0]):
        hashes = block_hashes(req["token_ids"], block_size)
        lead = 0
        while lead < len(hashes) and hashes[lead] in last_use:
            lead += 1
        if lead and stored - min(last_use[h] for h in hashes[:lead]) > fleet_device_blocks:
            out.add(req["request_id"])
        for h in hashes:
            if h not in last_use:
                stored += 1
            last_use[h] = stored
    return frozenset(out)


def returning(off: Run, on: Run, ids: frozenset[str]) -> tuple[list[float], list[float]]:
    """TTFTs (off, on) of the returning requests `ids` (chosen before the run) that both runs served."""
    both = [i for i in sorted(ids) if i in off.per_request and i in on.per_request]
    return [off.per_request[i][0] for i in both], [on.per_request[i][0] for i in both]


def _p(q: float):  # type: ignore[no-untyped-def]
    return lambda r: r.result.p(r.result.ttft_ms, q)


def render(sizes: list[tuple[str, Setup, list[Row]]], trace: Trace, repeats: int, loads: list[float]) -> str:
    """The section: what ran, then one part per device cache size."""
    setup = sizes[0][1]
    lines = [
        HEADING,
        "",
        f"`.venv/bin/python bench/tiers.py` ({machine()}; {versions('grpcio', 'protobuf', 'xxhash')}): {setup.workers} mocker"
        f" workers, block size {setup.block_size}, --speedup-ratio {setup.speedup_ratio:g}, fresh workers per run, embedded"
        " RouterCore in `kv` mode (which also prices prefixes held in a worker's lower tiers by their restore cost,"
        " docs/routing.md), real gRPC to the workers. Per device cache size, tiers off and on alternate, each run of the trace"
        f" repeated {repeats}×; figures are medians over the repeats. Run on {today()}. {load_sentence(loads)}",
        "",
        f"Workload: {trace.describe}; working set {trace.working_set:,} blocks of {setup.block_size} tokens; prefix-reuse"
        f" ceiling (unbounded caches) {trace.ceiling:.1%}.",
        "",
    ]
    for label, size, rows in sizes:
        lines += size_part(label, size, rows, trace)
    lines += [
        "Restores are charged by the timing model (blocks × block bytes ÷ the tier's bandwidth, before --speedup-ratio),"
        " added to the step that prefills the rest of the prompt; offloads are free (real offload managers copy in the"
        " background). Hit rates are counted at each request's first admission, the same tokens its `cached_tokens`"
        ' reports. "Returning requests" are chosen from the trace before any run: their prompt starts with blocks an'
        " earlier request stored, and since that prefix was last used the fleet stored more new blocks than all its"
        " device caches hold together (`returning_ids`); each is paired by request id with the tiers-off run of the same"
        " repeat.",
    ]
    return "\n".join(lines) + "\n"


def size_part(label: str, setup: Setup, rows: list[Row], trace: Trace) -> list[str]:
    off, on = rows
    block_bytes = setup.block_size * DEFAULT_KV_BYTES_PER_TOKEN
    mocker = setup.mocker(True)

    def gib(blocks: int) -> str:
        return f"{blocks * block_bytes / GIB:,.1f} GiB"

    dev_only = off.med(lambda r: r.total)
    with_lower = on.med(lambda r: r.total)
    ratio = with_lower / dev_only if dev_only else float("inf")
    ttft = ", ".join(
        f"p{round(q * 100)} {on.med(_p(q)):,.1f} vs {off.med(_p(q)):,.1f} ms"
        f" ({'on' if on.med(_p(q)) < off.med(_p(q)) else 'off'})"
        for q in (0.5, 0.9, 0.99)
    )
    prefill_ratio = on.med(lambda r: r.prefill) / off.med(lambda r: r.prefill)
    ids = returning_ids(trace.requests, setup.block_size, setup.device_blocks * setup.workers)
    pairs = [returning(a, b, ids) for a, b in zip(off.runs, on.runs, strict=True)]
    n_ret = statistics.median(len(a) for a, _ in pairs)
    ret = ", ".join(
        f"p{round(q * 100)} {statistics.median(pct(b, q * 100) for _, b in pairs):,.1f} vs"
        f" {statistics.median(pct(a, q * 100) for a, _ in pairs):,.1f} ms"
        for q in (0.5, 0.9, 0.99)
    )
    lines = [
        f"### {label} device cache",
        "",
        f"Budgets per worker (blocks of {setup.block_size} tokens × {DEFAULT_KV_BYTES_PER_TOKEN:,} bytes per token ="
        f" {block_bytes / 2**20:g} MiB, an fp16 Llama-3-8B): device --num-gpu-blocks {setup.device_blocks:,}"
        f" ({setup.device_blocks / trace.working_set:.1%} of the working set, {gib(setup.device_blocks)}); tiers on adds"
        f" host --kv-host-bytes {mocker.kv_host_bytes:,} ({setup.host_blocks:,} blocks, {gib(setup.host_blocks)},"
        f" restored at {mocker.kv_host_bandwidth:g} GB/s) and disk --kv-disk-bytes {mocker.kv_disk_bytes:,}"
        f" ({setup.disk_blocks:,} blocks, {gib(setup.disk_blocks)}, restored at {mocker.kv_disk_bandwidth:g} GB/s).",
        "",
        f"- Hit rate counting lower tiers (tiers on) {with_lower:.1%} vs device-only (tiers off) {dev_only:.1%}:"
        f" {ratio:.2f}× (target ≥ 1.5×: {'met' if ratio >= 1.5 else 'not met'}).",
        f"- TTFT tiers on vs off: {ttft}; the lower one in brackets.",
        f"- Returning requests ({n_ret:,.0f} of {len(trace.requests):,} per run, median): TTFT on vs off {ret}.",
        f"- Prefill tokens computed: {on.med(lambda r: r.prefill):,.0f} with tiers vs {off.med(lambda r: r.prefill):,.0f}"
        f" without ({prefill_ratio:.2f}×).",
        *(
            [
                f"- Saturated: TTFT p50 {off.med(_p(0.5)) / 1000:,.1f} s without tiers is queueing, not prefill (this"
                " device cache admits only a few prompts at a time), so these TTFTs compare queues that fewer prefill"
                " tokens shorten."
            ]
            if off.med(_p(0.5)) > SATURATED_MS
            else []
        ),
        "",
        "| tiers | hit device | hit host | hit disk | hit total | TTFT p50 ms | TTFT p90 ms | p90 range | TTFT p99 ms"
        " | e2e p50 ms | prefill tokens computed | prompt tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        p90s = [_p(0.9)(r) for r in row.runs]
        span = f"{min(p90s):,.0f}–{max(p90s):,.0f}" if len(p90s) > 1 else "–"
        lines.append(
            f"| {'on' if row.tiers else 'off'} | {row.med(lambda r: r.rate(r.device)):.1%}"
            f" | {row.med(lambda r: r.rate(r.host)):.1%} | {row.med(lambda r: r.rate(r.disk)):.1%}"
            f" | {row.med(lambda r: r.total):.1%} | {row.med(_p(0.5)):,.1f}"
            f" | {row.med(_p(0.9)):,.1f} | {span} | {row.med(_p(0.99)):,.1f}"
            f" | {row.med(lambda r: r.result.p(r.result.e2e_ms, 0.5)):,.0f} | {row.med(lambda r: r.prefill):,.0f}"
            f" | {row.med(lambda r: r.prompt):,.0f} |"
        )
    return [*lines, ""]


async def run_all(setup: Setup, trace: Trace, repeats: int, label: str) -> list[Row]:
    rows = [Row(False), Row(True)]
    for rep in range(repeats):
        for row in rows:
            r = await run_once(setup, trace, row.tiers)
            row.runs.append(r)
            print(
                f"  {label} tiers {'on ' if row.tiers else 'off'} #{rep + 1}: hit device {r.rate(r.device):6.1%} host"
                f" {r.rate(r.host):6.1%} disk {r.rate(r.disk):6.1%} total {r.total:6.1%}  ttft p50"
                f" {_p(0.5)(r):7.1f} p90 {_p(0.9)(r):7.1f} p99 {_p(0.99)(r):7.1f} ms  prefill {r.prefill:,}"
                f"  {r.result.seconds:.1f}s",
                file=sys.stderr,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of tiers off and on each (figures are medians)")
    parser.add_argument("--quick", action="store_true", help="1 repeat, a 600 s trace window; implies --no-write")
    parser.add_argument("--window", type=float, default=3600.0, help="trace seconds replayed (before the speed-up)")
    parser.add_argument("--sessions", type=float, default=0.2, help="fraction of the window's sessions replayed")
    parser.add_argument("--trace-speedup", type=float, default=150.0, help="arrivals this many times faster")
    parser.add_argument("--speedup-ratio", type=float, default=1.0, help="the mockers' --speedup-ratio")
    parser.add_argument(
        "--device-fractions",
        default="tight=0.005,moderate=0.0078",
        help="LABEL=FRACTION,…: device blocks per worker ÷ the working set, one part per size",
    )
    parser.add_argument("--host-factor", type=float, default=4.0, help="host tier blocks ÷ device blocks")
    parser.add_argument("--disk-factor", type=float, default=16.0, help="disk tier blocks ÷ device blocks")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    trace = mooncake(600.0 if args.quick else args.window, args.sessions, args.trace_speedup, 16)
    print(f"{trace.describe}; working set {trace.working_set:,} blocks", file=sys.stderr)
    sizes: list[tuple[str, Setup, list[Row]]] = []
    with LoadMonitor() as monitor:
        for item in args.device_fractions.split(","):
            label, _, frac = item.partition("=")
            device = max(int(trace.working_set * float(frac)), 300)  # one 4,096-token prompt needs 257 blocks
            setup = Setup(
                speedup_ratio=args.speedup_ratio, device_blocks=device,
                host_blocks=int(device * args.host_factor), disk_blocks=int(device * args.disk_factor),
            )  # fmt: skip
            print(f"{label}: device {device:,}, host {setup.host_blocks:,}, disk {setup.disk_blocks:,} blocks", file=sys.stderr)
            sizes.append((label, setup, asyncio.run(run_all(setup, trace, repeats, label))))
    section = render(sizes, trace, repeats, monitor.samples)
    print(section)
    if not (args.no_write or args.quick):
        write_section(HEADING, section)
        print(f"updated {Path(__file__).resolve().parent.parent / 'docs' / 'benchmarks.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the split mesh (issue 15): real processes, `meshllm bench` load, CPU-ms per request of every process.

    .venv/bin/python bench/mesh.py                         # split + split-with-router, speedup 1000 and 10, c=32,64
    .venv/bin/python bench/mesh.py --dynamo --in-process   # + NVIDIA Dynamo 1.6.1 (the baseline) and `meshllm run`
    .venv/bin/python bench/mesh.py --profile               # + a py-spy profile of every meshllm process
    .venv/bin/python bench/mesh.py --profile --profile-dir D   # ... keeping py-spy's raw stacks in D
    .venv/bin/python bench/mesh.py --no-engines            # without the mocker engines alone (in-process, no mesh)
    .venv/bin/python bench/mesh.py --overhead --dynamo     # + TTFT/ITL at speedup 1, c=1: engine alone vs the mesh
    .venv/bin/python bench/mesh.py --requests 64 --speedup 1000 --concurrency 32 --no-write   # a quick look
    .venv/bin/python bench/mesh.py --tls --no-router --speedup 1000 --concurrency 32 --repeats 2   # "## TLS cost"
    .venv/bin/python bench/mesh.py --frontend-extra "--some-flag 2"   # extra flags for every `meshllm frontend`

Systems (bench/harness/systems.py), each started on loopback ephemeral ports as separate OS processes, one after
the other (never two at once), with the same load:
- *meshllm split*: etcd + nats-server + `meshllm frontend` (embedded routing core, --model-path = the SmolLM2
  directory Dynamo serves, so both tokenize identically) + N `meshllm worker --engine mocker` processes;
- *meshllm split + router process*: the same with `meshllm router` between them (`frontend --router-address`);
- *meshllm run* (`--in-process`): everything in one process;
- *Dynamo 1.6.1* (`--dynamo`): ../shared/anchors/dynamo/up.sh agg / down.sh, the baseline of every ratio.

Per level: warm-up requests (other prompts), then /proc CPU of every process tree sampled, the measured
`meshllm bench` level, sampled again. Before the systems of every speedup and repeat, the same mockers run alone in
this process (bench/mesh_load.py `engines_alone`): what the simulated engines give with no mesh in front of them.
`--profile` adds one unmeasured level per system and speedup under py-spy.
Results go to the "## Split mesh" section of docs/benchmarks.md (bench/harness/doc.py; `--tls`: the "## TLS cost" section,
bench/mesh_tls.py; `--no-coalesce`: the "## Split mesh, one event per token" section) and to stdout.
`--no-coalesce` gives every meshllm command `--no-coalesce` (each engine step its own SSE event, Dynamo's framing);
`--grpc-sessions` measures each split layout twice: as deployed (sessions on TCP session ports), then with every
session on a gRPC call (`--session-port -1` on workers and router).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.buildinfo import build_info, code_fingerprint
from harness.cpu import CpuMeter
from harness.doc import write_section
from harness.runinfo import command_line
from harness.systems import LABELS, MODEL_DIR, Running, SystemSpec, start_system
from mesh_load import Load, calibrate_chars_per_token, drive, engine_alone, engines_alone
from mesh_profile import Profile, Profiler, py_spy_binary
from mesh_report import Results, section, summary_line
from mesh_tls import tls_section

from meshllm.frontend.text.tokenizer import load_tokenizer

HEADING = "## Split mesh"
TLS_HEADING = "## TLS cost"
NO_COALESCE_HEADING = "## Split mesh, one event per token"
WARMUP_SEED = 1_000_000  # warm-up prompts differ from measured ones (the mocker caches prefixes)
PROFILE_SEED = 2_000_000
EXTRA_COMMANDS = ("frontend", "router", "worker", "run")  # --frontend-extra ... --run-extra


def system_spec(args: argparse.Namespace, speedup: float) -> SystemSpec:
    extra = {cmd: shlex.split(getattr(args, f"{cmd}_extra")) + (["--no-coalesce"] if args.no_coalesce else [])
             for cmd in EXTRA_COMMANDS}  # fmt: skip
    return SystemSpec(speedup=speedup, workers=args.workers, router_mode=args.router_mode, model_path=args.model_path,
                      extra=extra)  # fmt: skip


async def measure_level(running: Running, load: Load, c: int, requests: int, warmup: int, seed: int) -> dict[str, Any]:
    """Warm up, then one measured level with every process's CPU sampled just before and just after it."""
    if warmup:
        await drive(running.url, running.model, load, c, warmup, seed + WARMUP_SEED)
    meter = CpuMeter(running.processes)
    before = meter.sample()
    row = await drive(running.url, running.model, load, c, requests, seed)
    cpu = meter.delta(before, meter.sample())
    row["cpu_ms"] = {name: s * 1000 / requests for name, s in cpu.items()}
    row["loadgen_cpu_ms"] = row.pop("loadgen_cpu_s") * 1000 / requests
    row["load_avg"] = os.getloadavg()[0]
    return row


async def profile_level(running: Running, load: Load, c: int, requests: int, out_dir: Path) -> dict[str, Profile]:
    profiler = Profiler(out_dir)
    await profiler.start(running.python)
    try:
        await drive(running.url, running.model, load, c, requests, PROFILE_SEED + c)
    finally:
        profiles = await profiler.stop()
    return profiles


async def engines_level(args: argparse.Namespace, res: Results, load: Load, speedup: float) -> None:
    """The mockers alone in this process at every level (the engines-alone rows), right before the systems."""
    for c in res.levels:
        row = await engines_alone(
            args.model_path, load, speedup=speedup, engines=args.workers, concurrency=c, requests=res.requests,
            warmup=res.warmup, seed=args.seed * 1000 + c,
        )  # fmt: skip
        res.engines.setdefault((speedup, c), []).append(row)
        print(f"    mocker engines alone, c={c}: {row['req_per_s']:.1f} req/s, TTFT p50 {row['ttft_p50_ms']:.1f} ms, "
              f"busy {row['model_busy'] * 100:.0f}%", flush=True)  # fmt: skip


async def throughput(args: argparse.Namespace, res: Results, load: Load, profile_dir: Path) -> None:
    for speedup in res.speedups:
        for rep in range(res.repeats):
            if not args.no_engines:
                print(f"mocker engines alone, --speedup-ratio {speedup:g}, repeat {rep + 1}/{res.repeats}:", flush=True)
                await engines_level(args, res, load, speedup)
            for kind in res.systems:
                spec = system_spec(args, speedup)
                print(f"{LABELS[kind]}, --speedup-ratio {speedup:g}, repeat {rep + 1}/{res.repeats}:", flush=True)
                try:
                    await measure_system(args, res, load, profile_dir, spec, kind, rep)
                except Exception as exc:  # one broken system must not lose the others' figures
                    res.failures.append(f"{LABELS[kind]}, speedup {speedup:g}, repeat {rep + 1}: {_one_line(exc)}")
                    print(f"    FAILED: {res.failures[-1]}", flush=True)


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300]


async def measure_system(
    args: argparse.Namespace, res: Results, load: Load, profile_dir: Path, spec: SystemSpec, kind: str, rep: int
) -> None:
    """Start one system, measure every level (and profile one on the first repeat), stop it."""
    speedup = spec.speedup
    async with start_system(kind, spec) as running:
        for c in res.levels:
            row = await measure_level(running, load, c, res.requests, res.warmup, args.seed * 1000 + c)
            res.rows.setdefault((speedup, kind, c), []).append(row)
            res.load_avg.append(row["load_avg"])
            print(summary_line(kind, c, row), flush=True)
        if args.profile and rep == 0 and running.python:
            c = res.levels[0]
            res.profile_level = (c, args.profile_requests)
            out = profile_dir / f"{kind}-{speedup:g}"
            profs = await profile_level(running, load, c, args.profile_requests, out)
            res.profiles[(speedup, kind)] = profs
            for name, p in profs.items():
                top = ", ".join(f"{f} {pct:.0f}%" for pct, f in p.self_top[:3])
                print(f"    profile {name} ({p.samples} samples): {top}", flush=True)


async def overhead(args: argparse.Namespace, res: Results, load: Load) -> None:
    """TTFT / ITL at speedup 1, concurrency 1: the engine alone, then each system."""
    n, warm, seed = args.overhead_requests, min(args.warmup, 4), args.seed * 1000 + 1
    res.overhead_requests = n
    print("overhead (speedup 1, c=1): mocker engine alone, in-process", flush=True)
    res.overhead["engine"] = await engine_alone(args.model_path, load, n, warm, seed)
    spec = system_spec(args, 1.0)
    for kind in res.systems:
        print(f"overhead (speedup 1, c=1): {LABELS[kind]}", flush=True)
        try:
            async with start_system(kind, spec) as running:
                if warm:
                    await drive(running.url, running.model, load, 1, warm, seed + WARMUP_SEED)
                res.overhead[kind] = await drive(running.url, running.model, load, 1, n, seed)
        except Exception as exc:
            res.failures.append(f"{LABELS[kind]}, overhead at speedup 1: {_one_line(exc)}")
            print(f"    FAILED: {res.failures[-1]}", flush=True)
    for kind, row in res.overhead.items():
        print(f"    {kind}: TTFT p50 {row['ttft_p50_ms']:.2f} ms, ITL p50 {row['itl_p50_ms']:.3f} ms", flush=True)


def _floats(value: str) -> list[float]:
    return [float(v) for v in value.split(",") if v.strip()]


def _ints(value: str) -> list[int]:
    return [int(v) for v in value.split(",") if v.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--requests", type=int, default=320, help="measured requests per level")
    p.add_argument("--warmup", type=int, default=64, help="unmeasured requests before each level")
    p.add_argument("--concurrency", type=_ints, default=[32, 64], help="comma-separated levels (default 32,64)")
    p.add_argument("--speedup", type=_floats, default=[1000.0, 10.0], help="mocker --speedup-ratio list (default 1000,10)")
    p.add_argument("--repeats", type=int, default=1, help="start and measure every system this many times")
    p.add_argument("--workers", type=int, default=2, help="mocker worker processes")
    p.add_argument("--router-mode", default="round-robin", help="routing policy on every system")
    p.add_argument("--model-path", type=Path, default=MODEL_DIR, help="tokenizer + chat template (Dynamo's too)")
    p.add_argument("--chars-per-token", type=float, default=0.0,
                   help="prompt characters per token (default: measured with the tokenizer)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--no-split", action="store_true", help="skip the split mesh with the embedded routing core")
    p.add_argument("--no-router", action="store_true", help="skip the split mesh with a separate router process")
    p.add_argument("--in-process", action="store_true", help="also measure `meshllm run`")
    p.add_argument("--dynamo", action="store_true", help="also measure NVIDIA Dynamo 1.6.1 (the baseline)")
    p.add_argument("--no-engines", action="store_true", help="skip the mocker engines alone (in-process, no mesh)")
    p.add_argument("--profile", action="store_true", help="py-spy every meshllm process during an extra level")
    p.add_argument("--profile-requests", type=int, default=0, help="requests of the profiled level (default --requests)")
    p.add_argument(
        "--profile-dir",
        type=Path,
        default=None,
        help="keep py-spy's raw stacks here (one file per process; default: a temporary directory)",
    )
    p.add_argument("--overhead", action="store_true", help="also TTFT/ITL at speedup 1, c=1 vs the engine alone")
    p.add_argument("--overhead-requests", type=int, default=24, help="requests per system in --overhead")
    p.add_argument("--overhead-only", action="store_true", help="only the --overhead measurement")
    for cmd in EXTRA_COMMANDS:
        p.add_argument(f"--{cmd}-extra", default="", help=f"extra flags for every `meshllm {cmd}` (one string)")
    p.add_argument(
        "--no-coalesce",
        action="store_true",
        help="every meshllm command with --no-coalesce: one SSE event per engine step (Dynamo's framing)",
    )
    p.add_argument(
        "--grpc-sessions",
        action="store_true",
        help="also each split layout with its Generate sessions on gRPC calls (--session-port -1)",
    )
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    p.add_argument(
        "--tls",
        action="store_true",
        help="each split system also with mTLS, right after it; writes the TLS cost section instead of the split mesh's",
    )
    args = p.parse_args(argv)
    args.overhead = args.overhead or args.overhead_only
    args.no_engines = args.no_engines or args.tls  # the TLS section compares each system with its plaintext run
    args.profile_requests = args.profile_requests or args.requests
    if args.requests < 1 or args.repeats < 1 or args.workers < 1 or not args.concurrency or not args.speedup:
        p.error("--requests, --repeats, --workers must be >= 1; --concurrency and --speedup non-empty")
    return args


async def run(args: argparse.Namespace, argv: list[str]) -> Results:
    systems = [k for k, skip in (("split", args.no_split), ("router", args.no_router)) if not skip]
    if args.tls:  # plaintext, then mTLS, one after the other: the same machine state for both
        systems = [v for k in systems for v in (k, f"{k}+mtls")]
    elif args.grpc_sessions:  # sessions on TCP (the default), then on gRPC calls, one after the other
        systems = [v for k in systems for v in (k, f"{k}+grpc")]
    systems += (["run"] if args.in_process else []) + (["dynamo"] if args.dynamo else [])
    if not systems:
        raise SystemExit("nothing to measure: every system is switched off")
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)  # stop what was started, then exit
    if args.profile:
        py_spy_binary()  # fail now, not after the first system ran
    cpt = args.chars_per_token or calibrate_chars_per_token(load_tokenizer(str(args.model_path)), Load())
    load = Load(chars_per_token=cpt)
    res = Results(
        argv=command_line(["bench/mesh.py", *argv]), systems=systems, speedups=args.speedup, levels=args.concurrency,
        requests=args.requests, warmup=args.warmup, repeats=args.repeats, workers=args.workers,
        router_mode=args.router_mode, load=load.describe(),
        extra="; ".join(
            [*(["every `meshllm` command `--no-coalesce`"] if args.no_coalesce else []),
             *(f"`meshllm {c}` {v}" for c in EXTRA_COMMANDS if (v := getattr(args, f"{c}_extra")))]
        ),
    )  # fmt: skip
    res.info = build_info() | {"date": datetime.date.today().isoformat()}
    res.load_avg.append(os.getloadavg()[0])
    with tempfile.TemporaryDirectory(prefix="meshllm-bench-profiles-") as tmp:
        if not args.overhead_only:
            await throughput(args, res, load, args.profile_dir or Path(tmp))
        if args.overhead:
            await overhead(args, res, load)
    res.load_avg.append(os.getloadavg()[0])
    res.info["fingerprint_end"] = code_fingerprint()
    return res


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    for key in [k for k in os.environ if k.startswith(("MESHLLM_", "OTEL_"))]:
        del os.environ[key]  # the services read these; the benchmark sets what it means explicitly
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            res = runner.run(run(args, argv))
        except (asyncio.CancelledError, KeyboardInterrupt):
            print("bench/mesh.py: interrupted; every process it started was stopped", file=sys.stderr)
            return 130
    if args.tls:  # the TLS cost, not the split-mesh figures, is what a --tls run measured
        text = tls_section(res, TLS_HEADING)
        print(text)
        if not args.no_write:
            write_section(TLS_HEADING, text)
        return 0
    heading = NO_COALESCE_HEADING if args.no_coalesce else HEADING
    text = section(res, heading)
    print(text)
    if not args.no_write:
        write_section(heading, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

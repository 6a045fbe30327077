"""Benchmark `meshllm frontend --workers N` (issue 15): req/s and CPU per request of the split mesh for N frontend processes.

    .venv/bin/python bench/frontend_procs.py                      # N = 1, 2, 4; speedup 1000 and 10; c=64; 2 repeats
    .venv/bin/python bench/frontend_procs.py --procs 1,2 --repeats 1 --no-write

The split layout of bench/mesh.py (etcd + nats-server + 2 `meshllm worker --engine mocker` processes + `meshllm
frontend`), once per N with `--workers N` on the frontend: N processes on one HTTP port (SO_REUSEPORT), each with its
own routing core. The same `meshllm bench` load as bench/mesh.py; the values of N are interleaved within each repeat
so they share the machine's noise. Results go to the "## Frontend processes" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

from harness.doc import write_section
from harness.runinfo import LoadMonitor, command_line, load_sentence, machine, today, versions
from harness.systems import MODEL_DIR, SystemSpec, start_system
from mesh import measure_level
from mesh_load import Load, calibrate_chars_per_token

from meshllm.frontend.text.tokenizer import load_tokenizer

HEADING = "## Frontend processes"


async def measure(procs: list[int], speedups: list[float], c: int, requests: int, warmup: int, repeats: int,
                  load: Load) -> dict[tuple[float, int], list[dict[str, Any]]]:  # fmt: skip
    rows: dict[tuple[float, int], list[dict[str, Any]]] = {}
    for speedup in speedups:
        for rep in range(repeats):
            for n in procs:
                spec = SystemSpec(speedup=speedup, extra={"frontend": ["--workers", str(n)]})
                async with start_system("split", spec) as running:
                    row = await measure_level(running, load, c, requests, warmup, 1000 * rep + c)
                rows.setdefault((speedup, n), []).append(row)
                print(f"  speedup {speedup:g}, --workers {n}, repeat {rep + 1}/{repeats}: {row['req_per_s']:.1f} req/s, "
                      f"frontend {row['cpu_ms']['frontend']:.2f} CPU-ms/req, errors {row['errors']}", flush=True)  # fmt: skip
    return rows


def section(rows: dict[tuple[float, int], list[dict[str, Any]]], argv: list[str], c: int, requests: int, repeats: int,
            load: Load, loads: list[float]) -> str:  # fmt: skip
    cores = os.cpu_count() or 1
    lines = [
        HEADING,
        "",
        f"`{command_line(['bench/frontend_procs.py', *argv])}` on {today()} ({machine()}; "
        f"{versions('grpcio', 'uvloop', 'uvicorn', 'prometheus-client')}).",
        f"The split mesh of bench/mesh.py (etcd, NATS, 2 mocker workers, round-robin) with `meshllm frontend --workers N`; "
        f"load: {load.describe()}, concurrency {c}, {requests} measured requests per run, {repeats} repeat(s), the values "
        f"of N interleaved; medians shown, the range of the repeats in brackets. {load_sentence(loads)}",
        "",
        "| speedup | N | req/s | req/s × N=1 | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | frontend CPU-ms/req "
        "(all N processes) | whole mesh CPU-ms/req | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (speedup, n), reps in sorted(rows.items()):
        base = rows.get((speedup, 1))
        med = statistics.median(r["req_per_s"] for r in reps)
        lo, hi = min(r["req_per_s"] for r in reps), max(r["req_per_s"] for r in reps)
        ratio = f"{med / statistics.median(r['req_per_s'] for r in base):.2f}×" if base else "–"

        def pct(key: str, reps: list[dict[str, Any]] = reps) -> str:
            return " / ".join(f"{statistics.median(r[f'{key}_p{q}_ms'] for r in reps):.1f}" for q in (50, 90, 99))

        front = statistics.median(r["cpu_ms"]["frontend"] for r in reps)
        whole = statistics.median(sum(r["cpu_ms"].values()) for r in reps)
        spread = f" ({lo:.1f}–{hi:.1f})" if len(reps) > 1 else ""
        lines.append(
            f"| {speedup:g} | {n} | {med:.1f}{spread} | {ratio} | {pct('ttft')} | {pct('itl')} | {front:.2f} | {whole:.2f} "
            f"| {sum(r['errors'] for r in reps)} |"
        )
    lines += [
        "",
        f"This machine has {cores} cores, shared by the load generator, the workers, etcd, NATS and the N frontend "
        "processes, so more frontend processes can only help while the one frontend process is the bottleneck and a "
        "core is idle; the figures say whether that was so here. On a machine with cores to spare, N processes of "
        "one frontend each get a core.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--procs", default="1,2,4", help="comma-separated values of --workers N")
    p.add_argument("--speedup", default="1000,10", help="mocker --speedup-ratio list")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=480)
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args(argv)
    procs = [int(v) for v in args.procs.split(",")]
    speedups = [float(v) for v in args.speedup.split(",")]
    for key in [k for k in os.environ if k.startswith(("MESHLLM_", "OTEL_"))]:
        del os.environ[key]
    load = Load(chars_per_token=calibrate_chars_per_token(load_tokenizer(str(MODEL_DIR)), Load()))
    import uvloop

    with LoadMonitor() as monitor:
        rows = uvloop.run(measure(procs, speedups, args.concurrency, args.requests, args.warmup, args.repeats, load))
    text = section(rows, argv, args.concurrency, args.requests, args.repeats, load, monitor.samples)
    print(text)
    if not args.no_write:
        write_section(HEADING, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

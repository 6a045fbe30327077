"""Benchmark the frontend: `meshllm bench` against `meshllm run` (2 mocker workers, --speedup-ratio 1000).

    .venv/bin/python bench/frontend.py              # measure, print, update the "## Frontend" section of docs/benchmarks.md
    .venv/bin/python bench/frontend.py --no-write   # measure and print only

Workload (issue 6): streaming chat, ISL 600 ± 200, OSL 150 ± 25, ignore_eos,
concurrency 1, 8, 32, 64; `meshllm bench` runs in its own process, one
process per level, so the server's CPU time can be read per level from /proc.
Every layout is started afresh `--repeats` times (the layouts alternate, so
they share the machine's noise); each figure is the median over the repeats,
req/s with its range. Issue 6's targets are judged on the split layout (the
frontend in a process of its own), the way it is deployed.

Layouts:
- *run*: `meshllm run --workers 2 -- --speedup-ratio 1000`, everything in one
  process; CPU-ms per request of that process (frontend + router + 2 workers).
- *split*: 2 `meshllm worker --static` processes and a `meshllm frontend
  --static-workers ...` process (embedded routing core): CPU-ms per request of
  the frontend process alone — the frontend's own cost.
- *baseline*: the same two static workers driven directly over gRPC by
  `WorkerClient`s (token ids in, token ids out, no HTTP, no tokenizer) at
  concurrency 32 from this process; the frontend's tok/s reads as a ratio of it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
from harness.cpu import process_seconds
from harness.doc import write_section
from harness.runinfo import LoadMonitor, load_sentence, machine, median_range, today, versions
from harness.stats import median

from meshllm.config import DEFAULT_STREAM_INTERVAL_MS
from meshllm.plane.request.channels import ChannelCache
from meshllm.worker.client import WorkerClient

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
HEADING = "## Frontend"
LEVELS = (1, 8, 32, 64)


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MESHLLM_", "OTEL_"))}
    e["MESHLLM_LOG_LEVEL"] = "WARNING"
    return e


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "meshllm", *args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True, cwd=ROOT, env=env(),
    )  # fmt: skip


def wait_line(proc: subprocess.Popen[str], pattern: str, timeout_s: float = 120.0) -> re.Match[str]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"process exited ({proc.wait()}) before printing {pattern!r}")
        if m := re.search(pattern, line):
            return m
    raise RuntimeError(f"no {pattern!r} within {timeout_s}s")


@contextmanager
def processes(*procs: subprocess.Popen[str]) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def bench_level(url: str, concurrency: int, requests: int, warmup: int) -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable, "-m", "meshllm", "bench", "--url", url, "--model", "mocker", "--concurrency", str(concurrency),
            "--requests", str(requests), "--warmup", str(warmup), "--isl", "600", "--isl-spread", "200",
            "--osl", "150", "--osl-spread", "25", "--json", "-", "--quiet", "--seed", str(concurrency),
        ],
        capture_output=True, text=True, cwd=ROOT, env=env(), timeout=900, check=False,
    )  # fmt: skip
    if not out.stdout.strip():
        raise RuntimeError(f"meshllm bench failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = orjson.loads(out.stdout)[0]
    return result


def measure(url: str, pid: int, requests: int) -> list[dict[str, Any]]:
    rows = []
    for c in LEVELS:
        warmup = min(2 * c, 64)
        cpu0 = process_seconds(pid)
        row = bench_level(url, c, requests, warmup)
        row["cpu_ms_per_request"] = (process_seconds(pid) - cpu0) * 1000 / (requests + warmup)
        rows.append(row)
        print(
            f"  c={c}: {row['req_per_s']:.1f} req/s, {row['output_tok_per_s']:,.0f} tok/s, TTFT p50 {row['ttft_p50_ms']:.1f} ms, "
            f"errors {row['errors']}, {row['cpu_ms_per_request']:.2f} CPU-ms/req",
            flush=True,
        )
    return rows


def run_layout(requests: int) -> list[dict[str, Any]]:
    ports = ("--http-port", "0", "--grpc-port", "0", "--router-port", "0")
    proc = spawn("run", "--workers", "2", *ports, "--", "--speedup-ratio", "1000")
    with processes(proc):
        url = wait_line(proc, r"^OpenAI HTTP API\s+(\S+)/v1")[1]
        wait_line(proc, r"^try:")
        return measure(url, proc.pid, requests)


async def baseline(addresses: list[str], concurrency: int, requests: int) -> float:
    """Output tok/s of WorkerClients driving the workers directly (round-robin), same lengths."""
    rng = random.Random(0)
    jobs = [(rng.randint(400, 800), rng.randint(125, 175)) for _ in range(requests)]
    it = iter(range(requests))
    tokens = 0
    async with ChannelCache() as channels:
        clients = [WorkerClient(channels, a) for a in addresses]

        async def user() -> None:
            nonlocal tokens
            for i in it:
                isl, osl = jobs[i]
                prompt = [rng.randint(259, 31999) for _ in range(isl)]
                req = {"request_id": f"base-{i}", "token_ids": prompt, "stop": {"max_tokens": osl, "ignore_eos": True}}
                async for chunk in clients[i % len(clients)].generate(req):  # type: ignore[arg-type]
                    tokens += len(chunk.get("token_ids", ()))

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        return tokens / (time.perf_counter() - t0)


def split_layout(requests: int) -> tuple[list[dict[str, Any]], float]:
    workers = [spawn("worker", "--engine", "mocker", "--static", "--port", "0", "--speedup-ratio", "1000") for _ in range(2)]
    with processes(*workers):
        addresses = [wait_line(w, r"serving on (\S+)")[1] for w in workers]
        base = asyncio.run(baseline(addresses, 32, requests))
        print(f"  baseline (direct gRPC, c=32): {base:,.0f} tok/s", flush=True)
        fe = spawn(
            "frontend", "--static-endpoint", "meshllm.worker.generate", "--static-workers", ",".join(addresses),
            "--model-name", "mocker", "--http-host", "127.0.0.1", "--http-port", "0", "--grpc-port", "-1",
        )  # fmt: skip
        with processes(fe):
            url = wait_line(fe, r"OpenAI HTTP API on (\S+)/v1")[1]
            return measure(url, fe.pid, requests), base


Rows = list[dict[str, Any]]  # one `meshllm bench` row per concurrency level
COLUMNS = ("req_per_s", "output_tok_per_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms",
           "itl_p99_ms", "cpu_ms_per_request")  # fmt: skip


def _med(repeats: list[Rows], c: int, key: str) -> float:
    return median(r.get(key) for rows in repeats for r in rows if r["concurrency"] == c)


def table(repeats: list[Rows]) -> str:
    """Per level, the median over the repeats of every figure (req/s with its range), errors summed."""
    head = "| concurrency | req/s | output tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | errors | CPU-ms/req |"
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|"]
    for c in LEVELS:
        m = {k: _med(repeats, c, k) for k in COLUMNS}
        rps = [r["req_per_s"] for rows in repeats for r in rows if r["concurrency"] == c]
        spread = f" ({min(rps):.1f}–{max(rps):.1f})" if len(rps) > 1 else ""
        errors = sum(r["errors"] for rows in repeats for r in rows if r["concurrency"] == c)
        lines.append(
            f"| {c} | {m['req_per_s']:.1f}{spread} | {m['output_tok_per_s']:,.0f} | "
            f"{m['ttft_p50_ms']:.1f} / {m['ttft_p90_ms']:.1f} / {m['ttft_p99_ms']:.1f} | "
            f"{m['itl_p50_ms']:.2f} / {m['itl_p90_ms']:.2f} / {m['itl_p99_ms']:.2f} | {errors} | "
            f"{m['cpu_ms_per_request']:.2f} |"
        )
    return "\n".join(lines)


def _tail(repeats: list[Rows], c: int, p50_key: str) -> str:
    return ", ".join(f"{p} {_med(repeats, c, p50_key.replace('p50', p)):.1f}" for p in ("p90", "p99"))


def targets(split: list[Rows], run: list[Rows]) -> str:
    """Issue 6's targets, judged on the split layout's medians; `meshllm run`'s beside them, not judged."""
    verdict = lambda ok: "meets" if ok else "misses"  # noqa: E731
    errors = sum(r["errors"] for rows in split for r in rows)
    goals = [
        ("≥ 60 req/s at concurrency 32", 32, "req_per_s", "{:.1f} req/s", lambda v: v >= 60),
        ("≥ 9,000 output tok/s at concurrency 32", 32, "output_tok_per_s", "{:,.0f} tok/s", lambda v: v >= 9000),
        ("TTFT p50 ≤ 10 ms at concurrency 1", 1, "ttft_p50_ms", "{:.1f} ms", lambda v: v <= 10),
    ]
    lines = ["| target (issue 6) | split (judged) | | meshllm run (not judged) |", "|---|---|---|---|"]
    for name, c, key, fmt, ok in goals:
        v = _med(split, c, key)
        shown, ref = fmt.format(v), fmt.format(_med(run, c, key))
        if key.endswith("_p50_ms"):  # a latency: its tail beside it (not judged)
            shown, ref = f"{shown} ({_tail(split, c, key)})", f"{ref} ({_tail(run, c, key)})"
        lines.append(f"| {name} | {shown} | {verdict(ok(v))} | {ref} |")
    run_errors = sum(r["errors"] for rows in run for r in rows)
    lines.append(f"| zero errors | {errors} | {verdict(errors == 0)} | {run_errors} |")
    return "\n".join(lines)


def section(run_rows: list[Rows], split_rows: list[Rows], bases: list[float], requests: int, loads: list[float]) -> str:
    """The Frontend section from every repeat's rows (`run_rows[i]`: repeat i of the one-process layout)."""
    repeats = len(split_rows)
    ratios = [
        next(r for r in rows if r["concurrency"] == 32)["output_tok_per_s"] / base
        for rows, base in zip(split_rows, bases, strict=True)
    ]
    build = versions("uvicorn", "uvloop", "grpcio", "orjson", "tokenizers")
    return f"""{HEADING}

`.venv/bin/python bench/frontend.py --requests {requests} --repeats {repeats}` on {today()} ({machine()}; {build}).
`meshllm bench` (its own process) sends streaming chat requests, ISL 600 ± 200, OSL 150 ± 25, ignore_eos,
{requests} requests per level after a warm-up of min(2×c, 64); the mocker runs at --speedup-ratio 1000. Each
layout was started {repeats} time(s), alternating; every figure is the median over the {repeats} repeat(s)
(req/s range in brackets), errors are summed. {load_sentence(loads)}

**split** (2 `meshllm worker --static` processes; `meshllm frontend --static-workers` with the embedded routing core;
CPU-ms/req is the frontend process alone, i.e. HTTP + JSON + tokenizer + template + detokenizer + routing + gRPC client):

{table(split_rows)}

**meshllm run** (frontend + embedded KV router + 2 mocker workers in one process; CPU-ms/req is that whole process):

{table(run_rows)}

{targets(split_rows, run_rows)}

Baseline: the same two static workers driven directly by `WorkerClient`s over gRPC (token ids, no HTTP, no
tokenizer) at concurrency 32 from the benchmark process, once per repeat: {median_range(bases, "{:,.0f}")} output
tok/s; the split frontend delivers {median_range(ratios, "{:.2f}", "×")} of it through HTTP/SSE (each repeat's
frontend against that repeat's baseline). TTFT is request sent → first SSE event with text;
ITL is the gap between SSE events with text. Every process ran with the default `--stream-interval-ms`
({DEFAULT_STREAM_INTERVAL_MS:g} ms; at 0 no clock: a session's next message leaves when its client has taken the
last one),
and tokens that pile up meanwhile are merged where they wait (the worker's session
outbox, the stream's pipe; in `meshllm run`, the engine's own stream), so one event can carry several tokens and
TPOT (e2e time per output token) can be below ITL. The load generator, the frontend, the router and both
simulated engines share the machine's {os.cpu_count()} cores.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per concurrency level")
    parser.add_argument("--repeats", type=int, default=3, help="fresh starts of each layout (figures are medians)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    run_rows: list[Rows] = []
    split_rows: list[Rows] = []
    bases: list[float] = []
    with LoadMonitor() as monitor:
        for rep in range(args.repeats):
            print(f"repeat {rep + 1}/{args.repeats}, split (frontend process alone):", flush=True)
            rows, base = split_layout(args.requests)
            split_rows.append(rows)
            bases.append(base)
            print(f"repeat {rep + 1}/{args.repeats}, meshllm run:", flush=True)
            run_rows.append(run_layout(args.requests))
    text = section(run_rows, split_rows, bases, args.requests, monitor.samples)
    print(text)
    if not args.no_write:
        write_section("## Frontend", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the mesh's time to first token goes at concurrency 1 (issue 15's overhead target), stage by stage.

    .venv/bin/python bench/mesh_stages.py                      # split, split + router process, meshllm run
    .venv/bin/python bench/mesh_stages.py --systems split --no-write

bench/mesh.py --overhead measures TTFT through each system against the mocker engine alone; this script says
which stage of the path the difference is spent in. Each system is started (bench/harness/systems.py, speedup 1,
the same load as bench/mesh.py, `meshllm bench` at concurrency 1) with bench/stage_probe/ on PYTHONPATH: its
sitecustomize.py marks the moments a request passes the frontend's HTTP handler, preprocessing (chat template +
tokenizer), the stream opened to the worker, the worker receiving it, the engine starting it and making its first
token, the worker queueing that token, the frontend receiving it and sending the first SSE event. The marks cost
a few microseconds each, so these runs are not the judged ones; the TTFT they measure is printed beside the
stages. Results go to the "## Split mesh TTFT by stage" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import statistics
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.buildinfo import build_info
from harness.doc import write_section
from harness.runinfo import LoadMonitor, load_sentence, today
from harness.systems import LABELS, MODEL_DIR, SystemSpec, start_system
from mesh_load import Load, calibrate_chars_per_token, drive

from meshllm.bench.report import percentile
from meshllm.config import scoped_environ
from meshllm.frontend.text.tokenizer import load_tokenizer

HEADING = "## Split mesh TTFT by stage"
PROBE_DIR = Path(__file__).resolve().parent / "stage_probe"
ENV = "MESHLLM_BENCH_STAGES"  # bench/stage_probe/sitecustomize.py reads it
WARMUP_SEED = 1_000_000
# (mark, what the interval that ends at this mark is), in the order a request passes them
STAGES: tuple[tuple[str, str], ...] = (
    ("frontend.http_request", ""),
    ("frontend.preprocess", "HTTP: request read, JSON parsed and checked"),
    ("frontend.preprocessed", "preprocess: chat template, tokenizer, checks"),
    ("frontend.stream_opened", "routing, the request to protobuf, the session's stream opened"),
    ("worker.stream_received", "gRPC frontend → worker (session writer, network, the worker's reader)"),
    ("engine.start", "worker: stream task, admission, checks"),
    ("engine.first_token", "engine: prefill (the mocker's simulated time)"),
    ("worker.first_token_queued", "worker: the token out of the engine into the session"),
    ("frontend.first_token_received", "gRPC worker → frontend (session writer, network, the frontend's reader)"),
    ("frontend.first_event_sent", "frontend: detokenize, SSE event, written to the socket"),
)
# A mark counts the first time a request passes it: with a router process between them, the router's session
# server and client pass the marks named for the worker's and the frontend's first.
OTHER_LABELS = {
    "run": {"engine.start": "routing, the in-process call, worker admission and checks"},
    "router": {
        "frontend.stream_opened": "the request to protobuf, the session's stream to the router opened",
        "worker.stream_received": "gRPC frontend → router",
        "engine.start": "router: routing, gRPC router → worker, worker admission and checks",
        "frontend.first_token_received": "gRPC worker → router",
        "frontend.first_event_sent": "gRPC router → frontend, detokenize, SSE event, written to the socket",
    },
}


def per_request(lines: Iterable[str]) -> list[dict[str, float]]:
    """Group marks into requests (concurrency 1: each begins at a `frontend.http_request`); first time of each mark."""
    marks = sorted((float(t), stage) for t, _pid, stage in (ln.split() for ln in lines if ln.strip()))
    requests: list[dict[str, float]] = []
    for t, stage in marks:
        if stage == "frontend.http_request":
            requests.append({})
        if requests:
            requests[-1].setdefault(stage, t)
    return requests


def stage_table(requests: Sequence[dict[str, float]]) -> list[dict[str, Any]]:
    """Per interval between consecutive marks every request has: p50 / p90 in ms."""
    present = [s for s, _ in STAGES if requests and all(s in r for r in requests)]
    rows = []
    for a, b in itertools.pairwise(present):
        gaps = [(r[b] - r[a]) * 1000.0 for r in requests]
        rows.append({"from": a, "to": b, "p50": percentile(gaps, 50), "p90": percentile(gaps, 90), "n": len(gaps)})
    return rows


def server_part(requests: Sequence[dict[str, float]]) -> tuple[float, float]:
    """Medians over requests, ms: HTTP request → first SSE event sent; the same minus the engine's start → first token."""
    need = ("frontend.http_request", "frontend.first_event_sent", "engine.start", "engine.first_token")
    spans = [
        (r[need[1]] - r[need[0]], r[need[3]] - r[need[2]]) for r in requests if all(k in r for k in need)
    ]  # (whole, engine) in seconds
    if not spans:
        return float("nan"), float("nan")
    return statistics.median(w for w, _ in spans) * 1000.0, statistics.median(w - e for w, e in spans) * 1000.0


@dataclass
class SystemStages:
    kind: str
    ttft_p50_ms: float
    rows: list[dict[str, Any]]
    server_ms: float  # HTTP request → first SSE event, p50
    own_ms: float  # the same minus the engine's prefill, p50
    requests: int


@dataclass
class Results:
    argv: str
    load: str
    requests: int
    systems: list[SystemStages] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    load_avg: list[float] = field(default_factory=list)
    info: dict[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def _probe_env(folder: str) -> Iterator[None]:
    """Processes started inside load bench/stage_probe/ and mark into `folder`; the environment is restored after."""
    path = os.pathsep.join(p for p in (str(PROBE_DIR), os.environ.get("PYTHONPATH")) if p)
    with scoped_environ({ENV: folder, "PYTHONPATH": path}):
        yield


async def measure(kind: str, args: argparse.Namespace, load: Load, seed: int) -> SystemStages:
    spec = SystemSpec(speedup=1.0, workers=args.workers, model_path=args.model_path)
    with tempfile.TemporaryDirectory(prefix="meshllm-stages-") as folder:
        async with contextlib.AsyncExitStack() as stack:
            with _probe_env(folder):  # the services get the probe; the load generator does not
                running = await stack.enter_async_context(start_system(kind, spec))
            await drive(running.url, running.model, load, 1, args.warmup, seed + WARMUP_SEED)
            log = Path(folder) / "stages.log"
            skip = len(log.read_text().splitlines()) if log.exists() else 0
            row = await drive(running.url, running.model, load, 1, args.requests, seed)
            lines = log.read_text().splitlines()[skip:] if log.exists() else []
    requests = per_request(lines)
    if not requests:
        raise RuntimeError("no stage marks: bench/stage_probe/sitecustomize.py did not load in the services")
    return SystemStages(kind, row["ttft_p50_ms"], stage_table(requests), *server_part(requests), len(requests))


def section(res: Results) -> str:
    info = res.info
    out = [
        HEADING,
        "",
        f"`{res.argv}` on {info.get('date', '')} ({info.get('machine', '')}, Python {info.get('python', '')}, commit "
        f"{info.get('commit', '')}).",
        f"Load: `meshllm bench`, concurrency 1, {res.load}, --speedup-ratio 1; {res.requests} measured requests per "
        f"system after warm-up. {load_sentence(res.load_avg)}",
        "Each system runs with bench/stage_probe/ loaded into its processes, which marks the moments a request "
        "passes (monotonic clock, shared by the processes); a row is the interval between two marks, its p50 and p90 "
        "over the requests. The engine's prefill is measured inside the mesh, request by request, so the part that "
        "is not the engine's needs no separate engine-alone run. The marks cost a few microseconds each, so these "
        "runs are not the judged overhead figures (## Split mesh).",
        "",
    ]
    for s in res.systems:
        out += [
            f"**{LABELS[s.kind]}**: TTFT p50 {s.ttft_p50_ms:.2f} ms at the load generator; HTTP request → first SSE "
            f"event inside the servers {s.server_ms:.2f} ms, of which **{s.own_ms:.2f} ms is not the engine's prefill** "
            f"(each request's own time less its own prefill, p50 over {s.requests} requests); the load generator's "
            f"sockets and parsing: about {s.ttft_p50_ms - s.server_ms:.2f} ms (the difference of the two medians).",
            "",
            "| stage (ends at the mark) | p50 ms | p90 ms |",
            "|---|---:|---:|",
        ]
        labels = dict(STAGES) | OTHER_LABELS.get(s.kind, {})
        for r in s.rows:
            out.append(f"| {labels[r['to']]} (`{r['to']}`) | {r['p50']:.3f} | {r['p90']:.3f} |")
        out.append("")
    if res.failures:
        out += ["Failures: " + "; ".join(res.failures), ""]
    return "\n".join(out)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--systems", default="split,router,run", help="comma-separated: split, router, run")
    p.add_argument("--requests", type=int, default=48, help="measured requests per system")
    p.add_argument("--warmup", type=int, default=8, help="unmeasured requests before them")
    p.add_argument("--workers", type=int, default=2, help="mocker workers")
    p.add_argument("--model-path", type=Path, default=MODEL_DIR, help="tokenizer + chat template")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in args.systems if s not in ("split", "router", "run")]
    if bad or args.requests < 2 or args.warmup < 0:
        p.error(f"--systems takes split, router, run (got {bad}); --requests >= 2; --warmup >= 0")
    return args


async def run(args: argparse.Namespace, argv: list[str]) -> Results:
    tok = await asyncio.to_thread(load_tokenizer, str(args.model_path))
    load = Load(chars_per_token=calibrate_chars_per_token(tok, Load()))
    seed = args.seed * 1000 + 1
    res = Results(" ".join(["bench/mesh_stages.py", *argv]), load.describe(), args.requests)
    with LoadMonitor() as monitor:
        for kind in args.systems:
            try:
                s = await measure(kind, args, load, seed)
            except Exception as exc:
                res.failures.append(f"{LABELS[kind]}: {type(exc).__name__}: {exc}"[:300])
                print(f"  FAILED {res.failures[-1]}", flush=True)
                continue
            res.systems.append(s)
            print(f"{LABELS[kind]}: TTFT p50 {s.ttft_p50_ms:.2f}, servers {s.server_ms:.2f}, not engine {s.own_ms:.2f}")
            for r in s.rows:
                print(f"    {r['to']:<32} p50 {r['p50']:7.3f}  p90 {r['p90']:7.3f} ms", flush=True)
    res.load_avg = monitor.samples
    res.info = {**build_info(), "date": today()}
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    res = asyncio.run(run(args, argv))
    text = section(res)
    print(text)
    if not args.no_write and res.systems:
        write_section(HEADING, text)
    return 1 if res.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""bench/planner.py's report: SLA windows, worker-seconds and broken streams per system, and the targets."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harness.stats import pct, triple

from meshllm.bench.record import RequestRecord
from meshllm.bench.trace import TraceRequest
from meshllm.planner.profile import Profile


@dataclass
class SystemRun:
    name: str
    requests: list[TraceRequest]
    records: list[RequestRecord]
    workers: list[tuple[float, dict[str, int]]]  # (monotonic time, role -> processes), once a second
    duration_s: float


@dataclass(frozen=True)
class Window:
    start_s: float
    requests: int
    ttft_p90_s: float
    itl_p90_s: float
    met: bool


def windows(run: SystemRun, window_s: float, ttft_s: float, itl_s: float) -> list[Window]:
    """The run's arrivals cut into windows; a window meets the SLA when both its p90s are within the targets.
    A window whose requests broke counts as missed."""
    out = []
    n = math.ceil(max(r.arrival_s for r in run.requests) / window_s + 1e-9)
    for k in range(n):
        idx = [i for i, r in enumerate(run.requests) if k * window_s <= r.arrival_s < (k + 1) * window_s]
        recs = [run.records[i] for i in idx if i < len(run.records)]
        ok = [r for r in recs if r.error is None]
        ttft = pct([r.ttft for r in ok if r.ttft is not None], 90)
        itl = pct([g for r in ok for g in r.gaps], 90)
        met = bool(recs) and len(ok) == len(recs) and ttft <= ttft_s and (math.isnan(itl) or itl <= itl_s)
        out.append(Window(k * window_s, len(recs), ttft, itl, met))
    return out


def worker_seconds(run: SystemRun) -> dict[str, float]:
    """Worker-seconds by role: each once-a-second sample held until the next."""
    total: dict[str, float] = {}
    for (t0, counts), (t1, _) in zip(run.workers, run.workers[1:], strict=False):
        for role, n in counts.items():
            total[role] = total.get(role, 0.0) + n * (t1 - t0)
    return total


def _timeline(run: SystemRun, window_s: float) -> list[str]:
    """Mean prefill / decode workers in each window of the run (from its start)."""
    if not run.workers:
        return []
    t0 = run.workers[0][0]
    cells = []
    n = math.ceil((run.workers[-1][0] - t0) / window_s)
    for k in range(n):
        sel = [c for t, c in run.workers if k * window_s <= t - t0 < (k + 1) * window_s]
        if sel:
            p = sum(c.get("prefill", 0) for c in sel) / len(sel)
            d = sum(c.get("decode", 0) for c in sel) / len(sel)
            cells.append(f"{p:.1f}+{d:.1f}")
    return cells


def _system_rows(runs: Sequence[SystemRun], args: argparse.Namespace, peak_ws: float) -> list[str]:
    rows = [
        "| system | windows met (TTFT p90 and ITL p90) | worker-seconds (prefill + decode) | ÷ static peak | streams "
        "broken | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        ws = windows(run, args.window_s, args.ttft_ms / 1e3, args.itl_ms / 1e3)
        used = worker_seconds(run)
        total = sum(used.values())
        ok = [r for r in run.records if r.error is None]
        broken = len(run.records) - len(ok)
        rows.append(
            f"| {run.name} | {sum(w.met for w in ws)} of {len(ws)} ({sum(w.met for w in ws) / len(ws):.0%}) | "
            f"{total:,.0f} ({used.get('prefill', 0):,.0f} + {used.get('decode', 0):,.0f}) | "
            f"{total / peak_ws:.2f}× | {broken} | "
            f"{triple([r.ttft * 1e3 for r in ok if r.ttft is not None], '{:,.0f}')} | "
            f"{triple([g * 1e3 for r in ok for g in r.gaps], '{:,.0f}')} |"
        )
    return rows


def _window_rows(runs: Sequence[SystemRun], args: argparse.Namespace) -> list[str]:
    per = {run.name: windows(run, args.window_s, args.ttft_ms / 1e3, args.itl_ms / 1e3) for run in runs}
    lines = {run.name: _timeline(run, args.window_s) for run in runs}
    head = "| window (s) | requests | " + " | ".join(f"{r.name}: workers, TTFT p90 / ITL p90 ms" for r in runs) + " |"
    rows = [head, "|---|---:|" + "---|" * len(runs)]
    first = per[runs[0].name]
    for k, w in enumerate(first):
        cells = []
        for run in runs:
            win = per[run.name][k] if k < len(per[run.name]) else None
            workers = lines[run.name][k] if k < len(lines[run.name]) else "–"
            if win is None:
                cells.append("–")
                continue
            mark = "" if win.met else " ✗"
            cells.append(f"{workers}, {win.ttft_p90_s * 1e3:,.0f} / {win.itl_p90_s * 1e3:,.0f}{mark}")
        rows.append(f"| {w.start_s:.0f}–{w.start_s + args.window_s:.0f} | {w.requests} | " + " | ".join(cells) + " |")
    return rows


def _targets(runs: Sequence[SystemRun], args: argparse.Namespace, peak_ws: float) -> list[str]:
    planner = next((r for r in runs if r.name == "planner"), None)
    if planner is None:
        return []
    ws = windows(planner, args.window_s, args.ttft_ms / 1e3, args.itl_ms / 1e3)
    share = sum(w.met for w in ws) / len(ws)
    used = sum(worker_seconds(planner).values()) / peak_ws
    broken = sum(1 for r in planner.records if r.error is not None)
    return [
        f"- ≥ 95 % of windows within both SLAs: {share:.0%}, **{'met' if share >= 0.95 else 'missed'}**.",
        f"- ≤ 70 % of static peak's worker-seconds: {used:.0%}, **{'met' if used <= 0.70 else 'missed'}**.",
        f"- 0 streams broken by scale-down: {broken} broken, **{'met' if broken == 0 else 'missed'}**.",
    ]


def report(runs: Sequence[SystemRun], *, args: argparse.Namespace, profile: Profile, phases: Any, quiet_rate: float,
           static: dict[str, dict[str, int]], when: str, host: str, load: str) -> str:  # fmt: skip
    by_name = {r.name: r for r in runs}
    peak_run = by_name.get("static peak")
    peak_ws = sum(worker_seconds(peak_run).values()) if peak_run else float("nan")
    first = runs[0]
    isl = sum(len(r.prompt_token_ids) for r in first.requests) / len(first.requests)
    osl = sum(r.max_tokens for r in first.requests) / len(first.requests)
    sized = "; ".join(f"{k}: {v['prefill']} prefill + {v['decode']} decode" for k, v in static.items())
    lines = [
        "## SLA planner against static provisioning (issue 40)",
        "",
        f"Run {when} on {host} by `bench/planner.py` (one run per system, the systems one after the other on the "
        f"same requests at the same times). {load}",
        "",
        f"Load: {len(first.requests):,} rows of Mooncake conversation_trace.jsonl, 16 tokens per hash id, prompts ≤ "
        f"1,024 tokens, output ≤ {args.max_osl} (mean ISL {isl:,.0f}, mean OSL {osl:,.0f}), sent open loop; the "
        f"trace's gaps warped to a rate of {quiet_rate:.2f} req/s × (1 → 4 → 1): quiet, ramp, peak, ramp down, "
        f"quiet for {args.phases} s. Targets: TTFT p90 ≤ {args.ttft_ms:,.0f} ms, ITL p90 ≤ {args.itl_ms:,.0f} ms, "
        f"measured by the client per {args.window_s:.0f}-s window of arrivals.",
        "",
        f"Workers: disaggregated mocker (`{args.mocker}`), each with `--drain-timeout 10`; one frontend with its "
        f"embedded KV router, etcd and NATS, fresh for each system. The planner: `--connector local`, "
        f"`--interval-s {args.interval_s:g}`, `--predictor {args.predictor}`, 1–{args.max_prefill} prefill and "
        f"1–{args.max_decode} decode workers, from a profile "
        f"{'read from ' + args.profile if args.profile else 'measured at the start of the run'} "
        f"({len(profile.prefill)} prefill and {len(profile.decode)} decode rows, one prefill and one decode worker). "
        f"Static sizes from the same sizing "
        f"at the peak's and the mean's load: {sized}.",
        "",
        *_system_rows(runs, args, peak_ws),
        "",
        "Per window (workers: mean prefill + decode processes, draining ones included; ✗: the window missed):",
        "",
        *_window_rows(runs, args),
        "",
        "Targets (the planner's run):",
        "",
        *_targets(runs, args, peak_ws),
        "- Dynamo 1.6.1's planner is not in the table: with mocker workers it needs its virtual connector, whose "
        "scaling decisions a client of our own would have to turn into processes, and a Prometheus server to read "
        "its metrics from; neither was built for this run.",
    ]
    return "\n".join(lines) + "\n"

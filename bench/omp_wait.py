"""How llama.cpp's OpenMP threads should wait: decode time per token, spinning against sleeping (`--omp-wait`).

    .venv/bin/python bench/omp_wait.py              # measure, print, update docs/benchmarks.md
    .venv/bin/python bench/omp_wait.py --no-write

The llamacpp engine (SmolLM2-135M-Instruct Q4_1, n_ctx 2048, flash attention) decodes 120 tokens greedily
after a 100-token prompt, `--n-threads T --n-threads-batch T`, in a fresh process per measurement (OpenMP reads
its policy when it loads): `--omp-wait spin` and `--omp-wait passive`, alternating, `--repeats` times each, on an
idle machine and then beside one busy process (`while True: pass`, the "loaded machine" case). Decode time per
token = (last token − first token) ÷ (tokens − 1), each process's median of 2 requests.
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

HEADING = "## llama.cpp threads: spinning or sleeping"
TOKENS = 120

PROBE = """
import asyncio, statistics, sys, time
from meshllm.engine.base import Context
from meshllm.engine.llamacpp.engine import LlamaCppEngine

async def main(threads, wait):
    eng, _ = await LlamaCppEngine.from_args(
        ["--n-ctx", "2048", "--n-threads", threads, "--n-threads-batch", threads, "--omp-wait", wait]
    )
    await eng.start("omp-wait")
    per_token = []
    for r in range(2):
        req = {"request_id": f"r{r}", "token_ids": list(range(1000 + r, 1100 + r)), "sampling": {"temperature": 0.0},
               "stop": {"max_tokens": TOKENS, "ignore_eos": True}}
        ts = []
        async for chunk in eng.generate(req, Context(f"r{r}")):
            ts.extend(time.perf_counter() for _ in chunk.get("token_ids", ()))
        per_token.append((ts[-1] - ts[0]) / (len(ts) - 1) * 1000)
    print(eng.omp_wait, statistics.median(per_token))
    await eng.cleanup()

TOKENS = int(sys.argv[3])
asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def probe(threads: int, wait: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    argv = [sys.executable, "-c", PROBE, str(threads), wait, str(TOKENS)]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, check=True).stdout.split()
    if out[-2] != wait:
        raise RuntimeError(f"asked --omp-wait {wait}, the engine ran {out[-2]}")
    return float(out[-1])


def measure(threads: int, repeats: int) -> dict[str, list[float]]:
    got: dict[str, list[float]] = {"spin": [], "passive": []}
    for r in range(repeats):
        for wait in ("spin", "passive") if r % 2 == 0 else ("passive", "spin"):
            got[wait].append(probe(threads, wait))
            print(f"  T={threads} {wait:8} {got[wait][-1]:6.2f} ms/token", flush=True)
    return got


def cell(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    monitor = LoadMonitor()
    with monitor:
        print("idle machine", flush=True)
        idle = measure(args.threads, args.repeats)
        print("beside one busy process", flush=True)
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            loaded = measure(args.threads, args.repeats)
        finally:
            hog.kill()
            hog.wait()
    lines = [
        HEADING,
        "",
        f"`bench/omp_wait.py` ({today()}, {machine()}; llama.cpp {llama_cpp_build()}): the llamacpp engine alone, "
        f"SmolLM2-135M-Instruct Q4_1, {args.threads} threads for decode and prompts, {TOKENS} greedy tokens after a "
        f"100-token prompt, a fresh process per measurement, `--omp-wait spin` and `passive` alternating, "
        f"{args.repeats} processes each (median of 2 requests per process). "
        f"{load_sentence(monitor.samples, os.cpu_count())}",
        "",
        "| machine | decode ms per token, spin: median (min–max) | passive | passive ÷ spin |",
        "|---|---|---|---:|",
    ]
    for name, got in (("idle", idle), ("one busy process beside", loaded)):
        ratio = statistics.median(got["passive"]) / statistics.median(got["spin"])
        lines.append(f"| {name} | {cell(got['spin'])} | {cell(got['passive'])} | {ratio:.2f}× |")
    lines += [
        "",
        "Spinning wins while the threads have their cores; sleeping wins when other busy threads share them. "
        "`--omp-wait auto` (the default) spins when the llama.cpp threads of every engine in the process fit its "
        "CPUs, and sleeps otherwise (docs/engines/llamacpp.md).",
    ]
    publish(HEADING, "\n".join(lines), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

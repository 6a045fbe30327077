"""Benchmark what a pause before a prompt costs its encoding: the frontend's tokenizer, warm and after idle.

    .venv/bin/python bench/tokenize_idle.py              # measure, print, update docs/benchmarks.md
    .venv/bin/python bench/tokenize_idle.py --no-write   # measure and print only

At concurrency 1 the frontend is idle between a response's tokens (6 ms
apart at --speedup-ratio 1), so a request finds the tokenizer's tables as an
idle machine leaves them. This measures that in one process, without the
mesh: `HFTokenizer.encode` (what the frontend calls) on single-turn prompts
of ~600 tokens where no piece repeats (bench/mesh.py's load), each after a
pause of one kind: none (back to back), asleep for 0.5, 6 or 30 ms, or
8 MiB of other memory written and then 6 ms asleep (other work, like the
workers and the load generator sharing the cores, displacing the
tokenizer's tables from the CPU caches). The kinds take turns in blocks of
`--block` requests (a block's first two are not counted), so each is
measured in its steady state and all share the machine's noise. The figures
set the tokenizer row of "Split mesh TTFT by stage" beside the same call
back to back; nothing here is a target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

from harness.doc import publish
from harness.runinfo import LoadMonitor, load_sentence, machine, today, versions
from harness.stats import triple
from tokenize_cache import smollm2, unique_prompts

SECTION = "## Prompt tokenization after idle"
SETTLE = 2  # a block's first encodes follow another kind's pause: not counted


def _asleep(seconds: float) -> Callable[[], None]:
    return lambda: time.sleep(seconds)


_OTHER = bytearray(8 << 20)  # what other work on the machine touches between two requests (8 MiB)
_LINES = bytes(len(_OTHER) // 64)  # one byte per 64-byte cache line of _OTHER


def _displaced(seconds: float) -> Callable[[], None]:
    def other_work() -> None:
        _OTHER[::64] = _LINES  # one write per cache line: the CPU caches now hold this
        time.sleep(seconds)

    return other_work


PAUSES: tuple[tuple[str, Callable[[], None] | None], ...] = (
    ("none (back to back)", None),
    ("asleep 0.5 ms", _asleep(0.0005)),
    ("asleep 6 ms (the token gap at --speedup-ratio 1)", _asleep(0.006)),
    ("asleep 30 ms", _asleep(0.030)),
    ("8 MiB of other memory written, then asleep 6 ms", _displaced(0.006)),
)


def run(n: int, block: int, seed: int) -> tuple[dict[str, list[float]], float]:
    """ms per encode after each kind of pause (`n` counted each), and the prompts' mean token count."""
    tok, template = smollm2()
    rounds = -(-n // (block - SETTLE))
    texts = unique_prompts(template, rounds * block * len(PAUSES) + 20, seed)
    for text in texts[:20]:  # warm-up: code paths and the BPE word cache, as in a running frontend
        tok.encode(text)
    times: dict[str, list[float]] = {label: [] for label, _ in PAUSES}
    tokens = []
    it = iter(texts[20:])
    for _ in range(rounds):
        for label, pause in PAUSES:
            for i in range(block):
                text = next(it)
                if pause is not None:
                    pause()
                t0 = time.perf_counter()
                ids = tok.encode(text)
                ms = (time.perf_counter() - t0) * 1000
                if i >= SETTLE and len(times[label]) < n:
                    times[label].append(ms)
                    tokens.append(len(ids))
    return times, statistics.mean(tokens)


def render(times: dict[str, list[float]], tokens: float, n: int, block: int, loads: list[float]) -> str:
    base = statistics.median(times[PAUSES[0][0]])
    rows = "\n".join(f"| {label} | {triple(v, '{:.3f}')} | {statistics.median(v) / base:.2f}× |" for label, v in times.items())
    return f"""{SECTION}

`.venv/bin/python bench/tokenize_idle.py --requests {n} --block {block}` on {today()} ({machine()}; {versions("tokenizers")}).
`HFTokenizer.encode` (the frontend's call, segment cache included) of the SmolLM2-135M-Instruct tokenizer on
single-turn chat prompts of {tokens:,.0f} tokens on average where no piece repeats (bench/mesh.py's load), {n} per
row, each after a pause of the row's kind; the kinds take turns in blocks of {block} requests, the first {SETTLE} of a
block not counted. Times are of the encode call alone, in one process; the last column divides a row's median by
the back-to-back median. {load_sentence(loads)}

| before the encode | p50 / p90 / p99 ms | × back to back (p50) |
|---|---:|---:|
{rows}

At concurrency 1 the frontend waits ~6 ms between a response's tokens (--speedup-ratio 1), so the tokenizer row
of "Split mesh TTFT by stage" is an encode after a pause, not back to back.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="encodes per kind of pause")
    parser.add_argument("--block", type=int, default=20, help="requests of one kind in a row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.block <= SETTLE:
        parser.error(f"--requests must be at least 1 and --block more than {SETTLE}")
    with LoadMonitor() as monitor:
        times, tokens = run(args.requests, args.block, args.seed)
    section = render(times, tokens, args.requests, args.block, monitor.samples)
    publish(SECTION, section, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the mocker engine: scheduler overhead per step and max tokens/s at --speedup-ratio 0.

    .venv/bin/python bench/mocker.py                 # measure, print, update docs/benchmarks.md
    .venv/bin/python bench/mocker.py --no-write      # measure and print only

Three measurements, each the best of `--repeat` runs:

- *scheduler step*: `Scheduler.schedule()` + `postprocess()` with 256 decoding
  sequences, no event loop and no consumers — the simulator's own cost;
- *engine throughput*: `MockerEngine.generate` driven directly by many
  concurrent consumers at speedup 0, counting emitted tokens (the figure that
  must stay ≥ 50,000 tokens/s so the mocker never bottlenecks mesh benchmarks);
- *baseline*: the same consumers fed by a bare producer that appends one token
  per stream per loop turn and wakes it — the asyncio floor the engine is
  compared with (engine ÷ baseline is the share of time left to streaming).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from functools import partial
from pathlib import Path
from typing import Any

from harness.doc import write_section
from harness.runinfo import LoadMonitor, best_phrase, load_sentence, machine, today, versions

from meshllm.engine.base import Context, NullSink
from meshllm.engine.mocker import MockerConfig, MockerEngine
from meshllm.engine.mocker.block_manager import BlockManager
from meshllm.engine.mocker.scheduler import Scheduler
from meshllm.engine.mocker.sequence import Sequence
from meshllm.protocol.types import TokenRequest

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
TARGET_TOKENS_PER_S = 50_000


def prompt_of(i: int, length: int) -> list[int]:
    return [(i * 7919 + k * 31) % 32000 for k in range(length)]


# ------------------------------------------------------------------ scheduler alone


def scheduler_step_us(running: int, steps: int, prompt_len: int) -> float:
    """Mean µs of schedule()+postprocess() with `running` decoding sequences."""
    bm = BlockManager(16384, 64, NullSink(), watermark_blocks=163)
    sched = Scheduler(bm, max_num_seqs=256, max_num_batched_tokens=8192)
    for i in range(running):
        sched.add(Sequence(f"r{i}", prompt_of(i, prompt_len), seed=i, vocab_size=32000, block_size=64, max_tokens=10**6))
    now = 0.0
    while any(not s.prefilled for s in sched.running) or sched.waiting:  # get every sequence decoding
        sched.postprocess(sched.schedule(now))
    t0 = time.perf_counter()
    for _ in range(steps):
        plan = sched.schedule(now)
        assert plan.decode_seqs == running
        sched.postprocess(plan)
    return (time.perf_counter() - t0) / steps * 1e6


# ------------------------------------------------------------------ engine and baseline


async def drain(stream: AsyncIterator[Any]) -> tuple[int, int]:
    tokens = chunks = 0
    async for chunk in stream:
        tokens += len(chunk.get("token_ids", ()))
        chunks += 1
    return tokens, chunks


async def engine_throughput(requests: int, prompt_len: int, max_tokens: int) -> dict[str, float]:
    engine = MockerEngine(MockerConfig(speedup_ratio=0.0))
    steps = 0

    def count(_: object) -> None:
        nonlocal steps
        steps += 1

    engine.on_step = count
    await engine.start("bench")
    reqs: list[TokenRequest] = [
        {"request_id": f"r{i}", "token_ids": prompt_of(i, prompt_len), "stop": {"max_tokens": max_tokens, "ignore_eos": True}}
        for i in range(requests)
    ]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(drain(engine.generate(r, Context(r["request_id"]))) for r in reqs))
    wall = time.perf_counter() - t0
    await engine.cleanup()
    tokens = sum(t for t, _ in results)
    assert tokens == requests * max_tokens, tokens
    return {
        "tokens_per_s": tokens / wall,
        "step_us": wall / steps * 1e6,
        "tokens_per_chunk": tokens / sum(c for _, c in results),
    }


async def baseline_throughput(requests: int, max_tokens: int, running: int = 256) -> float:
    """Tokens/s of a bare producer feeding the same kind of consumers, `running` at a time."""
    loop = asyncio.get_running_loop()
    outputs: list[list[int]] = [[] for _ in range(requests)]
    waiters: list[asyncio.Future[None] | None] = [None] * requests

    async def stream(i: int) -> AsyncIterator[dict[str, list[int]]]:
        sent, out = 0, outputs[i]
        while sent < max_tokens:
            if len(out) > sent:
                chunk = {"token_ids": out[sent:]}
                sent = len(out)
                yield chunk
                continue
            fut = waiters[i] = loop.create_future()
            await fut

    async def produce() -> None:
        active = list(range(min(running, requests)))
        nxt = len(active)
        while active:
            for i in active:
                outputs[i].append(len(outputs[i]))
                fut = waiters[i]
                if fut is not None:
                    waiters[i] = None
                    fut.set_result(None)
            done = [i for i in active if len(outputs[i]) >= max_tokens]
            for i in done:
                active.remove(i)
                if nxt < requests:
                    active.append(nxt)
                    nxt += 1
            await asyncio.sleep(0)

    t0 = time.perf_counter()
    producer = asyncio.ensure_future(produce())
    results = await asyncio.gather(*(drain(stream(i)) for i in range(requests)))
    await producer
    return sum(t for t, _ in results) / (time.perf_counter() - t0)


# ------------------------------------------------------------------ report


def run_loop(make: Callable[[], Coroutine[Any, Any, Any]], loop_name: str) -> Any:
    if loop_name == "uvloop":
        import uvloop

        return uvloop.run(make())
    return asyncio.run(make())


def best(fn: Callable[[], Any], repeat: int, key: str | None = None) -> Any:
    runs = [fn() for _ in range(repeat)]
    if key is None:
        return max(runs)
    return max(runs, key=lambda r: r[key])


def render(rows: list[tuple[str, str]], args: argparse.Namespace, loads: list[float], build: str) -> str:
    """The section: what ran, how often, on what build and under which load, then the figures."""
    lines = [
        "## Mocker",
        "",
        f"`.venv/bin/python bench/mocker.py --repeat {args.repeat}` on {today()} ({machine()}; {build}).",
        f"Engine runs: {args.requests} concurrent requests of {args.prompt_len} prompt tokens and {args.max_tokens}",
        "output tokens (ignore_eos), defaults otherwise (max-num-seqs 256, block size 64, prefix caching on),",
        f"--speedup-ratio 0, driven through `generate` directly. Every figure is the {best_phrase(args.repeat)}",
        "(fastest scheduler step, highest tokens/s); a ratio divides two such figures.",
        load_sentence(loads),
        "",
        "| measurement | value |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in rows),
        "",
        "The scheduler step is `schedule()` + `postprocess()` alone (no event loop); the engine step",
        "includes waking and draining every stream. The baseline is a bare producer feeding the same",
        "consumers one token per stream per loop turn, so engine ÷ baseline is the share of the",
        "asyncio streaming floor the mocker keeps; the target is ≥ 50,000 tokens/s per worker.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1024, help="concurrent requests per engine run")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=256, help="output tokens per request")
    parser.add_argument("--running", type=int, default=256, help="decoding sequences in the scheduler-step run")
    parser.add_argument("--steps", type=int, default=2000, help="steps timed in the scheduler-step run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (best is kept)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)

    loops = ["asyncio"]
    try:
        import uvloop  # noqa: F401

        loops.append("uvloop")
    except ImportError:
        pass

    with LoadMonitor() as monitor:
        rows = measure(args, loops)
    section = render(rows, args, monitor.samples, versions("uvloop"))
    print(section)
    if not args.no_write:
        write_section("## Mocker", section)
        print(f"updated {DOC}", file=sys.stderr)
    return 0


def measure(args: argparse.Namespace, loops: list[str]) -> list[tuple[str, str]]:
    sched_us = min(scheduler_step_us(args.running, args.steps, args.prompt_len) for _ in range(args.repeat))
    rows = [(f"scheduler step, {args.running} decoding sequences", f"{sched_us:,.0f} µs ({sched_us / args.running:.2f} µs/seq)")]
    for loop_name in loops:
        eng = best(
            partial(run_loop, partial(engine_throughput, args.requests, args.prompt_len, args.max_tokens), loop_name),
            args.repeat,
            "tokens_per_s",
        )
        base = best(partial(run_loop, partial(baseline_throughput, args.requests, args.max_tokens), loop_name), args.repeat)
        ok = "meets" if eng["tokens_per_s"] >= TARGET_TOKENS_PER_S else "MISSES"
        rows += [
            (f"engine tokens/s ({loop_name})", f"{eng['tokens_per_s']:,.0f} ({ok} the 50,000 target)"),
            (f"engine step incl. streaming, mean ({loop_name})", f"{eng['step_us']:,.0f} µs"),
            (f"tokens per chunk ({loop_name})", f"{eng['tokens_per_chunk']:.2f}"),
            (f"baseline tokens/s ({loop_name})", f"{base:,.0f}"),
            (f"engine ÷ baseline ({loop_name})", f"{eng['tokens_per_s'] / base:.2f}"),
        ]
    return rows


if __name__ == "__main__":
    sys.exit(main())

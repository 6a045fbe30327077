"""`meshllm bench`: a load generator for any OpenAI-compatible endpoint.

    meshllm bench --url http://127.0.0.1:8000 --model mocker --concurrency 1,8,32,64 --requests 256 \\
                  --isl 600 --isl-spread 200 --osl 150 --osl-spread 25 [--json out.json] [--csv out.csv]
    meshllm bench --url ... --model mocker --request-rate 2,8 --requests 200 --slo ttft=200,itl=50
    meshllm bench --url ... --model mocker --dataset sharegpt.jsonl --requests 500 --concurrency 16
    meshllm bench --url ... --model mocker --trace conversation_trace.jsonl --trace-tokens-per-block 16 \\
                  --trace-speedup 10 --trace-limit 500 --trace-max-osl 32 [--trace-mode closed --concurrency 8]

A concurrency level runs that many users, each on one keep-alive connection
sending streaming requests back to back (closed loop); a `--request-rate`
level sends at seeded Poisson arrival times whatever is in flight (open
loop, capped by `--concurrency` when given). Prompts are random words of an
exact token length (`meshllm.bench.prompts`), a `--dataset`'s conversations
(`meshllm.bench.dataset`), or a scaled Mooncake `--trace`
(`meshllm.bench.trace`, via /v1/completions). The progress display goes to
stderr, results to stdout (`meshllm.bench.output`, definitions in
`meshllm.bench.report`). A run whose server goes away stops with one line
and exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from meshllm.bench.dataset import dataset_requests, load_dataset
from meshllm.bench.http import Endpoint
from meshllm.bench.load import Level, LevelRun, run_level, run_trace, stop_message, with_rate
from meshllm.bench.output import format_level, format_table, plot, write_csv, write_json
from meshllm.bench.prompts import PromptBuilder, resolve_tokenizer
from meshllm.bench.replay import ReplayMode, ReplayResult
from meshllm.bench.report import LevelResult
from meshllm.bench.sender import HttpSender, one_request
from meshllm.bench.slo import parse_slo
from meshllm.bench.trace import TraceScale, load_trace, trace_stats
from meshllm.bench.workload import BenchRequest, Workload, WorkloadSpec
from meshllm.config import EnvArgumentParser

__all__ = ["HttpSender", "bench_arg_parser", "main", "one_request", "run_level", "run_trace"]

DEFAULT_LEVELS = "1,8,32,64"
ISL_TOLERANCE = 0.02  # warn when the server counts prompts further than this from the intended length


def _numbers(value: str, flag: str, kind: type[int] | type[float]) -> list[float]:
    try:
        levels = [kind(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} {value!r} is not a comma-separated list of numbers") from None
    if not levels or any(not c > 0 for c in levels):
        raise ValueError(f"{flag} values must be > 0")
    return levels


def _levels(ns: argparse.Namespace) -> list[Level]:
    if ns.request_rate is None:
        return [Level(concurrency=int(c)) for c in _numbers(ns.concurrency or DEFAULT_LEVELS, "--concurrency", int)]
    cap = None
    if ns.concurrency is not None:
        caps = _numbers(ns.concurrency, "--concurrency", int)
        if len(caps) > 1:
            raise ValueError("with --request-rate, --concurrency is one number: the most requests in flight")
        cap = int(caps[0])
    return [Level(request_rate=r, max_in_flight=cap) for r in _numbers(ns.request_rate, "--request-rate", float)]


# size: a flat list of flags, one add_argument after another
def bench_arg_parser(*, env: dict[str, str] | None = None) -> EnvArgumentParser:
    p = EnvArgumentParser(
        prog="meshllm bench", env=os.environ if env is None else env, description="load generator for OpenAI endpoints"
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="endpoint base URL (with or without /v1)")
    p.add_argument("--model", required=True, help="model name to request")
    p.add_argument("--api", choices=["chat", "completions"], default="chat", help="which API to load")
    p.add_argument("--api-key", default=None, help="bearer token, if the endpoint wants one")
    p.add_argument("--concurrency", default=None,
                   help=f"comma-separated concurrency levels ({DEFAULT_LEVELS} when not given); "
                        "with --request-rate: the most requests in flight")  # fmt: skip
    p.add_argument("--request-rate", default=None,
                   help="comma-separated request rates (req/s, 'inf' = all at once): Poisson arrivals, seeded")  # fmt: skip
    p.add_argument("--burstiness", type=float, default=1.0, help="arrival gaps are gamma(burstiness): 1 = Poisson")
    p.add_argument("--requests", type=int, default=256, help="requests per level")
    p.add_argument("--warmup", type=int, default=0, help="unrecorded requests before each level")
    p.add_argument("--isl", type=int, default=600, help="mean input length (tokens)")
    p.add_argument("--isl-spread", type=int, default=0, help="input length varies uniformly by ± this")
    p.add_argument("--osl", type=int, default=150, help="mean output length (tokens)")
    p.add_argument("--osl-spread", type=int, default=0, help="output length varies uniformly by ± this")
    p.add_argument("--prefix-len", type=int, default=0, help="tokens of shared prefix at the start of every prompt")
    p.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes")
    p.add_argument("--tokenizer", default=None,
                   help="count prompt tokens with this: a model directory, a .gguf file, builtin:NAME or none "
                        "(default: found from --model)")  # fmt: skip
    p.add_argument("--chars-per-token", type=float, default=None,
                   help="set prompt lengths in characters instead (1 = byte tokenizer, ~4 = BPE; approximate)")  # fmt: skip
    p.add_argument("--dataset", default=None, help="ShareGPT-style JSONL (conversations / messages / prompt per line)")
    p.add_argument("--no-ignore-eos", action="store_true", help="let the model stop at EOS (outputs may be shorter)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature sent with each request")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft=200,itl=50 (also tpot, e2e)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take before it counts as an error")
    p.add_argument("--json", default=None, help="write the results as JSON to this path ('-' = stdout)")
    p.add_argument("--csv", default=None, help="write one CSV row per level to this path ('-' = stdout)")
    p.add_argument("--plot", default=None, help="write throughput/latency plots to this PNG (needs matplotlib)")
    p.add_argument("--progress", action="store_true", help="show progress even when stderr is not a terminal")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    t = p.add_argument_group("trace replay (--trace; --concurrency applies to closed mode, --seed to the token runs)")
    t.add_argument("--trace", default=None, help="replay this Mooncake JSONL trace through /v1/completions")
    modes = [m.value for m in ReplayMode]
    t.add_argument("--trace-mode", choices=modes, default="open", help="open: at the timestamps; closed: --concurrency users")
    t.add_argument("--trace-tokens-per-block", type=int, default=16, help="tokens each hash id becomes (the trace's are 512)")
    t.add_argument("--trace-speedup", type=float, default=1.0, help="divide arrival times by this")
    t.add_argument("--trace-limit", type=int, default=None, help="replay only the first N rows (after the window)")
    t.add_argument("--trace-start", type=float, default=0.0, help="window start, trace seconds")
    t.add_argument("--trace-duration", type=float, default=None, help="window length, trace seconds (default: to the end)")
    t.add_argument("--trace-max-isl", type=int, default=None, help="cap on the scaled prompt length (tokens)")
    t.add_argument("--trace-max-osl", type=int, default=None, help="cap on the output length (tokens)")
    t.add_argument("--trace-token-offset", type=int, default=1000, help="lowest token id used (keeps clear of special tokens)")
    t.add_argument("--trace-vocab-size", type=int, default=32000, help="token ids stay below this")
    t.add_argument("--trace-deadline", type=float, default=3600.0, help="seconds a replay may take in all (0 = no limit)")
    return p


def _fail(message: str, code: int = 2) -> int:
    print(f"meshllm bench: error: {message}", file=sys.stderr)
    return code


def _show_progress(ns: argparse.Namespace) -> bool:
    return not ns.quiet and (ns.progress or sys.stderr.isatty())


def _check_plot(ns: argparse.Namespace) -> None:
    if ns.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)")


def _prompts(ns: argparse.Namespace, spec: WorkloadSpec) -> tuple[PromptBuilder | None, str]:
    """The prompt builder (None: lengths in characters) and the line saying how prompt lengths are set."""
    if ns.chars_per_token is not None:
        if ns.tokenizer is not None:
            raise ValueError("--chars-per-token and --tokenizer exclude each other")
        return None, f"prompts: lengths in characters, {spec.chars_per_token:g} per token (approximate)"
    tok, where = resolve_tokenizer(ns.tokenizer, ns.model)
    if tok is None:
        if where != "none":
            print(f"meshllm bench: note: no tokenizer for model {ns.model!r}: prompt lengths are approximate "
                  "(4 characters per token); pass --tokenizer DIR|FILE.gguf|builtin:NAME for exact ones",
                  file=sys.stderr)  # fmt: skip
        return None, f"prompts: lengths in characters, {spec.chars_per_token:g} per token (approximate)"
    builder = PromptBuilder(tok, api=ns.api, seed=ns.seed)
    if not ns.dataset and spec.isl - spec.isl_spread <= builder.overhead:
        raise ValueError(
            f"--isl {spec.isl} (- --isl-spread {spec.isl_spread}) leaves no room for content: the chat template "
            f"alone is {builder.overhead} tokens"
        )
    template = f", chat template {builder.overhead} tokens" if ns.api == "chat" and builder.template else ""
    return builder, f"prompts: exact token lengths with the tokenizer {where}{template}"


def _requests(ns: argparse.Namespace, spec: WorkloadSpec, builder: PromptBuilder | None, needed: int) -> Iterator[BenchRequest]:
    """The endless stream of requests every level draws from, in order (`needed`: how many the run takes)."""
    if ns.dataset:
        yield from dataset_requests(load_dataset(ns.dataset, limit=needed), spec, builder)
    workload = Workload(spec, builder)
    while True:
        yield workload.next()


def main(argv: Sequence[str]) -> int:
    ns = bench_arg_parser().parse_args(list(argv))
    if ns.trace:
        return _trace_main(ns)
    try:
        levels = _levels(ns)
        if ns.requests < 1 or ns.warmup < 0:
            raise ValueError("--requests must be >= 1 and --warmup >= 0")
        if not ns.burstiness > 0:
            raise ValueError("--burstiness must be > 0")
        slo = parse_slo(ns.slo) if ns.slo else None
        chars = ns.chars_per_token if ns.chars_per_token is not None else 4.0
        spec = WorkloadSpec(
            model=ns.model, api=ns.api, isl=ns.isl, isl_spread=ns.isl_spread, osl=ns.osl, osl_spread=ns.osl_spread,
            prefix_len=ns.prefix_len, num_prefixes=ns.num_prefixes, chars_per_token=chars,
            ignore_eos=not ns.no_ignore_eos, temperature=ns.temperature, seed=ns.seed,
        )  # fmt: skip
        endpoint = Endpoint.parse(ns.url, ns.api_key)
        _check_plot(ns)
        builder, how = _prompts(ns, spec)
        stream = _requests(ns, spec, builder, len(levels) * (ns.warmup + ns.requests))
        plans = []
        for i, level in enumerate(levels):
            warmup = [next(stream) for _ in range(ns.warmup)]
            reqs = with_rate([next(stream) for _ in range(ns.requests)], level, ns.seed + i, ns.burstiness)
            plans.append((level, warmup, reqs))
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    import uvloop

    runs: list[LevelRun] = []
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        for level, warmup, reqs in plans:
            job = run_level(
                endpoint, ns.model, reqs, level, warmup=warmup, progress=_show_progress(ns), timeout_s=ns.timeout,
                slo=slo,
            )  # fmt: skip
            runs.append(runner.run(job))
            if runs[-1].replay.stopped:
                break
    results = [r.summary for r in runs]
    _report_levels(ns, runs, how)
    if runs and (stopped := runs[-1].replay).stopped:
        return _fail(stop_message(stopped, ns.url), 1)
    return 1 if any(r.errors for r in results) else 0


def _report_levels(ns: argparse.Namespace, runs: Sequence[LevelRun], how: str) -> None:
    """Each level's figures on stdout (unless JSON or CSV goes there), then --json, --csv and --plot."""
    results = [r.summary for r in runs]
    if ns.json != "-" and ns.csv != "-":
        print(how)
        shown = [r for r in results if r.completed or r.errors < r.requests]  # not a level that never reached the server
        for r in shown:
            print(format_level(r))
        if len(shown) > 1:
            print(format_table(shown))
    rows = [{**r.summary.to_dict(), "stopped": r.replay.stopped} for r in runs]
    if ns.json:
        write_json(rows, ns.json)
    if ns.csv:
        write_csv(rows, ns.csv)
    if ns.plot:
        plot(results, ns.plot)
    _warn_isl(results)


def _warn_isl(results: Sequence[LevelResult]) -> None:
    worst = max((r.isl_max_deviation for r in results if not math.isnan(r.isl_max_deviation)), default=0.0)
    if worst > ISL_TOLERANCE:
        print(f"meshllm bench: warning: the server counted prompt lengths up to {worst:.0%} off the lengths built: "
              "it tokenizes differently; pass the model's own --tokenizer", file=sys.stderr)  # fmt: skip


def _trace_main(ns: argparse.Namespace) -> int:
    """`meshllm bench --trace`: load and scale the trace, replay it (once open loop, per level closed loop), report."""
    try:
        scale = TraceScale(
            tokens_per_block=ns.trace_tokens_per_block, speedup=ns.trace_speedup, limit=ns.trace_limit,
            start_s=ns.trace_start, duration_s=ns.trace_duration, max_isl=ns.trace_max_isl, max_osl=ns.trace_max_osl,
            token_offset=ns.trace_token_offset, vocab_size=ns.trace_vocab_size, seed=ns.seed,
        )  # fmt: skip
        mode = ReplayMode(ns.trace_mode)
        if ns.request_rate is not None or ns.dataset:
            raise ValueError("--trace sets the requests and their arrivals: drop --request-rate / --dataset")
        levels = [int(c) for c in _numbers(ns.concurrency or DEFAULT_LEVELS, "--concurrency", int)]
        levels = levels if mode is ReplayMode.CLOSED else [1]
        slo = parse_slo(ns.slo) if ns.slo else None
        endpoint = Endpoint.parse(ns.url, ns.api_key)
        _check_plot(ns)
        requests = load_trace(ns.trace, scale)
        if not requests:
            raise ValueError(f"--trace {ns.trace}: no rows in the selected window")
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    stats = trace_stats(requests)
    header = f"{os.path.basename(ns.trace)}: {stats.describe()}\n{scale.describe()}"
    to_stdout = ns.json != "-" and ns.csv != "-"
    if to_stdout:
        print(header)
    import uvloop

    deadline = ns.trace_deadline or None
    results: list[ReplayResult] = []
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        for c in levels:
            job = run_trace(
                endpoint, ns.model, requests, mode=mode, concurrency=c, ignore_eos=not ns.no_ignore_eos,
                temperature=ns.temperature, timeout_s=ns.timeout, deadline_s=deadline, progress=_show_progress(ns),
            )  # fmt: skip
            results.append(runner.run(job))
            if results[-1].stopped:
                break
    summaries = [r.summary(slo=slo) for r in results]
    _report_trace(ns, results, summaries, {"trace": ns.trace, "scale": scale.describe(), "stats": stats.describe()})
    if results and results[-1].stopped:
        return _fail(stop_message(results[-1], ns.url), 1)
    return 1 if any(s.errors for s in summaries) else 0


def _report_trace(
    ns: argparse.Namespace, results: Sequence[ReplayResult], summaries: Sequence[LevelResult], about: dict[str, Any]
) -> None:
    """The replays' figures on stdout (unless JSON or CSV goes there), then --json (with `about`), --csv and --plot."""
    if ns.json != "-" and ns.csv != "-":
        for s in summaries:
            print(format_level(s))
        print(format_table(summaries))
        for r in results:
            print(f"  c={r.concurrency}: {r.describe()}" if len(results) > 1 else r.describe())
    runs = [
        {**s.to_dict(), "mode": r.mode.value, "ttft_p90_ms": r.ttft_ms(90), "e2e_p90_ms": r.e2e_ms(90),
         "cached_tokens": r.cached_tokens, "hit_rate": r.hit_rate, "max_lag_s": r.max_lag_s, "stopped": r.stopped}
        for r, s in zip(results, summaries, strict=True)
    ]  # fmt: skip
    if ns.json:
        write_json({**about, "runs": runs}, ns.json)
    if ns.csv:
        write_csv(runs, ns.csv)
    if ns.plot:
        plot(list(summaries), ns.plot)

"""`meshllm bench`: a load generator for any OpenAI-compatible endpoint.

    meshllm bench --url http://127.0.0.1:8000 --model mocker --concurrency 1,8,32,64 --requests 256 \\
                  --isl 600 --isl-spread 200 --osl 150 --osl-spread 25 [--json out.json] [--plot out.png]
    meshllm bench --url ... --model mocker --trace conversation_trace.jsonl --trace-tokens-per-block 16 \\
                  --trace-speedup 10 --trace-limit 500 --trace-max-osl 32 [--trace-mode closed --concurrency 8]

For each concurrency level, that many simulated users each hold one
keep-alive connection and send streaming requests back to back until the
level's requests are done. A progress bar goes to stderr, the results table
to stdout (see `meshllm.bench.report` for the definitions). With `--trace`,
the requests are a scaled Mooncake trace (`meshllm.bench.trace`) replayed
open loop or closed loop (`meshllm.bench.replay`) through /v1/completions.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
import time
from collections.abc import Sequence

import orjson

from meshllm.bench.http import Connection, Endpoint, HttpError
from meshllm.bench.replay import ReplayMode, ReplayResult, replay
from meshllm.bench.report import LevelResult, RequestRecord, format_table, plot, summarize
from meshllm.bench.trace import TraceRequest, TraceScale, load_trace, trace_stats
from meshllm.bench.workload import BenchRequest, Workload, WorkloadSpec
from meshllm.config import EnvArgumentParser

__all__ = ["HttpSender", "bench_arg_parser", "main", "run_bench", "run_level", "run_trace"]


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, label: str, total: int, *, enabled: bool = True) -> None:
        self.label, self.total, self.done = label, total, 0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._last_pct = -1

    def tick(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty and (now - self._last >= 0.1 or self.done == self.total):
            self._last = now
            width = 30
            filled = int(width * self.done / self.total)
            rate = self.done / max(now - self.t0, 1e-9)
            bar = "█" * filled + "░" * (width - filled)
            sys.stderr.write(f"\r{self.label} {bar} {self.done}/{self.total}  {rate:6.1f} req/s")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif not self.tty and (pct := 10 * self.done // self.total) != self._last_pct:
            self._last_pct = pct
            sys.stderr.write(f"{self.label} {self.done}/{self.total}\n")
            sys.stderr.flush()


async def one_request(conn: Connection, req: BenchRequest, timeout_s: float = 600.0) -> RequestRecord:
    """Send one streaming request and time its events."""
    rec = RequestRecord()
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            await _exchange(conn, req, rec, t0)
    except TimeoutError:
        rec.error = f"timed out after {timeout_s:g}s"
        await conn.close()
    except (HttpError, ValueError, orjson.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.e2e = time.perf_counter() - t0
    return rec


async def _exchange(conn: Connection, req: BenchRequest, rec: RequestRecord, t0: float) -> None:
    last = 0.0
    loads = orjson.loads
    resp = await conn.post(req.path, req.body)
    if resp.status != 200:
        body = await resp.read()
        rec.error = f"HTTP {resp.status}: {body[:300].decode(errors='replace')}"
        return
    events = 0
    async for data in resp.events():
        if data == b"[DONE]":
            continue
        obj = loads(data)
        if "error" in obj:
            rec.error = f"stream error: {obj['error'].get('message', obj['error'])}"
            continue
        choices = obj.get("choices")
        if choices:
            c = choices[0]
            delta = c.get("delta")
            text = delta.get("content") if delta is not None else c.get("text")
            if text:
                now = time.perf_counter()
                if rec.ttft is None:
                    rec.ttft = now - t0
                else:
                    rec.gaps.append(now - last)
                last = now
                events += 1
        usage = obj.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens", 0)
            rec.completion_tokens = usage.get("completion_tokens", 0)
            if (details := usage.get("prompt_tokens_details")) and "cached_tokens" in details:
                rec.cached_tokens = details["cached_tokens"]
    rec.events = events
    if not rec.completion_tokens:
        rec.completion_tokens = events


async def run_level(
    endpoint: Endpoint,
    workload: Workload,
    concurrency: int,
    n_requests: int,
    *,
    progress: bool = True,
    timeout_s: float = 600.0,
) -> LevelResult:
    """Send `n_requests` with `concurrency` users; return the level's summary."""
    reqs = [workload.next() for _ in range(n_requests)]
    records: list[RequestRecord] = []
    bar = Progress(f"c={concurrency:<4}", n_requests, enabled=progress)
    next_index = iter(range(n_requests))

    async def user() -> None:
        conn = Connection(endpoint)
        try:
            for i in next_index:
                records.append(await one_request(conn, reqs[i], timeout_s))
                bar.tick()
        finally:
            await conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(min(concurrency, n_requests))))
    return summarize(concurrency, records, time.perf_counter() - t0)


async def run_bench(
    endpoint: Endpoint,
    spec: WorkloadSpec,
    levels: Sequence[int],
    n_requests: int,
    *,
    warmup: int = 0,
    progress: bool = True,
    timeout_s: float = 600.0,
) -> list[LevelResult]:
    """Every concurrency level in turn, each after `warmup` unrecorded requests."""
    workload = Workload(spec)
    results = []
    for c in levels:
        if warmup:
            await run_level(endpoint, workload, c, warmup, progress=False, timeout_s=timeout_s)
        results.append(await run_level(endpoint, workload, c, n_requests, progress=progress, timeout_s=timeout_s))
    return results


class HttpSender:
    """Sends trace requests to an OpenAI endpoint: POST /v1/completions, `prompt` = the token ids, streaming.

    `max_tokens` is the request's output length, with `ignore_eos` (as for
    the synthetic workload) unless `ignore_eos=False`; the record carries the
    usage's `prompt_tokens_details.cached_tokens` when the endpoint sends it.
    Keep-alive connections are pooled, so overlapping requests each get one.
    A replay `Send`; `aclose()` closes the pool.
    """

    def __init__(
        self, endpoint: Endpoint, model: str, *, ignore_eos: bool = True, temperature: float | None = None,
        timeout_s: float = 600.0,
    ) -> None:  # fmt: skip
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self._fields: dict[str, object] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
        if ignore_eos:
            self._fields["ignore_eos"] = True
        if temperature is not None:
            self._fields["temperature"] = temperature
        self._idle: list[Connection] = []

    def request(self, req: TraceRequest) -> BenchRequest:
        body = orjson.dumps({**self._fields, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens})
        return BenchRequest("/completions", body, req.max_tokens)

    async def __call__(self, req: TraceRequest) -> RequestRecord:
        conn = self._idle.pop() if self._idle else Connection(self.endpoint)
        try:
            rec = await one_request(conn, self.request(req), self.timeout_s)
        except BaseException:  # cancelled mid-stream: the connection is in an unknown state
            await conn.close()
            raise
        self._idle.append(conn)
        return rec

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()


async def run_trace(
    endpoint: Endpoint,
    model: str,
    requests: Sequence[TraceRequest],
    *,
    mode: ReplayMode = ReplayMode.OPEN,
    concurrency: int = 1,
    ignore_eos: bool = True,
    temperature: float | None = None,
    timeout_s: float = 600.0,
    deadline_s: float | None = 3600.0,
    progress: bool = True,
) -> ReplayResult:
    """Replay trace requests against an OpenAI endpoint (see `HttpSender` and `meshllm.bench.replay.replay`)."""
    sender = HttpSender(endpoint, model, ignore_eos=ignore_eos, temperature=temperature, timeout_s=timeout_s)
    label = f"{mode.value:<6}" if mode is ReplayMode.OPEN else f"c={concurrency:<4}"
    bar = Progress(label, len(requests), enabled=progress)
    try:
        result = await replay(
            requests, sender, mode=mode, concurrency=concurrency, deadline_s=deadline_s, on_done=lambda _: bar.tick()
        )
    finally:
        await sender.aclose()
    if bar.enabled and bar.tty and bar.done < bar.total:
        sys.stderr.write("\n")  # a stopped run leaves its bar unfinished
    return result


def _levels(value: str) -> list[int]:
    try:
        levels = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {value!r} is not a comma-separated list of integers") from None
    if not levels or any(c < 1 for c in levels):
        raise ValueError("--concurrency levels must be >= 1")
    return levels


def write_json(doc: object, target: str) -> None:
    """`--json` output: indented JSON to stdout ("-") or to a file."""
    data = orjson.dumps(doc, option=orjson.OPT_INDENT_2)
    if target == "-":
        sys.stdout.write(data.decode() + "\n")
    else:
        with open(target, "wb") as f:
            f.write(data)


def bench_arg_parser(*, env: dict[str, str] | None = None) -> EnvArgumentParser:
    p = EnvArgumentParser(
        prog="meshllm bench", env=os.environ if env is None else env, description="load generator for OpenAI endpoints"
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="endpoint base URL (with or without /v1)")
    p.add_argument("--model", required=True, help="model name to request")
    p.add_argument("--api", choices=["chat", "completions"], default="chat", help="which API to load")
    p.add_argument("--api-key", default=None, help="bearer token, if the endpoint wants one")
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=256, help="requests per concurrency level")
    p.add_argument("--warmup", type=int, default=0, help="unrecorded requests before each level")
    p.add_argument("--isl", type=int, default=600, help="mean input length (tokens)")
    p.add_argument("--isl-spread", type=int, default=0, help="input length varies uniformly by ± this")
    p.add_argument("--osl", type=int, default=150, help="mean output length (tokens)")
    p.add_argument("--osl-spread", type=int, default=0, help="output length varies uniformly by ± this")
    p.add_argument("--prefix-len", type=int, default=0, help="tokens of shared prefix at the start of every prompt")
    p.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes")
    p.add_argument("--chars-per-token", type=float, default=1.0, help="prompt characters per token (1 = byte tokenizer)")
    p.add_argument("--no-ignore-eos", action="store_true", help="let the model stop at EOS (outputs may be shorter)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature sent with each request")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take before it counts as an error")
    p.add_argument("--json", default=None, help="write the results as JSON to this path ('-' = stdout)")
    p.add_argument("--plot", default=None, help="write throughput/latency plots to this PNG (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
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


def main(argv: Sequence[str]) -> int:
    ns = bench_arg_parser().parse_args(list(argv))
    if ns.trace:
        return _trace_main(ns)
    try:
        levels = _levels(ns.concurrency)
        if ns.requests < 1:
            raise ValueError("--requests must be >= 1")
        spec = WorkloadSpec(
            model=ns.model, api=ns.api, isl=ns.isl, isl_spread=ns.isl_spread, osl=ns.osl, osl_spread=ns.osl_spread,
            prefix_len=ns.prefix_len, num_prefixes=ns.num_prefixes, chars_per_token=ns.chars_per_token,
            ignore_eos=not ns.no_ignore_eos, temperature=ns.temperature, seed=ns.seed,
        )  # fmt: skip
        endpoint = Endpoint.parse(ns.url, ns.api_key)
    except ValueError as exc:
        print(f"meshllm bench: error: {exc}", file=sys.stderr)
        return 2
    if ns.plot and importlib.util.find_spec("matplotlib") is None:
        print("meshllm bench: error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        job = run_bench(endpoint, spec, levels, ns.requests, warmup=ns.warmup, progress=not ns.quiet, timeout_s=ns.timeout)
        results = runner.run(job)
    if ns.json != "-":
        print(format_table(results))
    if ns.json:
        write_json([r.to_dict() for r in results], ns.json)
    if ns.plot:
        plot(results, ns.plot)
    return 1 if any(r.errors for r in results) else 0


def _trace_main(ns: argparse.Namespace) -> int:
    """`meshllm bench --trace`: load and scale the trace, replay it (once open loop, per level closed loop), report."""
    try:
        scale = TraceScale(
            tokens_per_block=ns.trace_tokens_per_block, speedup=ns.trace_speedup, limit=ns.trace_limit,
            start_s=ns.trace_start, duration_s=ns.trace_duration, max_isl=ns.trace_max_isl, max_osl=ns.trace_max_osl,
            token_offset=ns.trace_token_offset, vocab_size=ns.trace_vocab_size, seed=ns.seed,
        )  # fmt: skip
        mode = ReplayMode(ns.trace_mode)
        levels = _levels(ns.concurrency) if mode is ReplayMode.CLOSED else [1]
        endpoint = Endpoint.parse(ns.url, ns.api_key)
        requests = load_trace(ns.trace, scale)
        if not requests:
            raise ValueError(f"--trace {ns.trace}: no rows in the selected window")
    except (ValueError, OSError) as exc:
        print(f"meshllm bench: error: {exc}", file=sys.stderr)
        return 2
    if ns.plot and importlib.util.find_spec("matplotlib") is None:
        print("meshllm bench: error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    stats = trace_stats(requests)
    header = f"{os.path.basename(ns.trace)}: {stats.describe()}\n{scale.describe()}"
    if ns.json != "-":
        print(header)
    import uvloop

    deadline = ns.trace_deadline or None
    results: list[ReplayResult] = []
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        for c in levels:
            job = run_trace(
                endpoint, ns.model, requests, mode=mode, concurrency=c, ignore_eos=not ns.no_ignore_eos,
                temperature=ns.temperature, timeout_s=ns.timeout, deadline_s=deadline, progress=not ns.quiet,
            )  # fmt: skip
            results.append(runner.run(job))
    summaries = [r.summary() for r in results]
    if ns.json != "-":
        print(format_table(summaries))
        for r in results:
            print(f"  c={r.concurrency}: {r.describe()}" if len(results) > 1 else r.describe())
    if ns.json:
        runs = [
            {**s.to_dict(), "mode": r.mode.value, "ttft_p90_ms": r.ttft_ms(90), "e2e_p90_ms": r.e2e_ms(90),
             "cached_tokens": r.cached_tokens, "hit_rate": r.hit_rate, "max_lag_s": r.max_lag_s,
             "stopped": r.stopped}
            for r, s in zip(results, summaries, strict=True)
        ]  # fmt: skip
        doc = {"trace": ns.trace, "scale": scale.describe(), "stats": stats.describe(), "runs": runs}
        write_json(doc, ns.json)
    if ns.plot:
        plot(summaries, ns.plot)
    return 1 if any(s.errors for s in summaries) or any(r.stopped for r in results) else 0

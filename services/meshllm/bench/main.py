"""`meshllm bench`: a load generator for any OpenAI-compatible endpoint.

    meshllm bench --url http://127.0.0.1:8000 --model mocker --concurrency 1,8,32,64 --requests 256 \\
                  --isl 600 --isl-spread 200 --osl 150 --osl-spread 25 [--json out.json] [--plot out.png]

For each concurrency level, that many simulated users each hold one
keep-alive connection and send streaming requests back to back until the
level's requests are done. A progress bar goes to stderr, the results table
to stdout (see `meshllm.bench.report` for the definitions).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
from collections.abc import Sequence

import orjson

from meshllm.bench.http import Connection, Endpoint, HttpError
from meshllm.bench.report import LevelResult, RequestRecord, format_table, plot, summarize
from meshllm.bench.workload import BenchRequest, Workload, WorkloadSpec
from meshllm.config import EnvArgumentParser

__all__ = ["bench_arg_parser", "main", "run_bench", "run_level"]


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


def _levels(value: str) -> list[int]:
    try:
        levels = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {value!r} is not a comma-separated list of integers") from None
    if not levels or any(c < 1 for c in levels):
        raise ValueError("--concurrency levels must be >= 1")
    return levels


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
    return p


def main(argv: Sequence[str]) -> int:
    ns = bench_arg_parser().parse_args(list(argv))
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
        data = orjson.dumps([r.to_dict() for r in results], option=orjson.OPT_INDENT_2)
        if ns.json == "-":
            sys.stdout.write(data.decode() + "\n")
        else:
            with open(ns.json, "wb") as f:
                f.write(data)
    if ns.plot:
        plot(results, ns.plot)
    return 1 if any(r.errors for r in results) else 0

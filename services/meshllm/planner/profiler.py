"""`meshllm planner profile`: measure one worker of an engine, through the mesh, and write its profile.

    meshllm planner profile --engine mocker --out profile.json [-- ENGINE FLAGS...]
    meshllm planner profile --url http://host:8000 --engine llamacpp --out profile.json   # a mesh already running

Without `--url` it starts `meshllm run --workers 1 --prefill-workers 1 --engine ENGINE -- ENGINE FLAGS` (with
`--mode agg`: one aggregated worker) on a free port and stops it afterwards; with `--url` the endpoint must serve
one worker of each role, as the figures are per worker. Profile in the layout the planner will scale: a
disaggregated TTFT includes the decode worker's first step and the KV handoff. Latency is measured where the
planner reads it, at the frontend, so the mesh's own cost is in the profile:

- prefill: for each `--isl`, requests one at a time with one output token: the median TTFT is the service time
  of one prompt (the planner adds queueing at the planned utilisation), and isl / TTFT its rate;
- decode: for each `--context` and `--concurrency`, that many streams at once (closed loop), `--osl` tokens each:
  the p90 of the gaps between tokens is the ITL, and the output tokens over the level's duration the worker's
  tokens/s. Measured, not concurrency / gap: streams an engine queues (beyond its batch) add nothing, and the
  prompts' prefill is in the duration (a long `--osl` keeps it a small share).

Prompts are random words (no shared prefix: a cached prefix would flatter prefill); the ISL and context
recorded are the prompt tokens the server counted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import IO

import orjson

from meshllm.bench.http import Connection, Endpoint, HttpError
from meshllm.bench.load import Level, run_level
from meshllm.bench.prompts import PromptBuilder, resolve_tokenizer
from meshllm.bench.record import RequestRecord
from meshllm.bench.workload import Workload, WorkloadSpec
from meshllm.config import ConfigError, EnvArgumentParser
from meshllm.flags import split_engine_args
from meshllm.planner.profile import DecodePoint, PrefillPoint, Profile
from meshllm.ports import free_port

__all__ = ["ProfilePlan", "ProfileRun", "main", "measure", "profile_arg_parser", "profile_plan"]

READY_S = 180.0


@dataclass(frozen=True, slots=True)
class ProfilePlan:
    isls: tuple[int, ...]
    contexts: tuple[int, ...]
    concurrencies: tuple[int, ...]
    osl: int
    requests: int  # per prefill point; per decode point, `requests` per stream

    def __post_init__(self) -> None:
        if not (self.isls and self.contexts and self.concurrencies):
            raise ConfigError("--isl, --context and --concurrency each need at least one value")
        if min(self.isls + self.contexts + self.concurrencies) < 1 or self.osl < 2 or self.requests < 1:
            raise ConfigError("--isl, --context and --concurrency must be ≥ 1, --osl ≥ 2, --requests ≥ 1")


async def _records(
    endpoint: Endpoint, model: str, spec: WorkloadSpec, n: int, concurrency: int, builder: PromptBuilder | None
) -> tuple[list[RequestRecord], float]:
    """The level's records (all must succeed) and how long it ran."""
    workload = Workload(spec if builder is not None else dataclasses.replace(spec, chars_per_token=4.0), builder)
    requests = [workload.next() for _ in range(n)]
    warmup = [workload.next() for _ in range(concurrency)]
    run = await run_level(endpoint, model, requests, Level(concurrency=concurrency), warmup=warmup, progress=False)
    records = [r for r in run.replay.records if r.error is None]
    if len(records) < n:
        errors = sorted({r.error or "" for r in run.replay.records if r.error is not None})
        raise ConfigError(f"profile: {n - len(records)} of {n} requests failed: {'; '.join(errors)[:300]}")
    return records, run.replay.duration_s


def prompt_builder(run: ProfileRun, model: str) -> tuple[PromptBuilder | None, str]:
    """Prompts of exact token counts with the model's tokenizer (`--tokenizer`, else the engine's `--model-path`,
    else found from the served model's name, as `meshllm bench` finds it), or None: lengths in characters, 4 a
    token. Either way the rows record the prompt tokens the server counted."""
    source: str | None = run.tokenizer or _model_path(run.engine_args)
    try:
        tok, where = resolve_tokenizer(source, model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if tok is None:
        return None, f"prompt lengths in characters, 4 a token (approximate; tokenizer: {where})"
    return PromptBuilder(tok, api="completions"), f"prompt lengths counted with the tokenizer {where}"


def _model_path(engine_args: Sequence[str]) -> str | None:
    """The engine's `--model-path` (either spelling), if given."""
    for i, arg in enumerate(engine_args):
        if arg == "--model-path" and i + 1 < len(engine_args):
            return engine_args[i + 1]
        if arg.startswith("--model-path="):
            return arg.split("=", 1)[1]
    return None


async def measure(
    endpoint: Endpoint, model: str, plan: ProfilePlan, *, say: bool = True, builder: PromptBuilder | None = None
) -> tuple[list, list]:
    """The prefill and decode rows of one worker behind `endpoint`."""
    prefill: list[PrefillPoint] = []
    for isl in plan.isls:
        spec = WorkloadSpec(model=model, api="completions", isl=isl, osl=1, seed=isl)
        recs, _ = await _records(endpoint, model, spec, plan.requests, 1, builder)
        ttft = statistics.median(r.ttft for r in recs if r.ttft is not None)
        counted = round(statistics.mean(r.prompt_tokens for r in recs)) or isl
        prefill.append(PrefillPoint(counted, ttft, counted / ttft))
        if say:
            print(f"  prefill isl {counted}: ttft {ttft * 1e3:.1f} ms, {counted / ttft:,.0f} tok/s", flush=True)
    decode: list[DecodePoint] = []
    for context in plan.contexts:
        for c in plan.concurrencies:
            spec = WorkloadSpec(model=model, api="completions", isl=context, osl=plan.osl, seed=context * 1000 + c)
            recs, duration_s = await _records(endpoint, model, spec, plan.requests * c, c, builder)
            gaps = sorted(g for r in recs for g in r.gaps)
            itl = gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))]
            rate = sum(r.completion_tokens for r in recs) / duration_s
            counted = round(statistics.mean(r.prompt_tokens for r in recs)) or context
            decode.append(DecodePoint(counted, c, itl, rate))
            if say:
                print(f"  decode context {counted} c={c}: itl p90 {itl * 1e3:.2f} ms, {rate:,.0f} tok/s", flush=True)
    return prefill, decode


@contextlib.asynccontextmanager
async def _embedded(engine: str, engine_args: Sequence[str], mode: str) -> AsyncIterator[str]:
    """`meshllm run` with one worker (`agg`) or one prefill and one decode worker (`disagg`) on a free port; its
    URL once it lists a model."""
    port = free_port()
    layout = ["--prefill-workers", "1"] if mode == "disagg" else []
    argv = ["-m", "meshllm", "run", "--workers", "1", *layout, "--engine", engine, "--http-port", str(port),
            "--max-inflight", "0", "--", *engine_args]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        proc = await asyncio.create_subprocess_exec(sys.executable, *argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.DEVNULL, stderr=log)  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            await _until_serving(url, proc, log)
            yield url
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 30)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()


async def _until_serving(url: str, proc: asyncio.subprocess.Process, log: IO[bytes]) -> None:
    conn = Connection(Endpoint.parse(url))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_S
    try:
        while loop.time() < deadline:
            if proc.returncode is not None:
                log.seek(0)
                tail = log.read()[-600:].decode(errors="replace").strip()
                raise ConfigError(f"profile: `meshllm run` exited ({proc.returncode}): {tail}")
            with contextlib.suppress(HttpError):
                resp = await conn.get("/v1/models")
                if resp.status == 200 and b'"id"' in await resp.read():
                    return
            await asyncio.sleep(0.2)  # the server's port opens at no signal we can await
    finally:
        await conn.close()
    raise ConfigError(f"profile: the mesh at {url} did not serve within {READY_S:g} s")


async def _model(url: str) -> str:
    conn = Connection(Endpoint.parse(url))
    try:
        resp = await conn.get("/v1/models")
        body = await resp.read()
    finally:
        await conn.close()
    data = orjson.loads(body).get("data") or []
    if not data:
        raise ConfigError(f"profile: {url}/v1/models lists no model")
    return str(data[0]["id"])


def _ints(value: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{flag} {value!r}: comma-separated whole numbers expected") from None


def profile_arg_parser(*, env: dict[str, str] | None = None) -> EnvArgumentParser:
    parser = EnvArgumentParser(
        prog="meshllm planner profile", env=os.environ if env is None else env,
        description="measure one worker of an engine through the mesh and write the planner's profile",
    )  # fmt: skip
    g = parser.add_argument_group("profile")
    g.add_argument("--engine", default="mocker", help="the engine to profile (and to start without --url)")
    g.add_argument("--mode", choices=("disagg", "agg"), default="disagg",
                   help="the layout started: one prefill and one decode worker, or one aggregated worker")  # fmt: skip
    g.add_argument("--url", default="", help="profile this running mesh (one worker of each role) instead of starting one")
    g.add_argument("--out", default="planner-profile.json", help="where the profile goes")
    g.add_argument("--isl", default="128,512,2048", help="prompt lengths of the prefill rows")
    g.add_argument("--context", default="256,1024", help="context lengths of the decode rows")
    g.add_argument("--concurrency", default="1,2,4,8,16", help="streams at once of the decode rows")
    g.add_argument("--osl", type=int, default=128, help="output tokens of each decode request")
    g.add_argument("--requests", type=int, default=8, help="requests per prefill row; per stream per decode row")
    g.add_argument("--tokenizer", default="",
                   help="count prompt lengths with this tokenizer (DIR, FILE.gguf, builtin:NAME; none: 4 characters a "
                        "token); default: the engine's --model-path, else found from the served model's name")  # fmt: skip
    return parser


@dataclass(frozen=True, slots=True)
class ProfileRun:
    """`meshllm planner profile`'s configuration."""

    engine: str
    url: str  # "" = start a mesh of one worker (of each role, disaggregated)
    out: str
    plan: ProfilePlan
    engine_args: tuple[str, ...] = ()
    mode: str = "disagg"
    tokenizer: str = ""  # "" = the engine's --model-path, else found from the model's name


def profile_plan(ns: argparse.Namespace, engine_args: Sequence[str] = ()) -> ProfileRun:
    plan = ProfilePlan(_ints(ns.isl, "--isl"), _ints(ns.context, "--context"), _ints(ns.concurrency, "--concurrency"),
                       ns.osl, ns.requests)  # fmt: skip
    return ProfileRun(ns.engine, ns.url, ns.out, plan, tuple(engine_args), ns.mode, ns.tokenizer)


async def profile(run: ProfileRun) -> Profile:
    async with contextlib.AsyncExitStack() as stack:
        url = run.url or await stack.enter_async_context(_embedded(run.engine, run.engine_args, run.mode))
        model = await _model(url)
        builder, how = prompt_builder(run, model)
        print(f"profiling {run.engine} ({model}) at {url}; {how}", flush=True)
        prefill, decode = await measure(Endpoint.parse(url), model, run.plan, builder=builder)
    host = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()}
    return Profile(run.engine, tuple(prefill), tuple(decode), engine_args=run.engine_args, host=host)


def main(argv: Sequence[str]) -> int:
    args, engine_args = split_engine_args(argv)
    ns = profile_arg_parser().parse_args(args)
    from meshllm.lifecycle import command_error, run_loop

    try:
        run = profile_plan(ns, engine_args)
        result = run_loop(profile(run))
        result.save(run.out)
    except ConfigError as exc:
        return command_error("planner profile", exc.message)
    except OSError as exc:
        return command_error("planner profile", f"cannot write {run.out}: {exc.strerror or exc}", 1)
    print(f"profile written to {run.out}")
    return 0

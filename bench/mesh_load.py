"""The load of bench/mesh.py: the issue-15 workload, `meshllm bench` in its own process, and the engines alone.

`meshllm bench` runs as a subprocess (`--json -`) so its CPU is not charged to any mesh process and its event
loop is not disturbed by the harness. The engines-alone runs drive mockers in this process through their
`LLMEngine` API with the very prompts the mesh would see: the same seeded workload, rendered with the model's chat
template and tokenized with its tokenizer. At concurrency 1 and speedup 1 that is the baseline of the mesh's
TTFT/ITL overhead; at a throughput level it is what the simulated engines give with no mesh in front of them.
"""

from __future__ import annotations

import asyncio
import math
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from meshllm.bench.report import percentile
from meshllm.bench.workload import Workload, WorkloadSpec
from meshllm.engine.base import Context
from meshllm.engine.mocker import MockerConfig, MockerEngine, StepReport
from meshllm.frontend.text.chat_template import chat_template_for
from meshllm.frontend.text.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Load", "calibrate_chars_per_token", "drive", "engine_alone", "engines_alone"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Load:
    """Streaming chat, input/output lengths uniform in mean ± spread, ignore_eos (issue 15's load)."""

    isl: int = 600
    isl_spread: int = 200
    osl: int = 150
    osl_spread: int = 25
    chars_per_token: float = 1.0

    def spec(self, model: str, seed: int) -> WorkloadSpec:
        return WorkloadSpec(
            model=model, isl=self.isl, isl_spread=self.isl_spread, osl=self.osl, osl_spread=self.osl_spread,
            chars_per_token=self.chars_per_token, seed=seed,
        )  # fmt: skip

    def describe(self) -> str:
        return (
            f"streaming chat, ISL {self.isl} ± {self.isl_spread}, OSL {self.osl} ± {self.osl_spread}, ignore_eos "
            f"(prompts of random words, {self.chars_per_token:.2f} characters per token)"
        )


def calibrate_chars_per_token(tok: Tokenizer, load: Load, samples: int = 64) -> float:
    """Characters per token of the workload's prompt text under `tok`, so that ISL counts real tokens."""
    workload = Workload(load.spec("calibration", seed=12345))
    chars = tokens = 0
    for _ in range(samples):
        text = orjson.loads(workload.next().body)["messages"][0]["content"]
        chars += len(text)
        tokens += len(tok.encode(text))
    return chars / max(tokens, 1)


async def drive(url: str, model: str, load: Load, concurrency: int, requests: int, seed: int) -> dict[str, Any]:
    """One `meshllm bench` level; its JSON row plus the load generator's own CPU seconds (`loadgen_cpu_s`)."""
    s = load.spec(model, seed)
    argv = [
        "-m", "meshllm", "bench", "--url", url, "--model", model, "--concurrency", str(concurrency),
        "--requests", str(requests), "--isl", str(s.isl), "--isl-spread", str(s.isl_spread), "--osl", str(s.osl),
        "--osl-spread", str(s.osl_spread), "--chars-per-token", repr(s.chars_per_token), "--seed", str(seed),
        "--timeout", "300", "--json", "-", "--quiet",
    ]  # fmt: skip
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await proc.communicate()
    except BaseException:  # cancelled (SIGTERM): the load must not outlive the benchmark
        proc.kill()
        await proc.wait()
        raise
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if not out.strip():
        raise RuntimeError(f"meshllm bench failed ({proc.returncode}): {err.decode(errors='replace')[-2000:]}")
    # JSON has no NaN: `meshllm bench --json` writes a figure it could not measure as null.
    row: dict[str, Any] = {k: math.nan if v is None else v for k, v in orjson.loads(out)[0].items()}
    if row.get("errors"):
        print(f"    meshllm bench: {row['errors']} failed request(s); {err.decode(errors='replace')[-300:]}", flush=True)
    row["loadgen_cpu_s"] = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    return row


def _prompt_ids(tok: Tokenizer, body: bytes) -> list[int]:
    template = chat_template_for(tok)
    messages = orjson.loads(body)["messages"]
    if template is None:
        return tok.encode(messages[0]["content"], add_special_tokens=True)
    return tok.encode(template.render(messages, add_generation_prompt=True), add_special_tokens=False)


async def engines_alone(
    model_path: Path,
    load: Load,
    *,
    speedup: float,
    engines: int,
    concurrency: int,
    requests: int,
    warmup: int,
    seed: int,
) -> dict[str, Any]:
    """`engines` mockers driven in this process through their `LLMEngine` API, closed loop: no HTTP, no gRPC.

    `concurrency` callers each send the next request as soon as their last one ended, round-robin over the
    engines, with the measured level's own prompts (seed `seed`; the warm-up uses other prompts, seed + 1).
    TTFT = `generate()` called → first chunk with tokens; ITL = gaps between chunks with tokens (as `meshllm
    bench` reports them). The row has `drive`'s keys, plus `model_busy`: the engines' simulated step time over
    the measured wall time, per engine (1.0 = each engine stepped all the time, on its model's timeline).
    """
    tok = await asyncio.to_thread(load_tokenizer, str(model_path))
    eos = tok.eos_token_ids[0] if tok.eos_token_ids else MockerConfig().eos_token_id
    config = MockerConfig(speedup_ratio=speedup, vocab_size=tok.vocab_size, eos_token_id=eos)
    mockers = [MockerEngine(config) for _ in range(engines)]
    model_ms = [0.0]

    def on_step(step: StepReport) -> None:
        model_ms[0] += step.model_ms

    for i, engine in enumerate(mockers):
        await engine.start(f"bench-engine-alone-{i}")
        engine.on_step = on_step
    ttfts: list[float] = []
    gaps: list[float] = []
    events = prompt_tokens = output_tokens = 0
    sent = 0

    async def one(ids: list[int], osl: int, record: bool) -> None:
        nonlocal events, prompt_tokens, output_tokens, sent
        rid = f"alone-{sent}"
        engine = mockers[sent % engines]
        sent += 1
        request = {"request_id": rid, "token_ids": ids, "stop": {"max_tokens": osl, "ignore_eos": True}}
        t0 = last = time.perf_counter()
        first = True
        async for chunk in engine.generate(request, Context(rid)):  # type: ignore[arg-type]
            if not chunk.get("token_ids"):
                continue
            now = time.perf_counter()
            if record:
                (ttfts if first else gaps).append(now - (t0 if first else last))
                events += 1
                output_tokens += len(chunk["token_ids"])
            first, last = False, now
        if record:
            prompt_tokens += len(ids)

    def prompts(phase_seed: int, n: int) -> list[tuple[list[int], int]]:
        """The level's (prompt ids, output length) pairs, tokenized before its clock starts; last one first."""
        workload = Workload(load.spec("engine", phase_seed))
        return [(_prompt_ids(tok, (r := workload.next()).body), r.osl) for _ in range(n)][::-1]

    async def level(todo: list[tuple[list[int], int]], record: bool) -> None:
        async def caller() -> None:
            while todo:
                ids, osl = todo.pop()
                await one(ids, osl, record)

        await asyncio.gather(*(caller() for _ in range(min(concurrency, len(todo)))))

    try:
        if warmup:
            await level(prompts(seed + 1, warmup), False)
        measured = prompts(seed, requests)
        model_ms[0] = 0.0
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        await level(measured, True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        for engine in mockers:
            await engine.cleanup()
    ms = 1000.0
    model_s = model_ms[0] / ms / speedup if speedup > 0 else math.nan
    return {
        "requests": requests, "errors": 0, "mean_isl": prompt_tokens / requests if requests else math.nan,
        "mean_osl": output_tokens / requests if requests else math.nan,
        "req_per_s": requests / wall, "output_tok_per_s": output_tokens / wall,
        "ttft_p50_ms": percentile(ttfts, 50) * ms, "ttft_p90_ms": percentile(ttfts, 90) * ms,
        "ttft_p99_ms": percentile(ttfts, 99) * ms, "itl_p50_ms": percentile(gaps, 50) * ms,
        "itl_p90_ms": percentile(gaps, 90) * ms, "itl_p99_ms": percentile(gaps, 99) * ms,
        "events_per_request": events / requests if requests else math.nan,
        "model_busy": model_s / engines / wall, "cpu_ms_per_request": cpu * ms / requests,
    }  # fmt: skip


async def engine_alone(model_path: Path, load: Load, requests: int, warmup: int, seed: int) -> dict[str, Any]:
    """One mocker at speedup 1, one request at a time: the baseline of the overhead at concurrency 1."""
    return await engines_alone(
        model_path, load, speedup=1.0, engines=1, concurrency=1, requests=requests, warmup=warmup, seed=seed
    )

"""The load of bench/mesh.py: the issue-15 workload, `meshllm bench` in its own process, and the engine alone.

`meshllm bench` runs as a subprocess (`--json -`) so its CPU is not charged to any mesh process and its event
loop is not disturbed by the harness. The engine-alone baseline drives the mocker in this process through its
`LLMEngine` API with the very prompts the mesh would see: the same seeded workload, rendered with the model's chat
template and tokenized with its tokenizer, so TTFT and ITL can be compared with the mesh's at concurrency 1.
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
from meshllm.engine.mocker import MockerConfig, MockerEngine
from meshllm.frontend.chat_template import chat_template_for
from meshllm.frontend.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Load", "calibrate_chars_per_token", "drive", "engine_alone"]


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


async def engine_alone(model_path: Path, load: Load, requests: int, warmup: int, seed: int) -> dict[str, Any]:
    """The mocker (speedup 1) driven in-process, one request at a time: TTFT / ITL like `meshllm bench` reports them.

    TTFT = `generate()` called → first chunk with tokens; ITL = gaps between chunks with tokens. The prompts are
    the measured level's own (seed `seed`); the warm-up uses other prompts (seed + 1).
    """
    tok = await asyncio.to_thread(load_tokenizer, str(model_path))
    eos = tok.eos_token_ids[0] if tok.eos_token_ids else MockerConfig().eos_token_id
    engine = MockerEngine(MockerConfig(speedup_ratio=1.0, vocab_size=tok.vocab_size, eos_token_id=eos))
    await engine.start("bench-engine-alone")
    ttfts: list[float] = []
    gaps: list[float] = []
    events = prompt_tokens = 0
    try:
        for phase_seed, n, record in ((seed + 1, warmup, False), (seed, requests, True)):
            workload = Workload(load.spec("engine", phase_seed))
            for i in range(n):
                req = workload.next()
                ids = _prompt_ids(tok, req.body)
                request = {"request_id": f"alone-{phase_seed}-{i}", "token_ids": ids,
                           "stop": {"max_tokens": req.osl, "ignore_eos": True}}  # fmt: skip
                t0 = last = time.perf_counter()
                first = True
                async for chunk in engine.generate(request, Context(request["request_id"])):  # type: ignore[arg-type]
                    if not chunk.get("token_ids"):
                        continue
                    now = time.perf_counter()
                    if record:
                        (ttfts if first else gaps).append(now - (t0 if first else last))
                        events += 1
                    first, last = False, now
                if record:
                    prompt_tokens += len(ids)
    finally:
        await engine.cleanup()
    ms = 1000.0
    return {
        "requests": requests, "errors": 0, "mean_isl": prompt_tokens / requests if requests else math.nan,
        "ttft_p50_ms": percentile(ttfts, 50) * ms, "ttft_p90_ms": percentile(ttfts, 90) * ms,
        "ttft_p99_ms": percentile(ttfts, 99) * ms, "itl_p50_ms": percentile(gaps, 50) * ms,
        "itl_p90_ms": percentile(gaps, 90) * ms, "itl_p99_ms": percentile(gaps, 99) * ms,
        "events_per_request": events / requests if requests else math.nan,
    }  # fmt: skip

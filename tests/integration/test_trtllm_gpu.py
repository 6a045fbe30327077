"""TensorRT-LLM on a real GPU: the conformance kit and a disaggregated request equal to the aggregated one.

Needs hardware, so it is skipped (with that reason) unless TensorRT-LLM imports,
`nvidia-smi` lists a GPU and MESHLLM_TRTLLM_TEST_MODEL names a small Hugging
Face model directory (e.g. Qwen2.5-0.5B-Instruct). Run:

    MESHLLM_TRTLLM_TEST_MODEL=/models/Qwen2.5-0.5B-Instruct pytest -m gpu tests/integration/test_trtllm_gpu.py -s
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from meshllm.engine.base import Context
from meshllm.engine.trtllm.engine import TrtllmEngine
from meshllm.protocol.convert import chunk_from_proto, chunk_to_proto
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.v1 import generate_pb2 as pb

MODEL = os.environ.get("MESHLLM_TRTLLM_TEST_MODEL", "")


def _skip_reason() -> str | None:
    if importlib.util.find_spec("tensorrt_llm") is None:
        return "needs TensorRT-LLM (pip install '.[trtllm]' in the clone, wheels from NVIDIA's index) and an NVIDIA GPU"
    smi = shutil.which("nvidia-smi")
    try:
        gpus = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout if smi else ""
    except (OSError, subprocess.SubprocessError):
        gpus = ""
    if "GPU" not in gpus:
        return "needs an NVIDIA GPU (nvidia-smi lists none)"
    if not MODEL:
        return "set MESHLLM_TRTLLM_TEST_MODEL to a small Hugging Face model directory"
    return None


_REASON = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _argv(tmp_path: Path, name: str, yaml_text: str, *flags: str) -> list[str]:
    extra = tmp_path / f"{name}.yaml"
    extra.write_text(yaml_text)
    return ["--model-path", MODEL, "--extra-engine-args", str(extra), "--static", "--max-seq-len", "2048", *flags]


async def _tokens(engine: TrtllmEngine, request: TokenRequest) -> tuple[list[int], TokenChunk]:
    chunks = [c async for c in engine.generate(request, Context(request["request_id"]))]
    return [t for c in chunks for t in c.get("token_ids", [])], chunks[-1]


@pytest.mark.timeout(3600)
async def test_trtllm_engine_passes_the_conformance_kit(tmp_path: Path) -> None:
    """Every LLMEngine clause, checked by meshllm.testing.conformance against fresh real engines."""
    from meshllm.testing.conformance import ConformanceOptions, factory_for, run_conformance

    argv = _argv(tmp_path, "agg", "kv_cache_config:\n  free_gpu_memory_fraction: 0.3\n")
    # Batched GPU kernels may change greedy outputs with batch composition, so concurrent outputs are not compared.
    options = ConformanceOptions(compare_concurrent_outputs=False, start_timeout_s=1200.0, timeout_s=180.0)
    report = await run_conformance(factory_for(TrtllmEngine, argv), options)
    print(report.summary())
    report.raise_if_failed()


@pytest.mark.timeout(1800)
async def test_a_disaggregated_request_matches_aggregated_greedy_output(tmp_path: Path) -> None:
    """context_only on a prefill engine, its answer through the proto, generation_only on a decode engine:
    first token + decode tokens == the decode engine's own aggregated greedy output."""
    yaml_text = "kv_cache_config:\n  free_gpu_memory_fraction: 0.2\ncache_transceiver_config:\n  backend: DEFAULT\n"
    prefill, _ = await TrtllmEngine.from_args(_argv(tmp_path, "prefill", yaml_text, "--role", "prefill"))
    decode, _ = await TrtllmEngine.from_args(_argv(tmp_path, "decode", yaml_text, "--role", "decode"))
    try:
        await prefill.start("trtllm-prefill")
        await decode.start("trtllm-decode")
        tokenizer: Any = getattr(decode._llm, "tokenizer", None)
        prompt = list(tokenizer.encode("The capital of France is")) if tokenizer is not None else list(range(1, 33))
        base: dict[str, Any] = {
            "token_ids": prompt,
            "sampling": {"temperature": 0.0, "seed": 0},
            "stop": {"max_tokens": 16, "ignore_eos": True},
        }
        agg, agg_end = await _tokens(decode, {"request_id": "agg", **base})  # type: ignore[typeddict-item]
        assert agg_end["finish_reason"] == "length" and len(agg) == 16

        first, answer = await _tokens(prefill, {"request_id": "p", **base, "disagg": {"request_type": "context_only"}})  # type: ignore[typeddict-item]
        assert answer["finish_reason"] == "length" and first == agg[:1] and "disagg" in answer
        wire = chunk_from_proto(pb.GenerateChunk.FromString(chunk_to_proto(answer).SerializeToString()))
        disagg = {**wire["disagg"], "request_type": "generation_only"}
        rest, end = await _tokens(decode, {"request_id": "d", **base, "disagg": disagg})  # type: ignore[typeddict-item]
        assert end["finish_reason"] == "length"
        assert first + rest == agg
    finally:
        await prefill.cleanup()
        await decode.cleanup()

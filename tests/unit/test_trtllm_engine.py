"""TrtllmEngine driven through a FAKE `tensorrt_llm` module (test_trtllm_fakes), plus the missing-package exit.

These tests exercise the adapter's own logic — streaming deltas, cancellation,
cleanup, the prefill → decode flow, KV events and load — not TensorRT-LLM.
The real engine is only exercised by tests/integration/test_trtllm_gpu.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from test_trtllm_fakes import (
    DisaggregatedParams,
    FakeLLM,
    GuidedDecodingParams,
    Sink,
    install_fake_trtllm,
    iteration_stats,
    removed_event,
    stored_event,
)

from meshllm.engine.base import Context
from meshllm.engine.trtllm.engine import TrtllmEngine
from meshllm.errors import EngineShutdown, FailedPrecondition, InvalidArgument
from meshllm.protocol.convert import chunk_from_proto, chunk_to_proto
from meshllm.protocol.kv import stored_blocks
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.v1 import generate_pb2 as pb

DISAGG_YAML = "cache_transceiver_config:\n  backend: DEFAULT\nguided_decoding_backend: xgrammar\n"


@pytest.fixture
def fake_trtllm(monkeypatch: pytest.MonkeyPatch) -> Any:
    return install_fake_trtllm(monkeypatch)


async def make(tmp_path: Path, *flags: str, yaml_text: str = DISAGG_YAML) -> tuple[TrtllmEngine, Sink]:
    model = tmp_path / "tiny-model"
    model.mkdir(exist_ok=True)
    (model / "tokenizer.json").write_text("{}")
    extra = tmp_path / "extra.yaml"
    extra.write_text(yaml_text)
    engine, _ = await TrtllmEngine.from_args(["--model-path", str(model), "--extra-engine-args", str(extra), "--static", *flags])
    sink = Sink()
    engine.sink = sink
    return engine, sink


def request(prompt: list[int], **kw: Any) -> TokenRequest:
    r: TokenRequest = {"request_id": "r", "token_ids": prompt}
    r.update(kw)  # type: ignore[typeddict-item]
    return r


async def collect(it: AsyncIterator[TokenChunk]) -> list[TokenChunk]:
    return [chunk async for chunk in it]


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.get("token_ids", [])]


async def test_engine_with_fake_trtllm_module_streams_deltas_and_reports_live_config(fake_trtllm: Any, tmp_path: Path) -> None:
    """start() builds LLM(**kwargs) and reports block size / total blocks from the live engine; chunks are deltas."""
    engine, sink = await make(tmp_path, "--max-seq-len", "2048")
    cfg = await engine.start("w1")
    llm = FakeLLM.instances[0]
    assert llm.kwargs["backend"] == "pytorch" and llm.kwargs["kv_cache_config"]["enable_block_reuse"] is True
    assert (cfg.kv_block_size, cfg.total_kv_blocks, cfg.context_length) == (32, 1000, 2048)
    assert cfg.eos_token_ids == (999,) and cfg.tokenizer_source == str(tmp_path / "tiny-model")
    assert engine.model_files() == {"tokenizer.json": tmp_path / "tiny-model" / "tokenizer.json"}
    chunks = await collect(engine.generate(request([10, 20], stop={"max_tokens": 5}), Context("a")))
    assert [c["token_ids"] for c in chunks] == [[21], [22], [23], [24], [25]]
    assert chunks[-1]["finish_reason"] == "length" and "finish_reason" not in chunks[0]
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "cached_tokens": 0}
    params = llm.results[-1].params
    assert params.detokenize is False and params.max_tokens == 5 and llm.results[-1].streaming
    assert sink.loads[0].total_blocks == 1000
    await engine.cleanup()


async def test_engine_with_fake_trtllm_module_maps_stop_eos_and_logprobs(fake_trtllm: Any, tmp_path: Path) -> None:
    engine, _ = await make(tmp_path)
    await engine.start("w1")
    stop = await collect(engine.generate(request([10], stop={"max_tokens": 9, "stop_token_ids": [14]}), Context("s")))
    assert tokens(stop) == [11, 12, 13] and stop[-1]["finish_reason"] == "stop" and stop[-1]["stop_reason"] == "14"
    assert stop[-1]["usage"]["completion_tokens"] == 3
    eos = await collect(engine.generate(request([10], eos_token_ids=[12], stop={"max_tokens": 9}), Context("e")))
    assert eos[-1]["finish_reason"] == "eos"
    lps = await collect(engine.generate(request([10], stop={"max_tokens": 2}, output={"logprobs": 1}), Context("l")))
    assert [c["logprobs"] for c in lps] == [
        [{"token_id": 11, "logprob": -0.5, "top": [(11, -0.5)]}],
        [{"token_id": 12, "logprob": -0.5, "top": [(12, -0.5)]}],
    ]
    await engine.cleanup()


async def test_engine_with_fake_trtllm_module_cancels_with_abort_and_a_cancelled_terminal(
    fake_trtllm: Any, tmp_path: Path
) -> None:
    """context.stop() mid-stream → result.abort() once and a "cancelled" terminal, promptly."""
    FakeLLM.token_delay = 0.05
    engine, _ = await make(tmp_path)
    await engine.start("w1")
    ctx = Context("c")
    it = engine.generate(request([1], stop={"max_tokens": 1000}), ctx)
    first = await anext(it)
    assert first["token_ids"] == [2]
    ctx.stop()
    rest = await asyncio.wait_for(collect(it), 1.0)
    assert rest[-1]["finish_reason"] == "cancelled"
    assert rest[-1]["usage"]["completion_tokens"] == len(tokens([first, *rest]))
    result = FakeLLM.instances[0].results[-1]
    await engine.abort(ctx)  # the worker's out-of-band abort after the stream's own: still one abort
    assert result.abort_calls == 1
    await engine.cleanup()


async def test_engine_with_fake_trtllm_module_aborts_when_the_consumer_drops_the_stream(fake_trtllm: Any, tmp_path: Path) -> None:
    FakeLLM.token_delay = 0.01
    engine, _ = await make(tmp_path)
    await engine.start("w1")
    it = engine.generate(request([1], stop={"max_tokens": 1000}), Context("d"))
    await anext(it)
    await it.aclose()  # type: ignore[attr-defined]
    assert FakeLLM.instances[0].results[-1].abort_calls == 1
    await engine.cleanup()


async def test_engine_with_fake_trtllm_module_calls_shutdown_exactly_once(fake_trtllm: Any, tmp_path: Path) -> None:
    """cleanup() is safe without start, twice, and concurrently; llm.shutdown() runs once."""
    idle, _ = await make(tmp_path)
    await idle.cleanup()
    engine, _ = await make(tmp_path)
    await engine.start("w1")
    await asyncio.gather(engine.cleanup(), engine.cleanup())
    await engine.cleanup()
    assert FakeLLM.instances[0].shutdown_calls == 1
    with pytest.raises(EngineShutdown):
        await collect(engine.generate(request([1]), Context("late")))


async def test_engine_with_fake_trtllm_module_survives_a_failed_start(fake_trtllm: Any, tmp_path: Path) -> None:
    FakeLLM.fail_with = RuntimeError("CUDA out of memory\nlong traceback text")
    engine, _ = await make(tmp_path)
    with pytest.raises(FailedPrecondition, match=r"CUDA out of memory$"):
        await engine.start("w1")
    await engine.cleanup()
    await engine.cleanup()
    assert FakeLLM.instances == []


async def test_engine_with_fake_trtllm_module_shuts_down_an_llm_whose_start_was_cancelled(
    fake_trtllm: Any, tmp_path: Path
) -> None:
    """The LLM is built in a thread; if start() is cancelled meanwhile, cleanup() still shuts it down."""
    engine, _ = await make(tmp_path)
    task = asyncio.ensure_future(engine.start("w1"))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine.cleanup()
    assert [llm.shutdown_calls for llm in FakeLLM.instances] == [1]


async def test_engine_with_fake_trtllm_module_runs_prefill_then_decode_like_aggregated(fake_trtllm: Any, tmp_path: Path) -> None:
    """context_only answers first_gen_tokens / ctx_request_id / opaque_state; through the proto, the decode leg
    rebuilds DisaggregatedParams(generation_only), runs the same prompt, and prefill + decode == aggregated."""
    prefill, _ = await make(tmp_path, "--role", "prefill")
    decode, _ = await make(tmp_path, "--role", "decode")
    await prefill.start("p")
    await decode.start("d")
    prompt, stop = [5, 6, 7], {"max_tokens": 6}
    agg = tokens(await collect(decode.generate(request(prompt, stop=stop), Context("agg"))))

    answer = await collect(prefill.generate(request(prompt, stop=stop, disagg={"request_type": "context_only"}), Context("p1")))
    assert len(answer) == 1 and answer[0]["finish_reason"] == "length" and answer[0]["token_ids"] == agg[:1]
    p_llm = FakeLLM.instances[0]
    assert p_llm.results[-1].params.max_tokens == 1 and not p_llm.results[-1].streaming
    wire = chunk_from_proto(pb.GenerateChunk.FromString(chunk_to_proto(answer[0]).SerializeToString()))
    disagg = {**wire["disagg"], "request_type": "generation_only"}
    assert disagg["first_token_ids"] == agg[:1] and disagg["opaque_state"] == b"\x00comm-state"

    rest = await collect(decode.generate(request(prompt, stop=stop, disagg=disagg), Context("d1")))
    sent = FakeLLM.instances[1].results[-1].disagg
    assert sent == DisaggregatedParams(
        request_type="generation_only",
        first_gen_tokens=agg[:1],
        ctx_request_id=int(wire["disagg"]["ctx_request_id"]),
        opaque_state=b"\x00comm-state",
    )
    assert agg[:1] + tokens(rest) == agg
    assert rest[-1]["usage"]["completion_tokens"] == len(agg)
    await asyncio.gather(prefill.cleanup(), decode.cleanup())


async def test_engine_with_fake_trtllm_module_defers_a_decode_abort_until_the_kv_arrived(
    fake_trtllm: Any, tmp_path: Path
) -> None:
    """Cancelling a generation_only leg before its first response ends the stream now but aborts only after it."""
    FakeLLM.stall_first = True
    engine, _ = await make(tmp_path, "--role", "decode")
    FakeLLM.stall_first = False
    await engine.start("d")
    FakeLLM.stall_first = True
    llm = FakeLLM.instances[0]
    ctx = Context("d2")
    disagg = {"request_type": "generation_only", "first_token_ids": [8], "ctx_request_id": "100", "opaque_state": b"s"}
    it = engine.generate(request([5, 6, 7], stop={"max_tokens": 50}, disagg=disagg), ctx)
    pending = asyncio.ensure_future(collect(it))
    await asyncio.sleep(0.05)
    ctx.stop()
    chunks = await asyncio.wait_for(pending, 1.0)
    assert chunks[-1]["finish_reason"] == "cancelled" and chunks[-1]["usage"]["completion_tokens"] == 1
    result = llm.results[-1]
    assert result.abort_calls == 0
    llm.release.set()
    for _ in range(100):
        if result.abort_calls:
            break
        await asyncio.sleep(0.01)
    assert result.abort_calls == 1
    await engine.cleanup()


async def test_engine_with_fake_trtllm_module_publishes_kv_events_and_load(fake_trtllm: Any, tmp_path: Path) -> None:
    engine, sink = await make(tmp_path)
    await engine.start("w1")
    llm = FakeLLM.instances[0]
    prompt = list(range(64))
    llm.kv_events += [stored_event(0, None, [(1, prompt[:32]), (2, prompt[32:])]), removed_event(1, [2])]
    llm.stats.append(iteration_stats(7, 1000, active=1))
    for _ in range(200):
        if sink.removed and any(m.active_blocks == 7 for m in sink.loads):
            break
        await asyncio.sleep(0.01)
    ours = stored_blocks(prompt, 32)
    assert sink.stored == [(ours, None, 0)] and sink.removed == [([ours[1][0]], 0)]
    assert any(m.active_blocks == 7 and m.running == 1 for m in sink.loads)
    await engine.cleanup()


async def test_engine_with_fake_trtllm_module_builds_guided_and_refuses_bad_requests(fake_trtllm: Any, tmp_path: Path) -> None:
    engine, _ = await make(tmp_path)
    await engine.start("w1")
    await collect(engine.generate(request([1], sampling={"guided": {"choice": ["a", "b"]}}), Context("g")))
    assert FakeLLM.instances[0].results[-1].params.guided_decoding == GuidedDecodingParams(regex="(a|b)")
    with pytest.raises(InvalidArgument):
        await collect(engine.generate(request([]), Context("empty")))
    await engine.cleanup()
    plain, _ = await make(tmp_path, yaml_text="{}")
    await plain.start("w2")
    with pytest.raises(InvalidArgument, match="guided_decoding_backend"):
        await collect(plain.generate(request([1], sampling={"guided": {"regex": "a"}}), Context("g2")))
    await plain.cleanup()


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed here")
def test_worker_without_tensorrt_llm_exits_with_one_line_naming_it(tmp_path: Path) -> None:
    """`python -m meshllm worker --engine trtllm` without the package: non-zero exit, one stderr line, no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHLLM_")}
    proc = subprocess.run(
        [sys.executable, "-m", "meshllm", "worker", "--engine", "trtllm", "--model-path", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0
    assert len(lines) == 1, proc.stderr
    assert "TensorRT-LLM" in lines[0] and "pip install '.[trtllm]'" in lines[0]
    assert "Traceback" not in proc.stderr

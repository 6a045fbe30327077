"""Stand-ins shaped like TensorRT-LLM's real objects, for the trtllm engine's unit tests (no tests here).

Each class names the file it mirrors. Only the fields and methods the adapter
touches are reproduced, with the same names, defaults and semantics
(cumulative `token_ids`, stop-token trimming, `abort()`, async-iterable results).
`install_fake_trtllm` puts a FAKE `tensorrt_llm` module into `sys.modules`.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import types
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from meshllm.engine.base import LoadMetrics

# ----------------------------------------------------------------- result.py


@dataclass(slots=True)
class Logprob:
    """NVIDIA/TensorRT-LLM tensorrt_llm/executor/result.py `Logprob(logprob, rank)`."""

    logprob: float
    rank: int | None = None


@dataclass
class KvCacheMetrics:
    """`request_perf_metrics.kv_cache_metrics` (NVIDIA/TensorRT-LLM tests/unittest/llmapi/test_llm_pytorch.py,
    test_llm_perf_metrics: num_total_allocated_blocks, num_new_allocated_blocks, num_reused_blocks, ...)."""

    num_total_allocated_blocks: int = 0
    num_new_allocated_blocks: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    kv_cache_hit_rate: float = 0.0


@dataclass
class RequestPerfMetrics:
    """`CompletionOutput.request_perf_metrics` (same test file; Dynamo's handler_base.py reads kv_cache_metrics)."""

    kv_cache_metrics: KvCacheMetrics = field(default_factory=KvCacheMetrics)


@dataclass
class CompletionOutput:
    """NVIDIA/TensorRT-LLM tensorrt_llm/executor/result.py `CompletionOutput`: token_ids and logprobs are
    cumulative; finish_reason in {"stop", "length", "timeout", "cancelled"}; stop_reason is the stop token id."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    disaggregated_params: Any = None
    request_perf_metrics: RequestPerfMetrics | None = None
    _last_token_ids_len: int = 0

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]


# ----------------------------------------------- disaggregated_params.py etc.


@dataclass(slots=True, kw_only=True)
class DisaggregatedParams:
    """NVIDIA/TensorRT-LLM tensorrt_llm/disaggregated_params.py `DisaggregatedParams` (P-D fields)."""

    request_type: str | None = None
    first_gen_tokens: list[int] | None = None
    first_gen_log_probs: list[Any] | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None
    disagg_request_id: int | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None

    def __post_init__(self) -> None:
        if self.request_type is not None and self.request_type not in (
            "context_only",
            "generation_only",
            "context_and_generation",
        ):
            raise ValueError(f"Unknown request type: {self.request_type}.")


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    """NVIDIA/TensorRT-LLM tensorrt_llm/sampling_params.py `GuidedDecodingParams` (no "choice" field)."""

    json: Any = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """NVIDIA/TensorRT-LLM tensorrt_llm/sampling_params.py `SamplingParams` (the fields the adapter may set;
    an unknown keyword raises TypeError exactly like the real kw_only dataclass)."""

    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    stop_token_ids: list[int] | None = None
    n: int = 1
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_perf_metrics: bool = False
    guided_decoding: GuidedDecodingParams | None = None
    ignore_eos: bool = False
    detokenize: bool = True


# ------------------------------------------------------------ KV cache events


def unique_token(token_id: int) -> dict[str, Any]:
    """KVCacheEventSerializer._unique_tokens_to_json (NVIDIA/TensorRT-LLM tensorrt_llm/_utils.py)."""
    return {"type": "unique_token", "token_id": token_id, "token_extra_id": 0}


def stored_event(
    event_id: int, parent_hash: int | None, blocks: Sequence[tuple[int, Sequence[int]]], **top: Any
) -> dict[str, Any]:
    """A serialized "stored" event, exactly the dict KVCacheEventSerializer.to_json_str builds
    (NVIDIA/TensorRT-LLM tensorrt_llm/_utils.py; newer versions add window_size / attention_dp_rank)."""
    data = {
        "type": "stored",
        "parent_hash": parent_hash,
        "blocks": [
            {
                "type": "stored_block",
                "block_hash": h,
                "tokens": [unique_token(t) for t in tokens],
                "cache_level": 0,
                "priority": 35,
            }
            for h, tokens in blocks
        ],
    }
    return {"event_id": event_id, "data": data, **top}


def removed_event(event_id: int, hashes: Sequence[int], **top: Any) -> dict[str, Any]:
    """KVCacheEventSerializer._removed_to_json (tensorrt_llm/_utils.py)."""
    return {"event_id": event_id, "data": {"type": "removed", "block_hashes": list(hashes)}, **top}


def created_event(event_id: int, gpu_blocks: int, **top: Any) -> dict[str, Any]:
    """KVCacheEventSerializer._created_to_json (tensorrt_llm/_utils.py)."""
    return {"event_id": event_id, "data": {"type": "created", "num_blocks_per_cache_level": [gpu_blocks, 0]}, **top}


def updated_event(event_id: int, block_hash: int) -> dict[str, Any]:
    """KVCacheEventSerializer._updated_to_json (tensorrt_llm/_utils.py)."""
    diff = {"type": "event_diff", "new_value": 1, "old_value": 0}
    return {"event_id": event_id, "data": {"type": "updated", "block_hash": block_hash, "cache_level": diff, "priority": diff}}


# The C++ binding classes (class names are what KVCacheEventSerializer dispatches on).
class UniqueToken(SimpleNamespace):
    """bindings `UniqueToken(token_id, token_extra_id)`."""


class KVCacheStoredBlockData(SimpleNamespace):
    """bindings `KVCacheStoredBlockData(block_hash, tokens, cache_level, priority)`."""


class KVCacheStoredData(SimpleNamespace):
    """bindings `KVCacheStoredData(parent_hash, blocks)`."""


class KVCacheRemovedData(SimpleNamespace):
    """bindings `KVCacheRemovedData(block_hashes)`."""


class KVCacheEvent(SimpleNamespace):
    """bindings `KVCacheEvent(event_id, data, window_size, attention_dp_rank)`."""


def iteration_stats(used: int, total: int, *, tokens_per_block: int = 32, active: int = 0, queued: int = 0) -> dict[str, Any]:
    """One `get_stats_async` sample (keys from NVIDIA/TensorRT-LLM tests/unittest/llmapi/apps/_test_openai_metrics.py
    and the trtllm-serve /metrics example output)."""
    return {
        "iter": 1,
        "numActiveRequests": active,
        "numQueuedRequests": queued,
        "kvCacheStats": {
            "usedNumBlocks": used,
            "maxNumBlocks": total,
            "freeNumBlocks": total - used,
            "tokensPerBlock": tokens_per_block,
            "reusedBlocks": 0,
            "allocTotalBlocks": used,
        },
    }


# --------------------------------------------------------- the FAKE engine


class FakeGenerationResult:
    """Behaves like NVIDIA/TensorRT-LLM tensorrt_llm/executor/result.py `GenerationResult` in streaming mode:
    async-iterable, each step appends to the cumulative `outputs[0].token_ids`, `abort()` makes the next step
    final with finish_reason "cancelled", `aresult()` runs to the end, `finished` mirrors `_done`.
    Tokens follow the sample engine's rule: output i of a prompt ending in p is (p + 1 + i) % 1000."""

    def __init__(
        self, llm: FakeLLM, prompt: list[int], params: SamplingParams, streaming: bool, disagg: DisaggregatedParams | None
    ) -> None:
        self.llm = llm
        self.prompt = prompt
        self.params = params
        self.streaming = streaming
        self.disagg = disagg
        self.request_id = next(llm.ids)
        self.abort_calls = 0
        self._done = False
        first = list(disagg.first_gen_tokens or []) if disagg and disagg.request_type == "generation_only" else []
        self.outputs = [CompletionOutput(token_ids=first)]
        self._i = len(first)
        self._started = False

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self.abort_calls += 1

    def __aiter__(self) -> FakeGenerationResult:
        return self

    async def __anext__(self) -> FakeGenerationResult:
        if self._done:
            raise StopAsyncIteration
        if self.llm.stall_first and not self._started:
            await self.llm.release.wait()  # e.g. a generation-only request waiting for its KV transfer
        self._started = True
        await asyncio.sleep(self.llm.token_delay)
        while True:
            self._step()
            if self._done or self.streaming:
                return self

    async def aresult(self) -> FakeGenerationResult:
        async for _ in self:
            pass
        return self

    def _step(self) -> None:
        out = self.outputs[0]
        p = self.params
        if self.abort_calls:
            out.finish_reason, self._done = "cancelled", True
            return
        token = (self.prompt[-1] + 1 + self._i) % 1000
        self._i += 1
        out.token_ids.append(token)
        min_ok = self._i > (p.min_tokens or 0)
        if min_ok and p.stop_token_ids and token in p.stop_token_ids:
            out.token_ids.pop()  # stop tokens are trimmed (include_stop_str_in_output=False)
            out.finish_reason, out.stop_reason, self._done = "stop", token, True
        elif min_ok and not p.ignore_eos and token == p.end_id:
            out.finish_reason, self._done = "stop", True
        elif len(out.token_ids) >= p.max_tokens:
            out.finish_reason, self._done = "length", True
        if p.logprobs:
            out.logprobs.append({token: Logprob(-0.5, 1), (token + 1) % 1000: Logprob(-1.5, 2)})
        if self._done:
            out.request_perf_metrics = RequestPerfMetrics(KvCacheMetrics(num_reused_blocks=self.llm.reused_blocks))
            if self.disagg is not None and self.disagg.request_type == "context_only":
                out.disaggregated_params = DisaggregatedParams(
                    request_type="context_only",
                    first_gen_tokens=list(out.token_ids),
                    ctx_request_id=self.request_id,
                    opaque_state=b"\x00comm-state",
                    draft_tokens=None,
                )
            self.llm.stats.append(iteration_stats(0, self.llm.total_blocks))


class _Drain:
    """What `get_kv_cache_events_async` / `get_stats_async` return: an async iterable that ends when empty
    (IterationResult in tensorrt_llm/executor/result.py ends after `timeout` without data)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[Any]:
        while self.items:
            yield self.items.pop(0)


class FakeLLM:
    """A FAKE `tensorrt_llm.LLM` (NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm.py): records its kwargs,
    `args.kv_cache_config.tokens_per_block`, a tokenizer, generate_async, the two polling APIs, shutdown."""

    instances: ClassVar[list[FakeLLM]] = []
    fail_with: ClassVar[BaseException | None] = None
    token_delay: ClassVar[float] = 0.0
    stall_first: ClassVar[bool] = False

    def __init__(self, **kwargs: Any) -> None:
        if FakeLLM.fail_with is not None:
            raise FakeLLM.fail_with
        self.kwargs = kwargs
        kv = kwargs.get("kv_cache_config", {})
        self.args = SimpleNamespace(
            kv_cache_config=SimpleNamespace(tokens_per_block=kv.get("tokens_per_block", 32)),
            max_seq_len=kwargs.get("max_seq_len") or 4096,
            max_batch_size=kwargs.get("max_batch_size") or 64,
            max_num_tokens=kwargs.get("max_num_tokens") or 8192,
        )
        self.tokenizer = SimpleNamespace(eos_token_id=999, bos_token_id=1)
        self.ids = itertools.count(100)
        self.total_blocks = 1000
        self.reused_blocks = 0
        self.kv_events: list[Any] = []
        self.stats: list[Any] = []
        self.results: list[FakeGenerationResult] = []
        self.shutdown_calls = 0
        self.release = asyncio.Event()
        FakeLLM.instances.append(self)

    def generate_async(
        self,
        inputs: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        streaming: bool = False,
        disaggregated_params: DisaggregatedParams | None = None,
        **_: Any,
    ) -> FakeGenerationResult:
        assert isinstance(sampling_params, SamplingParams)
        result = FakeGenerationResult(self, list(inputs), sampling_params, streaming, disaggregated_params)
        self.results.append(result)
        return result

    def get_kv_cache_events_async(self, timeout: float | None = 2) -> _Drain:
        return _Drain(self.kv_events)

    def get_stats_async(self, timeout: float | None = 2) -> _Drain:
        return _Drain(self.stats)

    def shutdown(self) -> None:
        self.shutdown_calls += 1


def install_fake_trtllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Put a FAKE `tensorrt_llm` (and `tensorrt_llm.sampling_params`) into sys.modules for one test."""
    FakeLLM.instances = []
    FakeLLM.fail_with = None
    FakeLLM.token_delay = 0.0
    FakeLLM.stall_first = False
    module = types.ModuleType("tensorrt_llm")
    module.LLM = FakeLLM  # type: ignore[attr-defined]
    module.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    module.DisaggregatedParams = DisaggregatedParams  # type: ignore[attr-defined]
    sp_module = types.ModuleType("tensorrt_llm.sampling_params")
    sp_module.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    sp_module.GuidedDecodingParams = GuidedDecodingParams  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt_llm", module)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.sampling_params", sp_module)
    return module


@dataclass
class Sink:
    """An EngineSink recording every call."""

    stored: list[tuple[list[tuple[int, int]], int | None, int]] = field(default_factory=list)
    removed: list[tuple[list[int], int]] = field(default_factory=list)
    cleared: list[int] = field(default_factory=list)
    loads: list[LoadMetrics] = field(default_factory=list)

    def blocks_stored(self, blocks: Sequence[tuple[int, int]], parent_hash: int | None, dp_rank: int = 0) -> None:
        self.stored.append((list(blocks), parent_hash, dp_rank))

    def blocks_removed(self, block_hashes: Sequence[int], dp_rank: int = 0) -> None:
        self.removed.append((list(block_hashes), dp_rank))

    def all_cleared(self, dp_rank: int = 0) -> None:
        self.cleared.append(dp_rank)

    def load(self, metrics: LoadMetrics) -> None:
        self.loads.append(metrics)

"""The mocker engine: a simulated vLLM-like scheduler and paged KV cache with real KV events.

`sequence` (one request), `block_manager` (paged KV, prefix cache, LRU),
`scheduler` (continuous batching, chunked prefill, preemption), `timing` (the
step-time model), `config` (flags) and `engine` (`MockerEngine`, the step
loop and the `LLMEngine` contract).
"""

from __future__ import annotations

from meshllm.engine.mocker.config import MockerConfig
from meshllm.engine.mocker.engine import MockerEngine, StepReport

__all__ = ["MockerConfig", "MockerEngine", "StepReport"]

"""The `sample` engine: rotating token ids, no ML — the worked example of the LLMEngine contract.

Output token `i` (0-based) of a prompt ending in token `p` is `(p + 1 + i) % vocab`,
so a prompt extended by its own output continues the same sequence: that makes
migration, and prefill + decode, produce exactly the aggregated output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Self

from meshllm.engine.base import Context, EngineConfig, LLMEngine, LoadMetrics, TokenChunk, TokenRequest, terminal
from meshllm.engine.worker_config import WorkerConfig, worker_arg_parser
from meshllm.errors import InvalidArgument
from meshllm.protocol.types import DisaggInfo, TokenUsage

__all__ = ["SampleEngine"]

log = logging.getLogger(__name__)


class SampleEngine(LLMEngine):
    """Rotating tokens for every role; honours stop conditions and cancellation."""

    def __init__(self, *, model: str = "sample", token_delay_ms: float = 0.0, vocab_size: int = 32000) -> None:
        self.model = model
        self.token_delay_s = token_delay_ms / 1000.0
        self.vocab_size = vocab_size
        self.default_max_tokens = 16
        self.running = 0

    @classmethod
    async def from_args(cls, argv: Sequence[str]) -> tuple[Self, WorkerConfig]:
        parser = worker_arg_parser("sample")
        g = parser.add_argument_group("sample engine")
        g.add_argument("--token-delay-ms", type=float, default=0.0, help="delay before each token (long streams in tests)")
        ns = parser.parse_args(list(argv))
        engine = cls(model=ns.model_name or "sample", token_delay_ms=ns.token_delay_ms)
        return engine, WorkerConfig.from_namespace(ns, engine="sample")

    async def start(self, worker_id: str) -> EngineConfig:
        log.info("sample engine %s started as %s", self.model, worker_id)
        return EngineConfig(model=self.model, tokenizer_source="builtin:sample")

    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        prompt = request["token_ids"]
        if not prompt:
            raise InvalidArgument("token_ids must not be empty", param="token_ids")
        stop = request.get("stop", {})
        max_tokens = stop.get("max_tokens", self.default_max_tokens)
        if max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        disagg = request.get("disagg", {})
        role = disagg.get("request_type")
        first = list(disagg.get("first_token_ids", [])) if role == "generation_only" else []
        if role == "generation_only" and not first:
            raise InvalidArgument("generation_only request without first_token_ids", param="disagg")
        stop_ids = set(stop.get("stop_token_ids", []))
        eos_ids = set() if stop.get("ignore_eos") else set(request.get("eos_token_ids", []))
        min_tokens = stop.get("min_tokens", 0)
        limit = 1 if role == "context_only" else max_tokens
        done = len(first)  # completion tokens so far; a decode leg counts the prefill's first tokens
        log.debug("sample request %s: %d prompt tokens, role %s", context.id, len(prompt), role or "agg")
        self.running += 1
        self._report_load()
        try:
            for i in range(len(first), limit):
                await self._pace(context)
                if context.is_stopped():
                    yield terminal("cancelled", _usage(prompt, done))
                    return
                token = (prompt[-1] + 1 + i) % self.vocab_size
                if i >= min_tokens and token in stop_ids:
                    yield terminal("stop", _usage(prompt, done), stop_reason=str(token))
                    return
                done += 1
                if i >= min_tokens and token in eos_ids:
                    yield terminal("eos", _usage(prompt, done), token_ids=[token])
                    return
                if role == "context_only":
                    handle = f"sample:{context.id}".encode()
                    disagg_out: DisaggInfo = {"kv_handle": handle, "first_token_ids": [token]}
                    yield terminal("length", _usage(prompt, done), token_ids=[token], disagg=disagg_out)
                    return
                yield {"token_ids": [token]}
            yield terminal("length", _usage(prompt, done))
        finally:
            self.running -= 1
            self._report_load()

    async def _pace(self, context: Context) -> None:
        """Wait the per-token delay (waking early on stop); always yield to the loop."""
        if self.token_delay_s <= 0:
            await asyncio.sleep(0)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(context.stopped(), self.token_delay_s)

    def _report_load(self) -> None:
        self.sink.load(LoadMetrics(active_blocks=0, total_blocks=0, waiting=0, running=self.running))

    async def cleanup(self) -> None:
        log.info("sample engine %s cleaned up", self.model)


def _usage(prompt: Sequence[int], completion_tokens: int) -> TokenUsage:
    return {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens, "cached_tokens": 0}

"""Deliberately broken engines: each breaks exactly one contract clause of the conformance kit.

Each is the `sample` engine with one realistic bug (the KV tier clauses': the
mocker with host and disk tiers); `BROKEN` maps every clause to the engine
that breaks it. They also serve the pytest-plugin tests
(`pytest --meshllm-engine broken_engines:IgnoresStopTokens`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, Self

from meshllm.engine.base import Context, EngineConfig, LLMEngine, TokenChunk, TokenRequest, terminal
from meshllm.engine.mocker import MockerEngine
from meshllm.engine.sample import SampleEngine
from meshllm.engine.worker_config import WorkerConfig
from meshllm.testing.conformance import Clause

#: A mocker the kit can push into its lower tiers quickly: 160 device blocks of 16 tokens, host and disk of 64 each.
TIERED_MOCKER_ARGS = [
    "--speedup-ratio", "0", "--block-size", "16", "--num-gpu-blocks", "160", "--context-length", "2048",
    "--kv-bytes-per-token", "1", "--kv-host-bytes", "1024", "--kv-disk-bytes", "1024",
]  # fmt: skip


class BadStartConfig(SampleEngine):
    """start_config: start() returns a plain dict instead of an EngineConfig."""

    async def start(self, worker_id: str) -> Any:
        config = await super().start(worker_id)
        return {"model": config.model}


class MiscountedUsage(SampleEngine):
    """basic_generate: usage.completion_tokens is one more than the tokens emitted."""

    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        async for chunk in super().generate(request, context):
            if "usage" in chunk:
                chunk["usage"] = {**chunk["usage"], "completion_tokens": chunk["usage"]["completion_tokens"] + 1}
            yield chunk


class ChunkAfterTerminal(SampleEngine):
    """nothing_after_terminal: one more token chunk follows the terminal chunk."""

    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        async for chunk in super().generate(request, context):
            yield chunk
        yield {"token_ids": [0]}


class IgnoresMaxTokens(SampleEngine):
    """max_tokens_length: an off-by-one emits max_tokens + 1 tokens."""

    def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        stop = request.get("stop", {})
        one_too_many = stop.get("max_tokens", self.default_max_tokens) + 1
        return super().generate({**request, "stop": {**stop, "max_tokens": one_too_many}}, context)


class IgnoresStopTokens(SampleEngine):
    """stop_token_ids_stop: stop_token_ids are never looked at."""

    def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        stop = {k: v for k, v in request.get("stop", {}).items() if k != "stop_token_ids"}
        return super().generate({**request, "stop": stop}, context)  # type: ignore[typeddict-item]


class IgnoresCancellation(SampleEngine):
    """cancellation: generate never polls the request's context."""

    def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        return super().generate(request, Context(context.id))


class SharedScratchBuffer(SampleEngine):
    """concurrent_streams: every request reads its prompt from one shared buffer."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._scratch: list[int] = []

    def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        self._scratch[:] = request["token_ids"]  # the next request overwrites it mid-stream
        return super().generate({**request, "token_ids": self._scratch}, context)


class DrainFails(SampleEngine):
    """drain: drain() raises."""

    async def drain(self) -> None:
        raise RuntimeError("lost the connection to the model server while draining")


class CleanupNeedsStart(SampleEngine):
    """cleanup_without_start: cleanup() touches a resource that only start() creates."""

    async def start(self, worker_id: str) -> EngineConfig:
        self._pool: set[str] = set()
        return await super().start(worker_id)

    async def cleanup(self) -> None:
        self._pool.clear()
        await super().cleanup()


class CleanupOnlyOnce(SampleEngine):
    """cleanup_twice: a second cleanup() raises instead of returning."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._closed = False

    async def cleanup(self) -> None:
        if self._closed:
            raise RuntimeError("engine already closed")
        self._closed = True
        await super().cleanup()


class AcceptsEmptyPrompt(SampleEngine):
    """empty_prompt_invalid_argument: an empty prompt gets an empty "length" stream instead of an error."""

    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        if not request["token_ids"]:
            yield terminal("length", {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0})
            return
        async for chunk in super().generate(request, context):
            yield chunk


class TieredMocker(MockerEngine):
    """The mocker with TIERED_MOCKER_ARGS as its defaults."""

    @classmethod
    async def from_args(cls, argv: Sequence[str]) -> tuple[Self, WorkerConfig]:
        return await super().from_args([*TIERED_MOCKER_ARGS, *argv])


class LookupStopsAtTheDevice(TieredMocker):
    """kv_tier_restore: blocks are offloaded to host and disk, but the prefix lookup never looks there."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        lookup = self.blocks.cached_prefix
        self.blocks.cached_prefix = lambda seq, max_tokens, lower=True: lookup(seq, max_tokens, lower=False)  # type: ignore[method-assign]


class RestoreShiftsTheOutput(TieredMocker):
    """kv_tier_restore_output: a request whose prefix came from a lower tier samples from misplaced KV."""

    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        before = self.stats.host_hit_tokens + self.stats.disk_hit_tokens
        async for chunk in super().generate(request, context):
            if self.stats.host_hit_tokens + self.stats.disk_hit_tokens > before and chunk.get("token_ids"):
                chunk = {**chunk, "token_ids": [(t + 1) % self.config.vocab_size for t in chunk["token_ids"]]}
            yield chunk


#: Every clause and the engine that breaks exactly it.
BROKEN: dict[Clause, type[LLMEngine]] = {
    Clause.START_CONFIG: BadStartConfig,
    Clause.BASIC_GENERATE: MiscountedUsage,
    Clause.NOTHING_AFTER_TERMINAL: ChunkAfterTerminal,
    Clause.MAX_TOKENS_LENGTH: IgnoresMaxTokens,
    Clause.STOP_TOKEN_IDS_STOP: IgnoresStopTokens,
    Clause.CANCELLATION: IgnoresCancellation,
    Clause.CONCURRENT_STREAMS: SharedScratchBuffer,
    Clause.DRAIN: DrainFails,
    Clause.CLEANUP_WITHOUT_START: CleanupNeedsStart,
    Clause.CLEANUP_TWICE: CleanupOnlyOnce,
    Clause.EMPTY_PROMPT_INVALID_ARGUMENT: AcceptsEmptyPrompt,
    Clause.KV_TIER_RESTORE: LookupStopsAtTheDevice,
    Clause.KV_TIER_RESTORE_OUTPUT: RestoreShiftsTheOutput,
}


class HangingEngine(SampleEngine):
    """Hangs forever wherever `hang` says ("start", "generate", "drain" or "cleanup"), whatever its context says."""

    hang = "generate"

    async def _forever(self) -> None:
        await asyncio.Event().wait()

    async def start(self, worker_id: str) -> EngineConfig:
        if self.hang == "start":
            await self._forever()
        return await super().start(worker_id)

    async def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        if self.hang == "generate":
            await self._forever()
        async for chunk in super().generate(request, context):
            yield chunk

    async def drain(self) -> None:
        if self.hang == "drain":
            await self._forever()

    async def cleanup(self) -> None:
        if self.hang == "cleanup":
            await self._forever()

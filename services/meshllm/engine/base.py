"""The engine contract: `LLMEngine` and the types that cross it.

An engine turns token ids into token ids. The framework (`meshllm.worker.run`)
owns everything else: flags, signals, planes, registration, serving,
cancellation, health, metrics and the shutdown order. Engines never open etcd
or NATS; they report cache changes and load through the `EngineSink` they are
given. Every clause below is checked by `meshllm.testing.conformance`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol, Self, TypeVar

from meshllm.engine.worker_config import DisaggregationMode, WorkerConfig, worker_arg_parser
from meshllm.protocol.types import (
    ChunkRelay,
    DisaggInfo,
    FinishReason,
    TokenChunk,
    TokenRequest,
    TokenUsage,
)

T = TypeVar("T")

# size: the engine contract stays one file: everything an engine implements or is handed, read in one place
# (docs/writing-an-engine.md walks through it top to bottom).

__all__ = [
    "Context",
    "DisaggregationMode",
    "EngineConfig",
    "EngineSink",
    "FinishReason",
    "KvPull",
    "KvTier",
    "KvTransfer",
    "LLMEngine",
    "LoadMetrics",
    "NullSink",
    "TierUsage",
    "TokenChunk",
    "TokenRequest",
    "WorkerConfig",  # engine/worker_config.py's, re-exported: engines parse the worker flags in from_args
    "terminal",
    "worker_arg_parser",
]


class KvTier(enum.IntEnum):
    """Where an engine keeps KV blocks (values of the `meshllm.v1.KvTier` proto enum).

    DEVICE is the engine's working cache; HOST (memory) and DISK are lower
    tiers holding blocks evicted from it, restored instead of recomputed. A
    block may sit in several tiers at once; the engine reports each tier's set
    on its own (`EngineSink.blocks_stored(..., tier=)`), so a block moving from
    DEVICE to HOST is *stored* in HOST and *removed* from DEVICE.
    """

    DEVICE = 0
    HOST = 1
    DISK = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """What `start()` reports. Only `model` is required; 0 means unknown."""

    model: str
    kv_block_size: int = 0
    total_kv_blocks: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    context_length: int = 0
    vocab_size: int = 0  # token ids at or above it are refused by the worker (0 = unknown, unchecked)
    data_parallel_size: int = 1
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Where frontends get the tokenizer: "builtin:<name>", a path, or "" (ask
    # the worker with GetModelFiles when `model_files()` serves files).
    tokenizer_source: str = ""
    chat_template: str = ""
    # Engine-defined fingerprint of the KV layout; disaggregated transfers
    # between workers with different layouts are refused.
    kv_layout: str = ""
    # Lower tiers (HOST, DISK) the engine keeps evicted blocks in; the
    # conformance kit runs its tier clauses on engines that declare any.
    kv_tiers: tuple[KvTier, ...] = ()

    def __post_init__(self) -> None:
        if KvTier.DEVICE in self.kv_tiers:
            raise ValueError("EngineConfig.kv_tiers lists lower tiers only (HOST, DISK)")
        if not self.model:
            raise ValueError("EngineConfig.model is required")
        if self.data_parallel_size < 1:
            raise ValueError("EngineConfig.data_parallel_size must be >= 1")


@dataclass(frozen=True, slots=True)
class TierUsage:
    """What one lower tier holds and costs, reported in `LoadMetrics.tiers`.

    `bytes_used` never exceeds `bytes_capacity` (the tier's budget).
    `restore_bytes_per_s` is how fast blocks come back into the device cache
    (measured, or the engine's model of it); 0 when unknown. Routers turn
    `block_bytes / restore_bytes_per_s` into a restore cost per block.
    """

    tier: KvTier
    blocks: int
    bytes_used: int
    bytes_capacity: int
    block_bytes: int = 0
    restore_bytes_per_s: float = 0.0


@dataclass(frozen=True, slots=True)
class LoadMetrics:
    """A load sample an engine reports through `EngineSink.load`.

    `total_blocks`/`active_blocks` describe the device tier; `tiers` has one
    `TierUsage` per lower tier the engine keeps (empty without).
    """

    active_blocks: int
    total_blocks: int
    waiting: int
    running: int
    queued_prefill_tokens: int = 0
    dp_rank: int = 0
    tiers: tuple[TierUsage, ...] = ()


class EngineSink(Protocol):
    """Where an engine reports KV cache changes and load (the worker implements it).

    Calls are cheap and never block: the worker assigns event ids, batches,
    publishes and keeps the block set that answers `GetKvSnapshot`. Hashes come
    from `meshllm.protocol.kv` so routers can match them against prompts.
    """

    def blocks_stored(
        self,
        blocks: Sequence[tuple[int, int]],
        parent_hash: int | None,
        dp_rank: int = 0,
        tier: KvTier = KvTier.DEVICE,
    ) -> None:
        """Full blocks `(block_hash, tokens_hash)` entered `tier`, chained after `parent_hash`."""

    def blocks_removed(self, block_hashes: Sequence[int], dp_rank: int = 0, tier: KvTier = KvTier.DEVICE) -> None:
        """Blocks left `tier` (other tiers may still hold them)."""

    def all_cleared(self, dp_rank: int = 0) -> None:
        """The whole cache, every tier, was dropped."""

    def load(self, metrics: LoadMetrics) -> None:
        """The latest load; the worker publishes at most every 100 ms."""


class NullSink:
    """An EngineSink that drops everything (engines used outside a worker)."""

    def blocks_stored(
        self,
        blocks: Sequence[tuple[int, int]],
        parent_hash: int | None,
        dp_rank: int = 0,
        tier: KvTier = KvTier.DEVICE,
    ) -> None:
        pass

    def blocks_removed(self, block_hashes: Sequence[int], dp_rank: int = 0, tier: KvTier = KvTier.DEVICE) -> None:
        pass

    def all_cleared(self, dp_rank: int = 0) -> None:
        pass

    def load(self, metrics: LoadMetrics) -> None:
        pass


class Context:
    """One request's handle: its id, its stop signal, its trace context, and maybe a relay for its chunks.

    The worker calls `stop()` when the caller cancels (gRPC cancel, Abort) or
    the worker shuts down hard. Engines poll `is_stopped()` between yields, or
    await `stopped()` alongside their own work.

    `relay`: when the worker sets it (its GenerateSession streams do, for an
    engine whose `takes_relay()` is true), the engine may hand a non-terminal
    chunk to `relay(chunk)` instead of yielding it, from wherever it makes the
    chunk (its step loop), so that no task wakes per chunk. The relay's chunks
    and the yielded ones form one stream in the order they were given; the
    terminal is always yielded. The relay never blocks; once the
    stream's iterator is closed the engine must not call it any more. An engine
    that ignores it is correct: everything then comes through the iterator.
    """

    __slots__ = ("_event", "id", "relay", "traceparent")

    def __init__(self, request_id: str, *, traceparent: str | None = None) -> None:
        self.id = request_id
        self.traceparent = traceparent
        self.relay: ChunkRelay | None = None
        self._event = asyncio.Event()

    def is_stopped(self) -> bool:
        return self._event.is_set()

    async def stopped(self) -> None:
        """Return once the request is stopped."""
        await self._event.wait()

    def stop(self) -> None:
        """Mark the request stopped (framework use; idempotent)."""
        self._event.set()

    async def unless_stopped(self, work: Awaitable[T]) -> asyncio.Future[T] | None:
        """Run `work` until it finishes or the request stops, whichever comes first.

        Returns the finished future (read its `result()` or `exception()`), or None
        when the request stopped first or `work` was cancelled (it is then
        cancelled and awaited, so nothing keeps running).
        """
        task = asyncio.ensure_future(work)
        stopped = asyncio.ensure_future(self._event.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return None if task.cancelled() or self.is_stopped() else task


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """One piece of serialized KV served by `LLMEngine.pull_kv`."""

    data: bytes
    total_bytes: int
    layout: str = ""
    n_tokens: int = 0


#: `(address, kv_handle, layout)` → the pieces of the KV held by the worker at
#: `address` (its `Worker.PullKv`): a finished prefill leg's handle, or a prefix
#: handle (`disagg.kv_source.kv_handle`). The worker gives it to its engine, so
#: an engine pulls from a peer without knowing the worker's client or transport.
KvPull = Callable[[str, bytes, str], AsyncIterator[KvTransfer]]


def terminal(
    reason: FinishReason,
    usage: TokenUsage,
    *,
    token_ids: Sequence[int] = (),
    stop_reason: str = "",
    disagg: DisaggInfo | None = None,
) -> TokenChunk:
    """Build a terminal chunk (a convenience for engines)."""
    chunk: TokenChunk = {"token_ids": list(token_ids), "finish_reason": reason, "usage": usage}
    if stop_reason:
        chunk["stop_reason"] = stop_reason
    if disagg is not None:
        chunk["disagg"] = disagg
    return chunk


class LLMEngine(abc.ABC):
    """The contract between meshllm and an inference engine.

    Who calls what, and when:

    1. `from_args(argv)` (async classmethod) — parses the engine's flags plus the
       common worker flags (use `worker_arg_parser`) and returns
       `(engine, WorkerConfig)`. It constructs; it does not load anything.
    2. The framework sets `engine.sink` (an `EngineSink`) and `engine.kv_pull`
       (a `KvPull`), then calls
       `start(worker_id)` once. `start` loads the model and returns an
       `EngineConfig`. From then on the engine is *ready*: `generate` may be
       called any number of times **concurrently**.
    3. `generate(request, context)` is an async iterator of `TokenChunk`
       dicts. Guarantees the engine must give:
         - the stream ends with **exactly one terminal chunk** — one with
           `finish_reason` and `usage` — and **nothing after it**;
         - `max_tokens` reached → "length"; a `stop_token_ids` hit → "stop"
           (the stop token is not emitted); an EOS token (unless `ignore_eos`)
           → "eos"; no EOS/stop before `min_tokens`;
         - it polls `context.is_stopped()` between yields; once stopped it ends
           promptly (well within 2 s) with a "cancelled" terminal and frees the
           request's resources (use `try/finally`: the consumer may also drop
           the iterator at any yield);
         - `output.logprobs` N: each generated token's entry in `logprobs`
           (its own logprob, N alternatives in `top`); `output.prompt_logprobs`
           N: the first chunk carries `prompt_logprobs`, one entry per prompt
           token after the first (scored by the logits after the token
           before it), N alternatives each. An engine that cannot compute
           prompt logprobs raises `InvalidArgument` (or leaves them out: the
           frontend then answers 400); a "generation_only" leg leaves them to
           its prefill leg;
         - invalid input (e.g. an empty prompt) raises
           `meshllm.errors.InvalidArgument` before any chunk; other failures
           raise a `meshllm.errors.MeshError` subclass (the class and message
           cross the wire intact) — anything else is wrapped as `Unknown`.
       Role: a request whose `disagg.request_type` is "context_only" (prefill
       role) computes the prompt and ends with one terminal chunk carrying the
       first token(s) and `disagg` (a kv handle); "generation_only" (decode
       role) obtains that KV and continues after `disagg.first_token_ids`.
       A "context_only" leg may carry `disagg.kv_source`: a peer at
       `kv_source.address` holds the prompt's first `kv_source.blocks` blocks;
       the engine may pull them with `kv_pull(address, kv_source.kv_handle,
       layout)`, load them, compute the rest and report them as
       `cached_tokens` — and on any failure of the pull (NotFound, Unavailable,
       FailedPrecondition, ...) computes the prompt instead, never failing the
       request (or it ignores the hint).
    4. `abort(context)` — optional, called once when a request is cancelled,
       for out-of-band release of engine resources (default: no-op).
    5. `drain()` — optional, pre-shutdown work while the planes are still up,
       after in-flight requests finished or the drain timeout passed.
    6. `cleanup()` — releases everything. Safe without `start`, safe to call
       twice (and concurrently).

    Optional capabilities (defaults raise `Unimplemented`, which the worker
    turns into gRPC UNIMPLEMENTED): `clear_kv_blocks`, `pull_kv`,
    `model_files`.
    """

    #: Set by the framework before `start`; engines report KV events and load here.
    sink: EngineSink = NullSink()
    #: What the engine can do beyond generating tokens, published in its ModelCard (`capabilities`): the
    #: frontend refuses a request needing one the engine lacks with a 400 before any engine work. Set
    #: True only what `generate` honours: `output.prompt_logprobs`, `output.embedding`, `sampling.guided`.
    supports_prompt_logprobs: ClassVar[bool] = False
    supports_embeddings: ClassVar[bool] = False
    supports_guided_decoding: ClassVar[bool] = False
    #: Set by the framework before `start`: pulls a peer worker's held KV (disaggregated decode); None outside a worker.
    kv_pull: KvPull | None = None

    @classmethod
    @abc.abstractmethod
    async def from_args(cls, argv: Sequence[str]) -> tuple[Self, WorkerConfig]:
        """Parse flags; construct the engine (do not start it)."""

    @classmethod
    def instance_args(cls, argv: Sequence[str], index: int, count: int) -> list[str]:
        """The engine flags of worker `index` (0-based) of `count` that one process builds from the same flags.

        `meshllm run` passes every worker the flags after `--`. An engine whose flags
        name a resource one worker must own (a directory it locks) returns flags that
        give each worker its own, stable across restarts for the same `index`. The
        default returns `argv` unchanged.
        """
        return list(argv)

    @abc.abstractmethod
    async def start(self, worker_id: str) -> EngineConfig:
        """Load the model; afterwards `generate` is safe to call concurrently."""

    @abc.abstractmethod
    def generate(self, request: TokenRequest, context: Context) -> AsyncIterator[TokenChunk]:
        """Stream chunks for one request (see the class docstring for guarantees)."""

    def takes_relay(self) -> bool:
        """Whether `generate` hands non-terminal chunks to `Context.relay` when one is set (optional; default
        no). The worker sets a relay only for an engine that says yes; a subclass that overrides `generate` to
        look at or change its base's chunks must say no (the chunks would bypass it)."""
        return False

    async def abort(self, context: Context) -> None:  # noqa: B027 - optional hook
        """Release engine resources of a cancelled request out of band (optional)."""

    async def drain(self) -> None:  # noqa: B027 - optional hook
        """Pre-shutdown work while planes are still up (optional)."""

    @abc.abstractmethod
    async def cleanup(self) -> None:
        """Release everything; safe without start and safe twice."""

    async def clear_kv_blocks(self) -> int:
        """Drop every cached, unreferenced KV block; return how many (optional)."""
        from meshllm.errors import Unimplemented

        raise Unimplemented(f"{type(self).__name__} cannot clear KV blocks")

    def pull_kv(self, kv_handle: bytes, layout: str) -> AsyncIterator[KvTransfer]:
        """Serve the KV held under `kv_handle`, in ~1 MiB pieces (optional).

        Two handle forms: the engine's own handle of a finished prefill leg
        (served once), and a prefix handle (`meshllm.protocol.kv.prefix_handle`:
        a block size and block hashes) naming prompt blocks the engine keeps in
        any tier; raise `NotFound` when it no longer holds them all, and
        `FailedPrecondition` when `layout` (the puller's) differs from its own.
        """
        from meshllm.errors import Unimplemented

        raise Unimplemented(f"{type(self).__name__} does not transfer KV over gRPC")

    def model_files(self) -> Mapping[str, Path]:
        """Tokenizer/config files served by GetModelFiles, by name (optional; empty = none)."""
        return {}

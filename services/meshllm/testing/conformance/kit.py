"""The kit's vocabulary: clauses, errors, options, the recording sink, streams, engine factories, the probe."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from meshllm.engine.base import Context, EngineSink, KvTier, LLMEngine, LoadMetrics, TierUsage
from meshllm.engine.worker_config import WorkerConfig
from meshllm.protocol.types import TokenChunk, TokenRequest

__all__ = [
    "SHAREABLE_CLAUSES",
    "TIER_CLAUSES",
    "Clause",
    "ConformanceError",
    "ConformanceOptions",
    "EngineFactory",
    "NotApplicable",
    "RecordingSink",
    "SharedEngine",
    "Stream",
    "TierSink",
    "factory_for",
]

EngineFactory = Callable[[], Awaitable[LLMEngine]]


class Clause(enum.StrEnum):
    """The contract clauses the kit checks, in the order it checks them."""

    START_CONFIG = "start_config"
    BASIC_GENERATE = "basic_generate"
    NOTHING_AFTER_TERMINAL = "nothing_after_terminal"
    MAX_TOKENS_LENGTH = "max_tokens_length"
    STOP_TOKEN_IDS_STOP = "stop_token_ids_stop"
    CANCELLATION = "cancellation"
    CONCURRENT_STREAMS = "concurrent_streams"
    DRAIN = "drain"
    CLEANUP_WITHOUT_START = "cleanup_without_start"
    CLEANUP_TWICE = "cleanup_twice"
    EMPTY_PROMPT_INVALID_ARGUMENT = "empty_prompt_invalid_argument"
    KV_TIER_RESTORE = "kv_tier_restore"
    KV_TIER_RESTORE_OUTPUT = "kv_tier_restore_output"

    @property
    def text(self) -> str:
        """The clause as a sentence."""
        return _CLAUSE_TEXT[self]


_CLAUSE_TEXT = {
    Clause.START_CONFIG: "start() returns a valid EngineConfig",
    Clause.BASIC_GENERATE: "generate yields tokens, then one terminal chunk with finish_reason and consistent usage",
    Clause.NOTHING_AFTER_TERMINAL: "nothing follows the terminal chunk",
    Clause.MAX_TOKENS_LENGTH: 'max_tokens reached -> exactly max_tokens tokens and "length"',
    Clause.STOP_TOKEN_IDS_STOP: 'a stop_token_ids hit -> "stop", the stop token not emitted',
    Clause.CANCELLATION: 'context.stop() mid-stream -> a "cancelled" terminal promptly',
    Clause.CONCURRENT_STREAMS: "concurrent streams all complete correctly",
    Clause.DRAIN: "drain() returns after start",
    Clause.CLEANUP_WITHOUT_START: "cleanup() is safe without start()",
    Clause.CLEANUP_TWICE: "cleanup() is safe twice and concurrently",
    Clause.EMPTY_PROMPT_INVALID_ARGUMENT: "an empty prompt raises InvalidArgument before any chunk",
    Clause.KV_TIER_RESTORE: "blocks evicted to a lower KV tier are restored: their prompt again reports them cached",
    Clause.KV_TIER_RESTORE_OUTPUT: "greedy output after a restore from a lower KV tier equals the recomputed output",
}

#: Clauses that run only on engines declaring `EngineConfig.kv_tiers` (others skip them).
TIER_CLAUSES = (Clause.KV_TIER_RESTORE, Clause.KV_TIER_RESTORE_OUTPUT)

#: Clauses that only start an engine and serve requests, so `run_conformance(share_engine=True)` can run them one
#: after another on one started engine (each still uses its own request ids). The others start, drain or clean up
#: engines of their own; the tier clauses skip on a shared engine that declares no tiers, without starting one.
SHAREABLE_CLAUSES = (
    Clause.START_CONFIG,
    Clause.BASIC_GENERATE,
    Clause.NOTHING_AFTER_TERMINAL,
    Clause.MAX_TOKENS_LENGTH,
    Clause.STOP_TOKEN_IDS_STOP,
    Clause.CANCELLATION,
    Clause.CONCURRENT_STREAMS,
    Clause.EMPTY_PROMPT_INVALID_ARGUMENT,
)


class NotApplicable(Exception):
    """A clause does not apply to this engine (it lacks the optional feature the clause checks)."""


class ConformanceError(AssertionError):
    """An engine broke `clause`; the message names the clause and says how."""

    def __init__(self, clause: Clause, message: str) -> None:
        super().__init__(f"[{clause}] {clause.text}: {message}")
        self.clause = clause
        self.detail = message


@dataclass(frozen=True, kw_only=True, slots=True)
class ConformanceOptions:
    """Knobs of the kit; the defaults suit any engine that loads in minutes."""

    prompt: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    max_tokens: int = 8
    # Long enough that a stream is still running when the kit cancels it.
    long_max_tokens: int = 1000
    concurrency: int = 8
    # False for engines whose greedy output depends on the batch it ran in.
    compare_concurrent_outputs: bool = True
    start_timeout_s: float = 300.0
    timeout_s: float = 60.0
    cancel_within_s: float = 2.0
    # Tier clauses: full blocks in the prompt that is evicted to a lower tier and restored, and the most
    # filler the kit sends to evict it, in multiples of the device cache (`EngineConfig.total_kv_blocks`).
    tier_prompt_blocks: int = 4
    tier_fill_factor: float = 4.0


class TierSink:
    """Passes everything to `inner`; every load sample also carries `tiers` (a test's lower-tier usage)."""

    def __init__(self, inner: EngineSink, tiers: Sequence[TierUsage]) -> None:
        self.inner, self.tiers = inner, tuple(tiers)

    def blocks_stored(self, *args: Any, **kw: Any) -> None:
        self.inner.blocks_stored(*args, **kw)

    def blocks_removed(self, *args: Any, **kw: Any) -> None:
        self.inner.blocks_removed(*args, **kw)

    def all_cleared(self, dp_rank: int = 0) -> None:
        self.inner.all_cleared(dp_rank)

    def load(self, metrics: LoadMetrics) -> None:
        self.inner.load(dataclasses.replace(metrics, tiers=self.tiers))


@dataclass
class RecordingSink:
    """An EngineSink that records everything (the kit sets one before `start`)."""

    # Device-tier events; lower tiers' go to tier_stored / tier_removed with their tier.
    stored: list[tuple[list[tuple[int, int]], int | None, int]] = field(default_factory=list)
    removed: list[tuple[list[int], int]] = field(default_factory=list)
    cleared: list[int] = field(default_factory=list)
    loads: list[LoadMetrics] = field(default_factory=list)
    tier_stored: list[tuple[KvTier, list[tuple[int, int]], int | None, int]] = field(default_factory=list)
    tier_removed: list[tuple[KvTier, list[int], int]] = field(default_factory=list)
    # Every tier's blocks (all dp ranks) as the events so far leave them.
    held: dict[KvTier, set[int]] = field(default_factory=lambda: {t: set() for t in KvTier})

    def blocks_stored(
        self,
        blocks: Sequence[tuple[int, int]],
        parent_hash: int | None,
        dp_rank: int = 0,
        tier: KvTier = KvTier.DEVICE,
    ) -> None:
        pairs = [(int(b), int(t)) for b, t in blocks]
        self.held[KvTier(tier)].update(b for b, _ in pairs)
        if tier == KvTier.DEVICE:
            self.stored.append((pairs, parent_hash, dp_rank))
        else:
            self.tier_stored.append((KvTier(tier), pairs, parent_hash, dp_rank))

    def blocks_removed(self, block_hashes: Sequence[int], dp_rank: int = 0, tier: KvTier = KvTier.DEVICE) -> None:
        self.held[KvTier(tier)].difference_update(block_hashes)
        if tier == KvTier.DEVICE:
            self.removed.append((list(block_hashes), dp_rank))
        else:
            self.tier_removed.append((KvTier(tier), list(block_hashes), dp_rank))

    def all_cleared(self, dp_rank: int = 0) -> None:
        self.cleared.append(dp_rank)
        for blocks in self.held.values():
            blocks.clear()

    def load(self, metrics: LoadMetrics) -> None:
        self.loads.append(metrics)


@dataclass
class Stream:
    """Every chunk one generate call produced, split at its first terminal chunk."""

    chunks: list[TokenChunk] = field(default_factory=list)
    ended: bool = False  # the iterator was exhausted (not just abandoned)

    @property
    def terminal_index(self) -> int | None:
        return next((i for i, c in enumerate(self.chunks) if c.get("finish_reason")), None)

    @property
    def terminal(self) -> TokenChunk | None:
        i = self.terminal_index
        return None if i is None else self.chunks[i]

    @property
    def finish_reason(self) -> str | None:
        t = self.terminal
        return None if t is None else t.get("finish_reason")

    @property
    def tokens(self) -> list[int]:
        """Token ids up to and including the terminal chunk."""
        i = self.terminal_index
        upto = self.chunks if i is None else self.chunks[: i + 1]
        return [t for c in upto for t in c.get("token_ids", ())]

    @property
    def after_terminal(self) -> list[TokenChunk]:
        i = self.terminal_index
        return [] if i is None else self.chunks[i + 1 :]


def factory_for(cls: type[LLMEngine], argv: Sequence[str] = ()) -> EngineFactory:
    """An engine factory calling `cls.from_args(argv)` and dropping the WorkerConfig."""

    async def make() -> LLMEngine:
        result = await cls.from_args(list(argv))
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], WorkerConfig)):
            raise TypeError(f"{cls.__name__}.from_args must return (engine, WorkerConfig), got {result!r}")
        if not isinstance(result[0], cls):
            raise TypeError(f"{cls.__name__}.from_args returned {type(result[0]).__name__}, not a {cls.__name__}")
        return result[0]

    return make


# ------------------------------------------------------------------ helpers


@dataclass(frozen=True, slots=True)
class SharedEngine:
    """One started engine (with a RecordingSink) that several clauses' checks use in turn, and what start() returned."""

    engine: LLMEngine
    config: Any


class _Probe:
    """One check's view of one engine: every call timed out and attributed to `clause`."""

    def __init__(self, clause: Clause, options: ConformanceOptions, notes: list[str], shared: SharedEngine | None = None) -> None:
        self.clause = clause
        self.options = options
        self.notes = notes
        self.shared = shared
        self._n = 0

    def fail(self, message: str) -> ConformanceError:
        return ConformanceError(self.clause, message)

    def skip(self, reason: str) -> NotApplicable:
        return NotApplicable(reason)

    async def call(self, what: str, awaitable: Awaitable[Any], limit_s: float | None = None) -> Any:
        """Await an engine call; a timeout or an exception fails the clause."""
        limit = self.options.timeout_s if limit_s is None else limit_s
        try:
            async with asyncio.timeout(limit):
                return await awaitable
        except TimeoutError:
            raise self.fail(f"{what} did not return within {limit:g} s") from None
        except ConformanceError:
            raise
        except Exception as exc:
            raise self.fail(f"{what} raised {type(exc).__name__}: {exc}") from exc

    def request(self, *, prompt: Sequence[int] | None = None, **stop: Any) -> TokenRequest:
        self._n += 1
        req: TokenRequest = {
            "request_id": f"conformance-{self.clause}-{self._n}",
            "token_ids": list(self.options.prompt if prompt is None else prompt),
            "sampling": {"temperature": 0.0, "seed": 0},
        }
        if stop:
            req["stop"] = stop  # type: ignore[typeddict-item]
        return req

    async def stream(self, engine: LLMEngine, request: TokenRequest, *, to_end: bool = False) -> Stream:
        """Run one request; read to its terminal chunk (to the iterator's end if `to_end`)."""
        out = Stream()
        it = engine.generate(request, Context(request["request_id"]))

        async def read() -> None:
            async for chunk in it:
                out.chunks.append(chunk)
                if chunk.get("finish_reason") and not to_end:
                    return
                if len(out.after_terminal) > 16:
                    return  # enough to show the stream did not end
            out.ended = True

        try:
            await self.call(f"generate({request['request_id']})", read())
        finally:
            await _close(it)
        return out

    @asynccontextmanager
    async def started(self, factory: EngineFactory) -> AsyncIterator[LLMEngine]:
        """A fresh engine with a RecordingSink, started, and cleaned up afterwards (or the shared engine, left running)."""
        if self.shared is not None:
            yield self.shared.engine
            return
        engine = await self.new_engine(factory)
        try:
            await self.call("start()", engine.start(f"conformance-{self.clause}"), self.options.start_timeout_s)
            yield engine
        finally:
            await self.cleanup_quietly(engine)

    async def cleanup_quietly(self, engine: LLMEngine) -> None:
        """Clean up after a check; a failure is another clause's business, so only note it."""
        try:
            async with asyncio.timeout(self.options.timeout_s):
                await engine.cleanup()
        except Exception as exc:
            self.notes.append(f"cleanup() after the check raised {type(exc).__name__}: {exc}")

    async def new_engine(self, factory: EngineFactory) -> LLMEngine:
        engine = await self.call("the engine factory", factory(), self.options.start_timeout_s)
        if not isinstance(engine, LLMEngine):
            raise self.fail(f"the factory returned {type(engine).__name__}, not an LLMEngine")
        engine.sink = RecordingSink()
        return engine


async def _close(it: Any) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        try:
            async with asyncio.timeout(5.0):
                await aclose()
        except Exception:  # the stream's own clause reports its faults
            pass


def _require_terminal(p: _Probe, s: Stream, what: str) -> TokenChunk:
    terminal = s.terminal
    if terminal is None:
        raise p.fail(f"{what}: the stream ended after {len(s.chunks)} chunk(s) without a terminal chunk")
    return terminal

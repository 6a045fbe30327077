"""The engine conformance kit: plain async checks of every `LLMEngine` clause.

Usable without pytest:

    report = await run_conformance(factory_for(MyEngine, ["--my-flag", "x"]))
    print(report.summary())
    report.raise_if_failed()

or from the command line, `python -m meshllm.testing.conformance mypkg.engine:MyEngine -- --my-flag x`,
or through the pytest plugin, `pytest --meshllm-engine mypkg.engine:MyEngine`.

Every check takes an *engine factory* (an async callable returning a fresh,
constructed-but-not-started engine), builds its own engine, gives it a
`RecordingSink`, and cleans it up afterwards, so a broken clause fails only its
own check. A check raises `ConformanceError(clause, message)`; every engine call
runs under a timeout, so a hanging engine fails a check instead of hanging the kit.

Assumption about outputs: the kit never predicts token ids. It requests greedy
decoding (temperature 0, seed 0) and learns the engine's output by running a
request first. Where a clause compares two runs (stop tokens, concurrent
streams) and the engine does not reproduce its own output, the check falls back
to the properties that hold for any output (the stop token is never emitted;
every stream ends with a proper terminal) and records a note saying so.
"""

from __future__ import annotations

import asyncio
import enum
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any

from meshllm.engine.base import Context, EngineConfig, LLMEngine, LoadMetrics, WorkerConfig
from meshllm.errors import InvalidArgument
from meshllm.protocol.types import FINISH_REASONS, GenerateChunk, GenerateRequest

__all__ = [
    "CHECKS",
    "CheckResult",
    "Clause",
    "ConformanceError",
    "ConformanceOptions",
    "ConformanceReport",
    "EngineFactory",
    "RecordingSink",
    "Stream",
    "factory_for",
    "options_from_strings",
    "run_check",
    "run_conformance",
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
}


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


@dataclass
class RecordingSink:
    """An EngineSink that records everything (the kit sets one before `start`)."""

    stored: list[tuple[list[tuple[int, int]], int | None, int]] = field(default_factory=list)
    removed: list[tuple[list[int], int]] = field(default_factory=list)
    cleared: list[int] = field(default_factory=list)
    loads: list[LoadMetrics] = field(default_factory=list)

    def blocks_stored(self, blocks: Sequence[tuple[int, int]], parent_hash: int | None, dp_rank: int = 0) -> None:
        self.stored.append(([(int(b), int(t)) for b, t in blocks], parent_hash, dp_rank))

    def blocks_removed(self, block_hashes: Sequence[int], dp_rank: int = 0) -> None:
        self.removed.append((list(block_hashes), dp_rank))

    def all_cleared(self, dp_rank: int = 0) -> None:
        self.cleared.append(dp_rank)

    def load(self, metrics: LoadMetrics) -> None:
        self.loads.append(metrics)


@dataclass
class Stream:
    """Every chunk one generate call produced, split at its first terminal chunk."""

    chunks: list[GenerateChunk] = field(default_factory=list)
    ended: bool = False  # the iterator was exhausted (not just abandoned)

    @property
    def terminal_index(self) -> int | None:
        return next((i for i, c in enumerate(self.chunks) if c.get("finish_reason")), None)

    @property
    def terminal(self) -> GenerateChunk | None:
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
    def after_terminal(self) -> list[GenerateChunk]:
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


class _Probe:
    """One check's view of one engine: every call timed out and attributed to `clause`."""

    def __init__(self, clause: Clause, options: ConformanceOptions, notes: list[str]) -> None:
        self.clause = clause
        self.options = options
        self.notes = notes
        self._n = 0

    def fail(self, message: str) -> ConformanceError:
        return ConformanceError(self.clause, message)

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

    def request(self, *, prompt: Sequence[int] | None = None, **stop: Any) -> GenerateRequest:
        self._n += 1
        req: GenerateRequest = {
            "request_id": f"conformance-{self.clause}-{self._n}",
            "token_ids": list(self.options.prompt if prompt is None else prompt),
            "sampling": {"temperature": 0.0, "seed": 0},
        }
        if stop:
            req["stop"] = stop  # type: ignore[typeddict-item]
        return req

    async def stream(self, engine: LLMEngine, request: GenerateRequest, *, to_end: bool = False) -> Stream:
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
        """A fresh engine with a RecordingSink, started, and cleaned up afterwards."""
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


def _require_terminal(p: _Probe, s: Stream, what: str) -> GenerateChunk:
    terminal = s.terminal
    if terminal is None:
        raise p.fail(f"{what}: the stream ended after {len(s.chunks)} chunk(s) without a terminal chunk")
    return terminal


# ------------------------------------------------------------------ checks


async def check_start_config(factory: EngineFactory, p: _Probe) -> None:
    engine = await p.new_engine(factory)
    try:
        cfg = await p.call("start()", engine.start("conformance-start"), p.options.start_timeout_s)
    finally:
        await p.cleanup_quietly(engine)
    if not isinstance(cfg, EngineConfig):
        raise p.fail(f"start() returned {type(cfg).__name__} ({cfg!r:.80}), not an EngineConfig")
    if not isinstance(cfg.model, str) or not cfg.model.strip():
        raise p.fail(f"EngineConfig.model must be a non-empty name, got {cfg.model!r}")
    for name in ("kv_block_size", "total_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "context_length"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 0:
            raise p.fail(f"EngineConfig.{name} must be an int >= 0 (0 = unknown), got {value!r}")
    if not all(isinstance(t, int) for t in cfg.eos_token_ids):
        raise p.fail(f"EngineConfig.eos_token_ids must be ints, got {cfg.eos_token_ids!r}")


async def check_basic_generate(factory: EngineFactory, p: _Probe) -> None:
    async with p.started(factory) as engine:
        s = await p.stream(engine, p.request(max_tokens=p.options.max_tokens))
    terminal = _require_terminal(p, s, "a basic request")
    for chunk in s.chunks[: s.terminal_index]:
        if "usage" in chunk or "error" in chunk:
            raise p.fail(f"a non-terminal chunk carries usage or error: {chunk!r}")
    for chunk in s.chunks[: (s.terminal_index or 0) + 1]:
        ids = chunk.get("token_ids", [])
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise p.fail(f"token_ids must be a list of ints, got {ids!r:.120}")
    if not s.tokens:
        raise p.fail("the stream yielded no tokens")
    reason = s.finish_reason
    if reason not in FINISH_REASONS or reason in ("cancelled", "error"):
        raise p.fail(f'finish_reason {reason!r} for a plain request (expected "length", "eos" or "stop")')
    usage: dict[str, Any] | None = terminal.get("usage")  # type: ignore[assignment]
    keys = ("prompt_tokens", "completion_tokens", "cached_tokens")
    if not isinstance(usage, dict) or not all(isinstance(usage.get(k), int) and usage[k] >= 0 for k in keys):
        raise p.fail(f"the terminal chunk needs usage with int prompt/completion/cached tokens, got {usage!r}")
    if usage["completion_tokens"] != len(s.tokens):
        raise p.fail(f"usage.completion_tokens is {usage['completion_tokens']} but {len(s.tokens)} tokens were emitted")
    if usage["cached_tokens"] > usage["prompt_tokens"]:
        raise p.fail(f"usage.cached_tokens {usage['cached_tokens']} exceeds prompt_tokens {usage['prompt_tokens']}")


async def check_nothing_after_terminal(factory: EngineFactory, p: _Probe) -> None:
    async with p.started(factory) as engine:
        for max_tokens in (p.options.max_tokens, 1):
            s = await p.stream(engine, p.request(max_tokens=max_tokens), to_end=True)
            _require_terminal(p, s, f"max_tokens={max_tokens}")
            if s.after_terminal:
                raise p.fail(
                    f"max_tokens={max_tokens}: {len(s.after_terminal)} chunk(s) after the terminal chunk, "
                    f"first {s.after_terminal[0]!r}"
                )
            if not s.ended:
                raise p.fail(f"max_tokens={max_tokens}: the iterator did not end after the terminal chunk")


async def check_max_tokens_length(factory: EngineFactory, p: _Probe) -> None:
    async with p.started(factory) as engine:
        for n in (1, max(2, p.options.max_tokens // 2 + 1)):
            s = await p.stream(engine, p.request(max_tokens=n, ignore_eos=True))
            _require_terminal(p, s, f"max_tokens={n}")
            if s.finish_reason != "length" or len(s.tokens) != n:
                raise p.fail(
                    f'max_tokens={n}, ignore_eos: expected "length" after {n} tokens, '
                    f"got {s.finish_reason!r} after {len(s.tokens)}"
                )


async def check_stop_token_ids_stop(factory: EngineFactory, p: _Probe) -> None:
    async with p.started(factory) as engine:
        n = p.options.max_tokens
        ref = await p.stream(engine, p.request(max_tokens=n, ignore_eos=True))
        _require_terminal(p, ref, "the reference run")
        if not ref.tokens:
            raise p.fail("the reference run yielded no tokens to choose a stop token from")
        stop_token = ref.tokens[min(2, len(ref.tokens) - 1)]
        expected = ref.tokens[: ref.tokens.index(stop_token)]
        s = await p.stream(engine, p.request(max_tokens=n, ignore_eos=True, stop_token_ids=[stop_token]))
    _require_terminal(p, s, f"stop_token_ids=[{stop_token}]")
    if stop_token in s.tokens:
        raise p.fail(f"stop_token_ids=[{stop_token}]: the stop token was emitted ({s.tokens})")
    if s.tokens == expected:
        if s.finish_reason != "stop":
            raise p.fail(f'stop_token_ids=[{stop_token}] hit after {expected}: expected "stop", got {s.finish_reason!r}')
    elif s.tokens[: len(expected)] == expected:
        raise p.fail(f"stop_token_ids=[{stop_token}]: expected the stream to stop after {expected}, got {s.tokens}")
    else:
        p.notes.append(f"greedy output not reproducible ({ref.tokens} then {s.tokens}); checked only that no stop token came")


async def check_cancellation(factory: EngineFactory, p: _Probe) -> None:
    async with p.started(factory) as engine:
        req = p.request(max_tokens=p.options.long_max_tokens, ignore_eos=True)
        context = Context(req["request_id"])
        it = engine.generate(req, context)
        chunks: list[GenerateChunk] = []
        try:
            first = await p.call("generate() before the first chunk", anext(aiter(it)))
            chunks.append(first)
            if first.get("finish_reason"):
                raise p.fail(
                    f"the stream ended ({first.get('finish_reason')!r}) before it could be stopped; "
                    "raise ConformanceOptions.long_max_tokens"
                )
            context.stop()
            stopped_at = time.monotonic()
            limit = p.options.cancel_within_s
            try:
                async with asyncio.timeout(limit):
                    async for chunk in it:
                        chunks.append(chunk)
                        if chunk.get("finish_reason"):
                            break
            except TimeoutError:
                raise p.fail(f"no terminal chunk within {limit:g} s of context.stop()") from None
            except Exception as exc:
                raise p.fail(f"after context.stop() generate raised {type(exc).__name__}: {exc}") from exc
        finally:
            await _close(it)
        elapsed = time.monotonic() - stopped_at
        reason = chunks[-1].get("finish_reason")
        if reason is None:
            raise p.fail("after context.stop() the stream ended without a terminal chunk")
        if reason != "cancelled":
            raise p.fail(f'after context.stop() the stream ended with {reason!r}, expected "cancelled"')
        if elapsed > limit:
            raise p.fail(f'the "cancelled" terminal came {elapsed:.2f} s after context.stop() (limit {limit:g} s)')


async def check_concurrent_streams(factory: EngineFactory, p: _Probe) -> None:
    o = p.options
    requests = [p.request(prompt=[*o.prompt, 100 + k], max_tokens=o.max_tokens, ignore_eos=True) for k in range(o.concurrency)]
    async with p.started(factory) as engine:
        serial = [await p.stream(engine, r) for r in requests]
        again = await p.stream(engine, requests[0])
        streams = await asyncio.gather(*(p.stream(engine, r) for r in requests))
    compare = o.compare_concurrent_outputs and again.tokens == serial[0].tokens
    if o.compare_concurrent_outputs and not compare:
        p.notes.append("greedy output not reproducible; concurrent outputs not compared with serial ones")
    for k, (ref, s) in enumerate(zip(serial, streams, strict=True)):
        _require_terminal(p, s, f"concurrent stream {k}")
        if s.finish_reason in ("cancelled", "error"):
            raise p.fail(f"concurrent stream {k} of {o.concurrency} ended with {s.finish_reason!r}")
        if compare and (s.tokens, s.finish_reason) != (ref.tokens, ref.finish_reason):
            raise p.fail(
                f"concurrent stream {k} of {o.concurrency} gave {s.tokens} ({s.finish_reason!r}); "
                f"alone the same request gave {ref.tokens} ({ref.finish_reason!r})"
            )


async def check_drain(factory: EngineFactory, p: _Probe) -> None:
    async with p.started(factory) as engine:
        await p.stream(engine, p.request(max_tokens=p.options.max_tokens))
        await p.call("drain()", engine.drain())


async def check_cleanup_without_start(factory: EngineFactory, p: _Probe) -> None:
    engine = await p.new_engine(factory)
    await p.call("cleanup() without start()", engine.cleanup())


async def check_cleanup_twice(factory: EngineFactory, p: _Probe) -> None:
    engine = await p.new_engine(factory)
    await p.call("start()", engine.start("conformance-cleanup"), p.options.start_timeout_s)
    await p.stream(engine, p.request(max_tokens=p.options.max_tokens))
    await p.call("cleanup()", engine.cleanup())
    await p.call("a second cleanup()", engine.cleanup())
    other = await p.new_engine(factory)
    await p.call("start()", other.start("conformance-cleanup-2"), p.options.start_timeout_s)
    await p.call("two concurrent cleanup() calls", asyncio.gather(other.cleanup(), other.cleanup()))


async def check_empty_prompt_invalid_argument(factory: EngineFactory, p: _Probe) -> None:
    async with p.started(factory) as engine:
        req = p.request(prompt=[], max_tokens=p.options.max_tokens)
        it: Any = None
        try:
            it = engine.generate(req, Context(req["request_id"]))
            async with asyncio.timeout(p.options.timeout_s):
                chunk = await anext(aiter(it))
        except InvalidArgument:
            return
        except StopAsyncIteration:
            raise p.fail("an empty prompt ended the stream without raising InvalidArgument") from None
        except TimeoutError:
            raise p.fail(f"an empty prompt neither raised nor yielded within {p.options.timeout_s:g} s") from None
        except Exception as exc:
            raise p.fail(f"an empty prompt raised {type(exc).__name__} ({exc}), expected InvalidArgument") from exc
        finally:
            await _close(it)
        raise p.fail(f"an empty prompt yielded {chunk!r} instead of raising InvalidArgument")


CheckFn = Callable[[EngineFactory, _Probe], Awaitable[None]]

#: Clause -> check, in the order `run_conformance` runs them.
CHECKS: dict[Clause, CheckFn] = {
    Clause.START_CONFIG: check_start_config,
    Clause.BASIC_GENERATE: check_basic_generate,
    Clause.NOTHING_AFTER_TERMINAL: check_nothing_after_terminal,
    Clause.MAX_TOKENS_LENGTH: check_max_tokens_length,
    Clause.STOP_TOKEN_IDS_STOP: check_stop_token_ids_stop,
    Clause.CANCELLATION: check_cancellation,
    Clause.CONCURRENT_STREAMS: check_concurrent_streams,
    Clause.DRAIN: check_drain,
    Clause.CLEANUP_WITHOUT_START: check_cleanup_without_start,
    Clause.CLEANUP_TWICE: check_cleanup_twice,
    Clause.EMPTY_PROMPT_INVALID_ARGUMENT: check_empty_prompt_invalid_argument,
}


# ------------------------------------------------------------------ running


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The outcome of one clause's check."""

    clause: Clause
    error: ConformanceError | None
    duration_s: float
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class ConformanceReport:
    """Every clause's result, in order."""

    results: tuple[CheckResult, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failed(self) -> list[Clause]:
        return [r.clause for r in self.results if not r.passed]

    def result(self, clause: Clause | str) -> CheckResult:
        return next(r for r in self.results if r.clause == clause)

    def summary(self) -> str:
        lines = []
        for r in self.results:
            head = f"{'PASS' if r.passed else 'FAIL'} {r.clause:<30} {r.duration_s:6.2f} s"
            lines.append(head if r.error is None else f"{head}  {r.error}")
            lines.extend(f"     note: {n}" for n in r.notes)
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        errors = [r.error for r in self.results if r.error is not None]
        if errors:
            raise ExceptionGroup(f"{len(errors)} conformance clause(s) failed", errors)


async def run_check(clause: Clause | str, factory: EngineFactory, options: ConformanceOptions | None = None) -> CheckResult:
    """Run one clause's check; failures are returned, never raised."""
    clause = Clause(clause)
    notes: list[str] = []
    probe = _Probe(clause, options or ConformanceOptions(), notes)
    t0 = time.monotonic()
    error: ConformanceError | None = None
    try:
        await CHECKS[clause](factory, probe)
    except ConformanceError as exc:
        error = exc if exc.clause is clause else ConformanceError(clause, str(exc))
    except Exception as exc:
        error = ConformanceError(clause, f"unexpected {type(exc).__name__}: {exc}")
    return CheckResult(clause, error, time.monotonic() - t0, tuple(notes))


async def run_conformance(
    factory: EngineFactory,
    options: ConformanceOptions | None = None,
    *,
    clauses: Sequence[Clause | str] | None = None,
) -> ConformanceReport:
    """Run the checks of `clauses` (default: all) one after another against fresh engines."""
    chosen = list(CHECKS) if clauses is None else [Clause(c) for c in clauses]
    return ConformanceReport(tuple([await run_check(c, factory, options) for c in chosen]))


def options_from_strings(pairs: Sequence[str], base: ConformanceOptions | None = None) -> ConformanceOptions:
    """Apply `NAME=VALUE` overrides (e.g. "timeout_s=5") to ConformanceOptions."""
    base = base or ConformanceOptions()
    types = {f.name: type(getattr(base, f.name)) for f in fields(base)}
    changes: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or name not in types:
            raise ValueError(f"conformance option {pair!r}: expected NAME=VALUE with NAME in {', '.join(types)}")
        kind = types[name]
        if kind is bool:
            changes[name] = raw.strip().lower() in ("1", "true", "yes", "on")
        elif kind is tuple:
            changes[name] = tuple(int(t) for t in raw.replace(",", " ").split())
        else:
            changes[name] = kind(raw)
    return replace(base, **changes)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m meshllm.testing.conformance module:Class [-- engine flags]`: print the report."""
    from meshllm.config import ConfigError
    from meshllm.engine import load_engine_class

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        print("usage: python -m meshllm.testing.conformance NAME|module:Class [-- engine flags]", file=sys.stderr)
        return 2
    try:
        cls = load_engine_class(args[0])
    except ConfigError as exc:
        print(f"meshllm conformance: error: {exc.message}", file=sys.stderr)
        return 2
    engine_args = args[2:] if args[1:2] == ["--"] else args[1:]
    report = asyncio.run(run_conformance(factory_for(cls, engine_args)))
    print(report.summary())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())

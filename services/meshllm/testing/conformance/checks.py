"""One async check per clause of the LLMEngine contract."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from meshllm.engine.base import Context, EngineConfig
from meshllm.errors import InvalidArgument
from meshllm.protocol.types import FINISH_REASONS, TokenChunk
from meshllm.testing.conformance.kit import (
    Clause,
    EngineFactory,
    _close,
    _Probe,
    _require_terminal,
)
from meshllm.testing.conformance.tier_checks import check_kv_tier_restore, check_kv_tier_restore_output

# ------------------------------------------------------------------ checks


async def check_start_config(factory: EngineFactory, p: _Probe) -> None:
    if p.shared is not None:
        cfg = p.shared.config
    else:
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
        chunks: list[TokenChunk] = []
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
    Clause.KV_TIER_RESTORE: check_kv_tier_restore,
    Clause.KV_TIER_RESTORE_OUTPUT: check_kv_tier_restore_output,
}

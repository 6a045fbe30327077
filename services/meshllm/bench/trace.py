"""Mooncake request traces as replayable requests: each hash id becomes a deterministic run of token ids, scaled.

A trace file holds one JSON object per line (Mooncake FAST'25 format, see
/work/shared/traces/mooncake/README.md)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

`timestamp` is the arrival in milliseconds, `hash_ids` are the prompt's
blocks of `source_block_tokens` (512) tokens, the last one cut to
`input_length`. `load_trace` turns each row into a `TraceRequest`:

- every hash id becomes its own run of `tokens_per_block` token ids, drawn
  from [token_offset, vocab_size) by BLAKE2b of (seed, hash id): equal ids
  give equal runs on every machine, so the trace's prefix sharing survives;
  the offset keeps the ids clear of the special tokens at the bottom of
  every vocabulary (the default range suits the mocker, Llama-2 and larger
  vocabularies);
- the last block is cut in proportion: a row whose last block holds 100 of
  512 tokens ends with ceil(100 × 16 / 512) = 4 tokens of its run;
- then the caps apply (`max_isl` cuts the prompt, `max_osl` the output);
- arrivals are counted from the first selected row and divided by `speedup`.

Output lengths are not scaled (only capped); `max_tokens` is the row's
`output_length`. `TraceScale.describe()` is the one-line statement of the
scaling to print next to every figure measured on a scaled trace.
"""

from __future__ import annotations

import hashlib
import math
import random
import statistics
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from meshllm.protocol.types import TokenRequest

__all__ = [
    "TraceRequest",
    "TraceScale",
    "TraceStats",
    "hash_id_tokens",
    "load_trace",
    "sample_sessions",
    "token_arrivals",
    "trace_stats",
    "unbounded_hits",
]

_SIXTEEN_U32 = struct.Struct("<16I")


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceScale:
    """How a trace is shrunk to fit the machine; validated when built (ValueError names the flag)."""

    tokens_per_block: int = 16  # tokens each hash id becomes
    source_block_tokens: int = 512  # tokens per hash id in the trace (Mooncake: 512)
    speedup: float = 1.0  # arrival times are divided by this
    limit: int | None = None  # keep the first N rows (after the time window)
    start_s: float = 0.0  # time window in trace seconds (before the speed-up): rows with start_s <= t ...
    duration_s: float | None = None  # ... < start_s + duration_s
    max_isl: int | None = None  # cap on the scaled prompt length (tokens)
    max_osl: int | None = None  # cap on max_tokens
    token_offset: int = 1000  # token ids are drawn from [token_offset, vocab_size)
    vocab_size: int = 32000
    seed: int = 0  # different seeds give different runs (equal ids still give equal runs)

    def __post_init__(self) -> None:
        if self.tokens_per_block < 1:
            raise ValueError("--trace-tokens-per-block must be >= 1")
        if self.source_block_tokens < 1:
            raise ValueError("the trace's block size must be >= 1")
        if not self.speedup > 0 or math.isinf(self.speedup):
            raise ValueError("--trace-speedup must be a finite number > 0")
        if self.limit is not None and self.limit < 1:
            raise ValueError("--trace-limit must be >= 1")
        if not self.start_s >= 0:
            raise ValueError("--trace-start must be >= 0")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("--trace-duration must be > 0")
        if self.max_isl is not None and self.max_isl < 1:
            raise ValueError("--trace-max-isl must be >= 1")
        if self.max_osl is not None and self.max_osl < 1:
            raise ValueError("--trace-max-osl must be >= 1")
        if not 0 <= self.token_offset < self.vocab_size:
            raise ValueError("token ids need 0 <= --trace-token-offset < --trace-vocab-size")

    def describe(self) -> str:
        """One line stating every scaling applied, e.g. to print above a results table."""
        parts = [f"1 hash id = {self.tokens_per_block} tokens (trace: {self.source_block_tokens})"]
        parts.append(f"arrivals {self.speedup:g}× faster" if self.speedup != 1 else "arrivals at trace speed")
        if self.start_s or self.duration_s is not None:
            end = f"{self.start_s + self.duration_s:g}" if self.duration_s is not None else "end"
            parts.append(f"trace window {self.start_s:g}–{end} s")
        if self.limit is not None:
            parts.append(f"first {self.limit:,} rows")
        parts.append(f"input ≤ {self.max_isl:,} tokens" if self.max_isl is not None else "input uncapped")
        parts.append(f"output ≤ {self.max_osl:,} tokens" if self.max_osl is not None else "output unscaled")
        parts.append(f"token ids in [{self.token_offset}, {self.vocab_size}), seed {self.seed}")
        return "scaled trace: " + ", ".join(parts)


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceRequest:
    """One scaled trace row, ready to send.

    `index` is the row's 0-based line number among the trace's rows;
    `arrival_s` the scaled arrival, 0 for the first selected row;
    `hash_ids` the row's hash ids that the (capped) prompt still covers;
    `block_lengths[i]` how many tokens of `hash_ids[i]`'s run the prompt
    holds (`tokens_per_block`, except maybe for the last).
    """

    index: int
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    hash_ids: tuple[int, ...]
    block_lengths: tuple[int, ...]


def hash_id_tokens(hash_id: int, scale: TraceScale) -> tuple[int, ...]:
    """The run of `scale.tokens_per_block` token ids that `hash_id` becomes (the same on every machine and Python)."""
    offset, span, n = scale.token_offset, scale.vocab_size - scale.token_offset, scale.tokens_per_block
    out: list[int] = []
    for counter in range((n + 15) // 16):  # one 64-byte digest = 16 draws of 32 bits (modulo bias < 1e-5)
        digest = hashlib.blake2b(f"{scale.seed}:{hash_id}:{counter}".encode(), digest_size=64).digest()
        out.extend(offset + v % span for v in _SIXTEEN_U32.unpack(digest))
    return tuple(out[:n])


def _rows(lines: Iterable[bytes], name: str) -> Iterable[tuple[int, int, int, int, list[int]]]:
    """(row index, timestamp ms, input_length, output_length, hash_ids) for each non-blank line."""
    index = 0
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
            ts, isl, osl, ids = row["timestamp"], row["input_length"], row["output_length"], row["hash_ids"]
            if not all(isinstance(v, int) for v in (ts, isl, osl, *ids)) or not ids or isl < 1 or osl < 1:
                raise ValueError("fields must be integers, lengths >= 1, hash_ids non-empty")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{name}:{lineno}: not a Mooncake trace row ({exc})") from None
        yield index, ts, isl, osl, ids
        index += 1


def load_trace(path: str | Path, scale: TraceScale = TraceScale()) -> list[TraceRequest]:
    """The scaled requests of a Mooncake JSONL trace, in arrival order (see the module docstring).

    Raises ValueError naming the file and line for a malformed row, OSError when
    the file cannot be read. An empty selection returns [].
    """
    path = Path(path)
    runs: dict[int, tuple[int, ...]] = {}
    out: list[TraceRequest] = []
    first_ms: int | None = None
    lo_ms = scale.start_s * 1000.0
    hi_ms = math.inf if scale.duration_s is None else lo_ms + scale.duration_s * 1000.0
    src, per = scale.source_block_tokens, scale.tokens_per_block
    with path.open("rb") as f:
        for index, ts, isl, osl, ids in _rows(f, path.name):
            if ts < lo_ms:
                continue
            if ts >= hi_ms or (scale.limit is not None and len(out) >= scale.limit):
                break  # rows are in arrival order
            last = min(max(isl - src * (len(ids) - 1), 1), src)  # source tokens in the last block
            lengths = [per] * (len(ids) - 1) + [math.ceil(last * per / src)]
            if scale.max_isl is not None:
                lengths = _cap(lengths, scale.max_isl)
            prompt: list[int] = []
            for hid, n in zip(ids, lengths, strict=False):
                run = runs.get(hid)
                if run is None:
                    run = runs[hid] = hash_id_tokens(hid, scale)
                prompt.extend(run[:n])
            first_ms = ts if first_ms is None else first_ms
            out.append(
                TraceRequest(
                    index=index,
                    arrival_s=(ts - first_ms) / 1000.0 / scale.speedup,
                    prompt_token_ids=tuple(prompt),
                    max_tokens=osl if scale.max_osl is None else min(osl, scale.max_osl),
                    hash_ids=tuple(ids[: len(lengths)]),
                    block_lengths=tuple(lengths),
                )
            )
    return out


def _cap(lengths: list[int], max_tokens: int) -> list[int]:
    out: list[int] = []
    total = 0
    for n in lengths:
        if total + n >= max_tokens:
            out.append(max_tokens - total)
            break
        out.append(n)
        total += n
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceStats:
    """What a scaled selection holds; `reuse_ceiling` bounds any prefix-cache hit rate on it."""

    requests: int
    span_s: float  # scaled arrival of the last request
    prompt_tokens: int
    output_tokens: int
    unique_hash_ids: int
    reuse_ceiling: float  # reusable prompt tokens / prompt tokens, with an unbounded cache
    # Median over requests of the tokens left to compute with an unbounded
    # cache, over the median prompt: how far prefix caching alone can lower
    # the median prefill (TTFT p50 at zero load) against no caching at all.
    p50_prefill_floor: float = 1.0

    def describe(self) -> str:
        n = max(self.requests, 1)
        return (
            f"{self.requests:,} requests over {self.span_s:,.1f} s, mean input {self.prompt_tokens / n:,.0f} / "
            f"output {self.output_tokens / n:,.0f} tokens, {self.unique_hash_ids:,} distinct blocks, "
            f"prefix-reuse ceiling {self.reuse_ceiling:.1%}, median prefill floor {self.p50_prefill_floor:.2f}× "
            "the median prompt (unbounded caches)"
        )


def trace_stats(requests: Sequence[TraceRequest]) -> TraceStats:
    """Counts of a selection, and the hit rate an unbounded prefix cache would reach on it.

    A block is reusable when it and every block before it were seen in an
    earlier request (caches match prefixes; hash ids encode their prefix). The
    ceiling counts those blocks' tokens at hash-id granularity: it is exact
    for an engine whose KV block size divides `tokens_per_block`, and an upper
    bound otherwise (an engine caches only whole blocks of its own size).
    """
    hits = unbounded_hits(requests)
    left = [len(r.prompt_token_ids) - h for r, h in zip(requests, hits, strict=True)]
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    return TraceStats(
        requests=len(requests),
        span_s=requests[-1].arrival_s if requests else 0.0,
        prompt_tokens=prompt,
        output_tokens=sum(r.max_tokens for r in requests),
        unique_hash_ids=len({h for r in requests for h in r.hash_ids}),
        reuse_ceiling=sum(hits) / prompt if prompt else 0.0,
        p50_prefill_floor=_median(left) / _median([len(r.prompt_token_ids) for r in requests]) if prompt else 1.0,
    )


def unbounded_hits(requests: Sequence[TraceRequest]) -> list[int]:
    """Per request, the prompt tokens an unbounded prefix cache would serve (see `trace_stats`)."""
    seen: dict[int, int] = {}  # hash id -> most of its run any earlier prompt held
    out = []
    for r in requests:
        hit = 0
        for hid, n in zip(r.hash_ids, r.block_lengths, strict=True):
            got = seen.get(hid, 0)
            hit += min(n, got)
            if got < n:
                break
        out.append(hit)
        for hid, n in zip(r.hash_ids, r.block_lengths, strict=True):
            seen[hid] = max(seen.get(hid, 0), n)
    return out


def _median(values: list[int]) -> float:
    return float(statistics.median(values)) if values else 0.0


def sample_sessions(requests: Sequence[TraceRequest], keep: float, *, seed: int = 0) -> list[TraceRequest]:
    """A seeded sample of whole sessions: each session is kept with probability `keep`, all its requests or none.

    A session is the requests sharing their second hash id (the first is the
    trace's shared system block), so a kept conversation keeps every turn
    that returns to its prefix; a one-block request is its own session.
    """
    rng = random.Random(seed)
    kept: dict[int, bool] = {}
    out = []
    for r in requests:
        key = r.hash_ids[1] if len(r.hash_ids) > 1 else -1 - r.index
        if key not in kept:
            kept[key] = rng.random() < keep
        if kept[key]:
            out.append(r)
    return out


def token_arrivals(requests: Sequence[TraceRequest], model: str) -> list[tuple[float, TokenRequest]]:
    """(seconds after the first arrival, the token-level request) per trace request, ids `m<row>`."""
    t0 = requests[0].arrival_s if requests else 0.0
    return [
        (
            r.arrival_s - t0,
            {
                "request_id": f"m{r.index}",
                "model": model,
                "token_ids": list(r.prompt_token_ids),
                "stop": {"max_tokens": r.max_tokens, "ignore_eos": True},
            },
        )
        for r in requests
    ]

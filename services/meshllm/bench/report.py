"""What `meshllm bench` measured: per-request records, per-concurrency summaries, the table, JSON and plot.

Definitions: TTFT = request sent → first event with text; ITL = the gaps
between successive events with text, pooled over every request (a server
that coalesces tokens under load sends fewer, larger events; TPOT, the mean
time per output token after the first, is reported beside it, and
`events_per_request` is the mean number of events with text per successful
response); output tok/s = completion tokens the server counted (usage) /
wall time of the level.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["LevelResult", "RequestRecord", "format_table", "percentile", "plot", "summarize"]


@dataclass(slots=True)
class RequestRecord:
    """One request's timings (seconds) and token counts."""

    ttft: float | None = None
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the endpoint reports it
    events: int = 0  # SSE events that carried text
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(frozen=True, kw_only=True, slots=True)
class LevelResult:
    """The summary of one concurrency level (times in milliseconds)."""

    concurrency: int
    requests: int
    errors: int
    duration_s: float
    req_per_s: float
    output_tok_per_s: float
    input_tok_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tpot_mean_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    mean_isl: float
    mean_osl: float
    first_error: str | None = None
    ttft_p90_ms: float = math.nan
    itl_p90_ms: float = math.nan
    events_per_request: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def summarize(concurrency: int, records: Sequence[RequestRecord], duration_s: float) -> LevelResult:
    ok = [r for r in records if r.error is None]
    errors = [r for r in records if r.error is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    tpots = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.ttft is not None and r.completion_tokens > 1]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ms = 1000.0
    return LevelResult(
        concurrency=concurrency,
        requests=len(records),
        errors=len(errors),
        duration_s=duration_s,
        req_per_s=len(ok) / duration_s if duration_s > 0 else math.nan,
        output_tok_per_s=out_tokens / duration_s if duration_s > 0 else math.nan,
        input_tok_per_s=in_tokens / duration_s if duration_s > 0 else math.nan,
        ttft_p50_ms=percentile(ttfts, 50) * ms,
        ttft_p99_ms=percentile(ttfts, 99) * ms,
        itl_p50_ms=percentile(gaps, 50) * ms,
        itl_p99_ms=percentile(gaps, 99) * ms,
        tpot_mean_ms=(sum(tpots) / len(tpots) * ms) if tpots else math.nan,
        e2e_p50_ms=percentile([r.e2e for r in ok], 50) * ms,
        e2e_p99_ms=percentile([r.e2e for r in ok], 99) * ms,
        mean_isl=in_tokens / len(ok) if ok else math.nan,
        mean_osl=out_tokens / len(ok) if ok else math.nan,
        first_error=errors[0].error if errors else None,
        ttft_p90_ms=percentile(ttfts, 90) * ms,
        itl_p90_ms=percentile(gaps, 90) * ms,
        events_per_request=sum(r.events for r in ok) / len(ok) if ok else math.nan,
    )


_COLUMNS = (
    ("conc", "concurrency", "{:d}"),
    ("reqs", "requests", "{:d}"),
    ("errors", "errors", "{:d}"),
    ("req/s", "req_per_s", "{:.1f}"),
    ("out tok/s", "output_tok_per_s", "{:,.0f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.1f}"),
    ("TTFT p99 ms", "ttft_p99_ms", "{:.1f}"),
    ("ITL p50 ms", "itl_p50_ms", "{:.2f}"),
    ("ITL p99 ms", "itl_p99_ms", "{:.2f}"),
    ("TPOT ms", "tpot_mean_ms", "{:.2f}"),
    ("e2e p50 ms", "e2e_p50_ms", "{:.0f}"),
    ("ISL", "mean_isl", "{:.0f}"),
    ("OSL", "mean_osl", "{:.0f}"),
)


def format_table(results: Sequence[LevelResult]) -> str:
    """A fixed-width table, one row per concurrency level (Markdown-compatible)."""
    rows = [[h for h, _, _ in _COLUMNS]]
    for r in results:
        row = []
        for _, attr, fmt in _COLUMNS:
            v = getattr(r, attr)
            row.append("-" if isinstance(v, float) and math.isnan(v) else fmt.format(v))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    notes = [f"  c={r.concurrency}: first error: {r.first_error}" for r in results if r.first_error]
    return "\n".join(lines + notes)


def plot(results: Sequence[LevelResult], path: str) -> None:
    """Throughput and latency against concurrency, as a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [r.concurrency for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].plot(conc, [r.output_tok_per_s for r in results], marker="o")
    axes[0].set_title("output tokens/s")
    axes[1].plot(conc, [r.ttft_p50_ms for r in results], marker="o", label="p50")
    axes[1].plot(conc, [r.ttft_p99_ms for r in results], marker="o", label="p99")
    axes[1].set_title("TTFT (ms)")
    axes[2].plot(conc, [r.itl_p50_ms for r in results], marker="o", label="p50")
    axes[2].plot(conc, [r.itl_p99_ms for r in results], marker="o", label="p99")
    axes[2].set_title("ITL (ms)")
    for ax in axes:
        ax.set_xlabel("concurrency")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    axes[1].legend()
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

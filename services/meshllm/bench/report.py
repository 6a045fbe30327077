"""What `meshllm bench` measured: per-request records and per-level summaries (the table and files: `bench.output`).

Definitions (the ones `vllm bench serve` and aiperf use):

- TTFT: request sent → first event with text.
- ITL: the gaps between successive events with text, pooled over every
  request (a server that coalesces tokens under load sends fewer, larger
  events; `events_per_request` is the mean number of events with text).
- TPOT: per request, (e2e − TTFT) / (output tokens − 1): the mean time per
  output token after the first.
- E2E: request sent → last byte of the response.
- throughput: completed requests, output tokens (as the server counted them
  in `usage`), input tokens and both together, each over the level's
  duration (first request sent → last response ended).
- goodput (`--slo`): the requests that completed and met every SLO, as a
  fraction of all requests and per second (see `meshllm.bench.slo`).

Each latency has mean, median, p90 and p99 (`*_p50_ms` is the median under
its older name). Requests that failed count in `errors` and in no latency.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from meshllm.bench.record import RequestRecord
from meshllm.bench.slo import meets

__all__ = ["LevelResult", "RequestRecord", "percentile", "summarize"]

_MS = 1000.0


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    return _percentile_sorted(sorted(values), q)


def _percentile_sorted(s: Sequence[float], q: float) -> float:
    if not s:
        return math.nan
    k = (len(s) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _dist_ms(values: Sequence[float]) -> tuple[float, float, float, float]:
    """Mean, median, p90 and p99 of `values` (seconds) in milliseconds, sorting once."""
    s = sorted(values)
    p50, p90, p99 = (_percentile_sorted(s, q) * _MS for q in (50, 90, 99))
    return _mean(values) * _MS, p50, p90, p99


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _per_s(n: float, duration_s: float) -> float:
    return n / duration_s if duration_s > 0 else math.nan


@dataclass(frozen=True, kw_only=True, slots=True)
class LevelResult:
    """The summary of one level (a concurrency, a request rate or a replay); times in milliseconds."""

    concurrency: int  # users; in rate and open-loop modes the most requests that were in flight at once
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
    mode: str = "concurrency"  # concurrency | rate | open | closed
    request_rate: float | None = None  # rate mode: the Poisson arrival rate asked for (req/s)
    completed: int = 0
    total_input_tokens: int = 0
    total_output_tokens: int = 0
    total_tok_per_s: float = math.nan
    ttft_mean_ms: float = math.nan
    ttft_median_ms: float = math.nan
    itl_mean_ms: float = math.nan
    itl_median_ms: float = math.nan
    tpot_median_ms: float = math.nan
    tpot_p90_ms: float = math.nan
    tpot_p99_ms: float = math.nan
    e2e_mean_ms: float = math.nan
    e2e_median_ms: float = math.nan
    e2e_p90_ms: float = math.nan
    slo: dict[str, float] | None = None  # metric -> limit in ms
    slo_attainment: float = math.nan  # requests meeting every SLO / all requests
    goodput_req_per_s: float = math.nan
    intended_isl_mean: float = math.nan  # mean prompt length the generator built for (when it knew)
    isl_max_deviation: float = math.nan  # largest |server-counted − intended| / intended over completed requests

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}

    @property
    def label(self) -> str:
        """How the level applied its load, e.g. "c=8", "rate=4 req/s", "open"."""
        if self.mode == "rate":
            return f"rate={self.request_rate:g}/s"
        if self.mode == "open":
            return "open"
        return f"c={self.concurrency}"


# size: one field after another of LevelResult, as the report and its JSON list them
def summarize(
    concurrency: int,
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    mode: str = "concurrency",
    request_rate: float | None = None,
    slo: Mapping[str, float] | None = None,
) -> LevelResult:
    """One level's figures from its request records (see the module docstring)."""
    ok = [r for r in records if r.error is None]
    errors = [r for r in records if r.error is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    e2es = [r.e2e for r in ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    intended = [(r.prompt_tokens, r.intended_prompt_tokens) for r in ok if r.intended_prompt_tokens]
    good = sum(1 for r in ok if meets(r, slo)) if slo else 0
    ttft_mean, ttft_p50, ttft_p90, ttft_p99 = _dist_ms(ttfts)
    itl_mean, itl_p50, itl_p90, itl_p99 = _dist_ms(gaps)
    tpot_mean, tpot_p50, tpot_p90, tpot_p99 = _dist_ms(tpots)
    e2e_mean, e2e_p50, e2e_p90, e2e_p99 = _dist_ms(e2es)
    return LevelResult(
        concurrency=concurrency,
        requests=len(records),
        errors=len(errors),
        duration_s=duration_s,
        req_per_s=_per_s(len(ok), duration_s),
        output_tok_per_s=_per_s(out_tokens, duration_s),
        input_tok_per_s=_per_s(in_tokens, duration_s),
        ttft_p50_ms=ttft_p50,
        ttft_p99_ms=ttft_p99,
        itl_p50_ms=itl_p50,
        itl_p99_ms=itl_p99,
        tpot_mean_ms=tpot_mean,
        e2e_p50_ms=e2e_p50,
        e2e_p99_ms=e2e_p99,
        mean_isl=in_tokens / len(ok) if ok else math.nan,
        mean_osl=out_tokens / len(ok) if ok else math.nan,
        first_error=errors[0].error if errors else None,
        ttft_p90_ms=ttft_p90,
        itl_p90_ms=itl_p90,
        events_per_request=sum(r.events for r in ok) / len(ok) if ok else math.nan,
        mode=mode,
        request_rate=request_rate,
        completed=len(ok),
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        total_tok_per_s=_per_s(in_tokens + out_tokens, duration_s),
        ttft_mean_ms=ttft_mean,
        ttft_median_ms=ttft_p50,
        itl_mean_ms=itl_mean,
        itl_median_ms=itl_p50,
        tpot_median_ms=tpot_p50,
        tpot_p90_ms=tpot_p90,
        tpot_p99_ms=tpot_p99,
        e2e_mean_ms=e2e_mean,
        e2e_median_ms=e2e_p50,
        e2e_p90_ms=e2e_p90,
        slo=dict(slo) if slo else None,
        slo_attainment=good / len(records) if slo and records else math.nan,
        goodput_req_per_s=_per_s(good, duration_s) if slo else math.nan,
        intended_isl_mean=_mean([float(i) for _, i in intended]) if intended else math.nan,
        isl_max_deviation=max((abs(p - i) / i for p, i in intended), default=math.nan) if intended else math.nan,
    )

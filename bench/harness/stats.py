"""The statistics every report prints, and the cells that show them.

One percentile for all of them, the p50 / p90 / p99 triple, the median of the figures a run measured, and a
paired ratio with its bootstrap interval; a ratio or a figure as a table cell ("–" where there is none).

Percentiles interpolate linearly between the two nearest ranks, as `meshllm bench` reports them
(`meshllm.bench.report.percentile`), so a p99 means the same in every section of docs/benchmarks.md.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Sequence

from meshllm.bench.report import percentile

__all__ = ["figure", "median", "paired_ratio", "pct", "ratio", "triple"]


def pct(values: Sequence[float], p: float) -> float:
    """The `p`-th percentile (0..100) of `values`; NaN for none."""
    return percentile(values, p)


def triple(values: Sequence[float], fmt: str = "{:.1f}") -> str:
    """'p50 / p90 / p99' of `values`, each formatted with `fmt`."""
    return " / ".join(fmt.format(pct(values, p)) for p in (50, 90, 99))


def median(values: Iterable[float | None]) -> float:
    """The median of the figures that were measured (None and NaN left out); NaN for none."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(vals) if vals else math.nan


def paired_ratio(mine: Sequence[float | None], base: Sequence[float | None], seed: int = 0) -> tuple[float, float, float]:
    """Median over pairs of (this system's figure ÷ the baseline's on the same prompt or block), with a 90 %
    bootstrap interval (2,000 resamples of the pairs). Each pair shares its prompts and its minute of this
    machine's drifting speed, so the ratio's spread is the systems' own, not the machine's."""
    ratios = sorted(m / b for m, b in zip(mine, base, strict=False) if m is not None and b)
    if not ratios:
        return math.nan, math.nan, math.nan
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return statistics.median(ratios), medians[100], medians[1899]


def ratio(a: float, b: float) -> str:
    """'0.95×' (a ÷ b), or '–' where either is NaN or b is zero."""
    return f"{a / b:.2f}×" if b and not math.isnan(a) and not math.isnan(b) else "–"


def figure(value: float | None, fmt: str = "{:.1f}") -> str:
    """`value` formatted with `fmt`, or '–' where it was not measured (None or NaN)."""
    return "–" if value is None or math.isnan(value) else fmt.format(value)

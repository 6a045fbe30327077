"""The statistics every report prints: one percentile for all of them, and the p50 / p90 / p99 triple.

Percentiles interpolate linearly between the two nearest ranks, as `meshllm bench` reports them
(`meshllm.bench.report.percentile`), so a p99 means the same in every section of docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshllm.bench.report import percentile

__all__ = ["pct", "triple"]


def pct(values: Sequence[float], p: float) -> float:
    """The `p`-th percentile (0..100) of `values`; NaN for none."""
    return percentile(values, p)


def triple(values: Sequence[float], fmt: str = "{:.1f}") -> str:
    """'p50 / p90 / p99' of `values`, each formatted with `fmt`."""
    return " / ".join(fmt.format(pct(values, p)) for p in (50, 90, 99))

"""Service-level objectives for goodput: `--slo ttft=200,itl=50` (milliseconds).

A request meets the SLOs when it completed and, for every metric named,
its own value is at most the limit:

    ttft   time to first token
    itl    the request's mean gap between events with text (aiperf's per-request ITL)
    tpot   (e2e − TTFT) / (output tokens − 1)
    e2e    the whole request

A request with too few tokens to have an ITL or TPOT meets that SLO.
Goodput is the requests that meet every SLO per second of the level
(vLLM's `--goodput`, aiperf's `--goodput`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from meshllm.bench.record import RequestRecord

__all__ = ["SLO_METRICS", "meets", "parse_slo"]

SLO_METRICS = ("ttft", "itl", "tpot", "e2e")


def parse_slo(text: str) -> dict[str, float]:
    """`"ttft=200,itl=50"` -> {"ttft": 200.0, "itl": 50.0}; ValueError naming `--slo` when malformed."""
    out: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--slo {text!r}: expected METRIC=MS[,...] with METRIC one of {', '.join(SLO_METRICS)}")
        try:
            limit = float(value.strip().removesuffix("ms"))
        except ValueError:
            raise ValueError(f"--slo {text!r}: {value.strip()!r} is not a number of milliseconds") from None
        if not limit > 0 or math.isinf(limit):
            raise ValueError(f"--slo {text!r}: the limit for {name} must be a finite number of milliseconds > 0")
        out[name] = limit
    if not out:
        raise ValueError(f"--slo {text!r}: name at least one of {', '.join(SLO_METRICS)}")
    return out


def meets(rec: RequestRecord, slo: Mapping[str, float] | None) -> bool:
    """Whether `rec` completed and met every limit of `slo` (ms)."""
    if rec.error is not None:
        return False
    if not slo:
        return True
    values = {"ttft": rec.ttft, "itl": rec.mean_itl, "tpot": rec.tpot, "e2e": rec.e2e}
    for name, limit in slo.items():
        v = values[name]
        if name == "ttft" and v is None:
            return False  # completed without a single token of text: no first token to time
        if v is not None and v * 1000.0 > limit:
            return False
    return True

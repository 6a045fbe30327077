"""How `meshllm bench` shows its results: per-level blocks, the comparison table, JSON, CSV and the plot.

Every level gets a block in the shape `vllm bench serve` and aiperf users
read: totals and throughput, then mean / median / p90 / p99 of TTFT, ITL,
TPOT and E2E, then goodput when SLOs were given. The comparison table after
the blocks has one row per level (Markdown-compatible).
"""

from __future__ import annotations

import csv
import io
import math
import sys
from collections.abc import Sequence
from typing import Any

import orjson

from meshllm.bench.report import LevelResult

__all__ = ["format_level", "format_table", "plot", "write_csv", "write_json"]


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def _md(rows: list[list[str]], right_from: int = 0) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "| " + " | ".join(c.rjust(w) if i >= right_from else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        + " |"
        for row in rows
    ]  # fmt: skip
    lines.insert(1, "|" + "|".join("-" * (w + 1) + (":" if i >= right_from else "-") for i, w in enumerate(widths)) + "|")
    return lines


def format_level(r: LevelResult) -> str:
    """One level's block: totals, throughput, the latency distribution, goodput."""
    head = f"{r.label}: {r.completed:,} of {r.requests:,} requests completed ({r.errors:,} errors) in {r.duration_s:,.2f} s"
    if r.mode in ("rate", "open"):
        head += f", up to {r.concurrency} in flight"
    lines = [
        head,
        f"  throughput: {_f(r.req_per_s, '{:,.2f}')} req/s, output {_f(r.output_tok_per_s, '{:,.0f}')} tok/s, "
        f"input {_f(r.input_tok_per_s, '{:,.0f}')} tok/s, total {_f(r.total_tok_per_s, '{:,.0f}')} tok/s",
        f"  tokens: input {r.total_input_tokens:,} (mean {_f(r.mean_isl, '{:,.1f}')}), "
        f"output {r.total_output_tokens:,} (mean {_f(r.mean_osl, '{:,.1f}')})",
    ]
    if not math.isnan(r.intended_isl_mean):
        lines.append(
            f"  prompt length: built for a mean of {r.intended_isl_mean:,.1f} tokens, the server counted "
            f"{_f(r.mean_isl, '{:,.1f}')} (largest deviation {r.isl_max_deviation:.1%})"
        )
    rows = [["metric (ms)", "mean", "median", "p90", "p99"]]
    for name, key, fmt in (("TTFT", "ttft", "{:,.2f}"), ("ITL", "itl", "{:,.3f}"), ("TPOT", "tpot", "{:,.3f}"),
                           ("E2E", "e2e", "{:,.1f}")):  # fmt: skip
        p50 = getattr(r, f"{key}_median_ms")
        rows.append([name] + [_f(v, fmt) for v in (getattr(r, f"{key}_mean_ms"), p50, getattr(r, f"{key}_p90_ms"),
                                                   getattr(r, f"{key}_p99_ms"))])  # fmt: skip
    lines += ["  " + line for line in _md(rows, right_from=1)]
    if r.slo:
        limits = ", ".join(f"{k.upper()} ≤ {v:g} ms" for k, v in r.slo.items())
        lines.append(
            f"  goodput ({limits}): {_f(r.slo_attainment, '{:.1%}')} of requests met every SLO, "
            f"{_f(r.goodput_req_per_s, '{:,.2f}')} req/s"
        )
    if r.first_error:
        lines.append(f"  first error: {r.first_error}")
    return "\n".join(lines)


_COLUMNS = (
    ("conc", "concurrency", "{:d}"),
    ("reqs", "requests", "{:d}"),
    ("errors", "errors", "{:d}"),
    ("duration s", "duration_s", "{:,.1f}"),
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
    """A fixed-width table, one row per level (Markdown-compatible); a rate and a goodput column when they apply."""
    columns = list(_COLUMNS)
    if any(r.mode == "rate" for r in results):
        columns.insert(0, ("rate/s", "request_rate", "{:g}"))
    if any(r.slo for r in results):
        columns.append(("goodput req/s", "goodput_req_per_s", "{:.1f}"))
    rows = [[h for h, _, _ in columns]]
    rows += [[_f(getattr(r, attr), fmt) for _, attr, fmt in columns] for r in results]
    notes = [f"  {r.label}: first error: {r.first_error}" for r in results if r.first_error]
    return "\n".join(_md(rows) + notes)


def write_json(doc: object, target: str) -> None:
    """`--json` output: indented JSON to stdout ("-") or to a file."""
    data = orjson.dumps(doc, option=orjson.OPT_INDENT_2)
    if target == "-":
        sys.stdout.write(data.decode() + "\n")
    else:
        with open(target, "wb") as f:
            f.write(data)


def write_csv(rows: Sequence[dict[str, Any]], target: str) -> None:
    """`--csv` output: one row per level, every field a column (SLOs as `slo_<metric>_ms`); "-" = stdout."""
    flat: list[dict[str, Any]] = []
    for row in rows:
        out = {k: v for k, v in row.items() if k != "slo"}
        for name, limit in (row.get("slo") or {}).items():
            out[f"slo_{name}_ms"] = limit
        flat.append(out)
    fields: list[str] = []
    for row in flat:
        fields += [k for k in row if k not in fields]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(flat)
    if target == "-":
        sys.stdout.write(buf.getvalue())
    else:
        with open(target, "w", encoding="utf-8", newline="") as f:
            f.write(buf.getvalue())


def plot(results: Sequence[LevelResult], path: str) -> None:
    """Throughput and latency against concurrency (or request rate), as a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_rate = all(r.mode == "rate" for r in results)
    x = [r.request_rate if by_rate else r.concurrency for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].plot(x, [r.output_tok_per_s for r in results], marker="o")
    axes[0].set_title("output tokens/s")
    axes[1].plot(x, [r.ttft_p50_ms for r in results], marker="o", label="p50")
    axes[1].plot(x, [r.ttft_p99_ms for r in results], marker="o", label="p99")
    axes[1].set_title("TTFT (ms)")
    axes[2].plot(x, [r.itl_p50_ms for r in results], marker="o", label="p50")
    axes[2].plot(x, [r.itl_p99_ms for r in results], marker="o", label="p99")
    axes[2].set_title("ITL (ms)")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)" if by_rate else "concurrency")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    axes[1].legend()
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""bench/routing.py's report: the Routing section of docs/benchmarks.md from a run's rows.

`render` writes the section's head and one `### scenario` part per scenario
run (what it sent, `kv` against round-robin at p50, p90 and p99, the table,
how much the repeats moved); `merge` keeps the parts of scenarios a partial
run did not measure.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from harness.runinfo import load_sentence, machine, today, versions
from routing_cases import Result, Scenario, Setup

from meshllm.router.policy.choice import REUSED_EVICT_COST

__all__ = ["FOOT", "Row", "merge", "render"]


@dataclass(slots=True)
class Row:
    """One (scenario, cache size, mode): a result per repeat, and the load average after each."""

    scenario: Scenario
    cache: str
    blocks: int
    mode: str
    results: list[Result] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)

    def median(self, figure: Callable[[Result], float]) -> float:
        return statistics.median(figure(r) for r in self.results)

    def span(self, figure: Callable[[Result], float]) -> str:
        values = [figure(r) for r in self.results]
        return f"{min(values):,.0f}–{max(values):,.0f}" if len(values) > 1 else ""


def _p(q: float) -> Callable[[Result], float]:
    return lambda r: r.p(r.ttft_ms, q)


def _hit(r: Result) -> float:
    return r.hit_rate


def _e2e50(r: Result) -> float:
    return r.p(r.e2e_ms, 0.5)


def render(rows: list[Row], setup: Setup, repeats: int) -> tuple[str, dict[str, str]]:
    """The section's head, and one `### scenario` part per scenario run."""
    head = f"""## Routing

`.venv/bin/python bench/routing.py` ({machine()}; {versions("grpcio", "protobuf", "xxhash")}):
{setup.workers} mocker workers, block size {setup.block_size}, --speedup-ratio {setup.speedup_ratio:g}; fresh
workers per run; embedded RouterCore (default `kv` weights: --kv-overlap-weight 1, --kv-capacity-weight 1,
--kv-wait-weight 1), real gRPC to the workers; `docs-http` goes through `meshllm run` instead (see its part).
Each scenario states its date, its repeats and the 1-minute load average during its runs: every row is run that
many times, the modes of a cache size interleaved (kv, approximate, round-robin, … then again) so they share the
machine's noise, and each figure is the median over the repeats; "p90 range" is the lowest–highest TTFT p90 of
the repeats. "vs rr" is the median hit rate and TTFT p90 against round-robin's in the same scenario and cache
size: a hit ratio below 1.0× or a TTFT ratio above 1.0× favours round-robin. Each part first sets `kv` beside
round-robin at p50, p90 and p99, whichever wins.
"""
    parts: dict[str, str] = {}
    for name in dict.fromkeys(r.scenario.name for r in rows):
        parts[name] = scenario_part([r for r in rows if r.scenario.name == name], repeats)
    return head, parts


def scenario_part(group: list[Row], repeats: int) -> str:
    """One scenario: what it sent, the headline (`kv` vs round-robin at p50, p90 and p99), the table, the notes."""
    sc = group[0].scenario
    unit, per = sc.cache_unit
    sizes = ", ".join(
        f"{label} --num-gpu-blocks {blocks} ({blocks / per:.1f} {unit} per worker)"
        if unit != "of the working set"
        else f"{label} --num-gpu-blocks {blocks} ({blocks / per:.1%} {unit} per worker)"
        for label, blocks in sc.caches
    )
    loads = [x for r in group for x in r.loads]
    lines = [
        f"### {sc.name}",
        "",
        f"{sc.describe}. Caches: {sizes}. Ceiling (unbounded caches, every reusable token hit): {sc.ceiling:.1%}. "
        f"Run on {today()}, {repeats} repeat{'s' if repeats > 1 else ''} per row. {load_sentence(loads)}",
        "",
        *headlines(group, repeats),
        "| cache | mode | hit rate | hit vs rr | TTFT p50 ms | TTFT p90 ms | p90 range | TTFT p99 ms | p90 vs rr "
        "| e2e p50 ms | requests per worker (1st run) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in group:
        rr = _rr(group, row.cache)
        hit, p90 = row.median(_hit), row.median(_p(0.9))
        hit_ratio = _ratio(hit, rr.median(_hit), digits=1) if rr is not None else "–"
        p90_ratio = _ratio(p90, rr.median(_p(0.9))) if rr is not None else "–"
        spread = "/".join(str(v) for _, v in sorted(row.results[0].per_worker.items())) or "–"
        lines.append(
            f"| {row.cache} | {row.mode} | {hit:.1%} | {hit_ratio} | {row.median(_p(0.5)):,.1f} | {p90:,.1f} "
            f"| {row.span(_p(0.9)) or '–'} | {row.median(_p(0.99)):,.1f} | {p90_ratio} | {row.median(_e2e50):,.0f} "
            f"| {spread} |"
        )
    notes = [n for n in (variation(group), skew(group)) if n]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def _rr(group: list[Row], cache: str) -> Row | None:
    return next((x for x in group if x.cache == cache and x.mode == "round-robin"), None)


def _lower(a: float, b: float) -> str:
    return "kv" if a < b else "round-robin" if a > b else "tie"


def _ratio(a: float, b: float, digits: int = 2) -> str:
    return f"{a / b:.{digits}f}×" if b > 0 else "–"


def headlines(group: list[Row], repeats: int) -> list[str]:
    """Per cache size: `kv` against round-robin, hit rate and TTFT at p50, p90 and p99 (medians over the repeats)."""
    out = []
    for cache in dict.fromkeys(r.cache for r in group):
        kv = next((x for x in group if x.cache == cache and x.mode == "kv"), None)
        rr = _rr(group, cache)
        if kv is None or rr is None:
            continue
        ttft = ", ".join(
            f"p{round(q * 100)} {kv.median(_p(q)):,.1f} vs {rr.median(_p(q)):,.1f} ms "
            f"({_lower(kv.median(_p(q)), rr.median(_p(q)))}; kv {_ratio(kv.median(_p(q)), rr.median(_p(q)))})"
            for q in (0.5, 0.9, 0.99)
        )
        out.append(
            f"- {cache} cache, `kv` vs round-robin (median of {repeats}): hit rate {kv.median(_hit):.1%} vs "
            f"{rr.median(_hit):.1%}; TTFT {ttft}; the lower one in brackets, with `kv`'s as a multiple of round-robin's."
        )
    return out + ([""] if out else [])


def variation(group: list[Row]) -> str:
    """How far a row's TTFT p90 moved between repeats, as measured (nothing when there was one repeat)."""
    moves = []
    for row in group:
        values = [_p(0.9)(r) for r in row.results]
        if len(values) > 1 and min(values) > 0:
            moves.append((max(values) / min(values) - 1, row))
    if not moves:
        return ""
    worst, row = max(moves, key=lambda m: m[0])
    return (
        f"Between repeats a row's TTFT p90 moved by up to {worst:.0%} ({row.cache} {row.mode}); read p90 differences "
        "smaller than that as noise."
    )


def skew(group: list[Row], factor: float = 1.5) -> str:
    """Modes whose busiest worker got at least `factor` × an even share of the first run's requests."""
    found = []
    for row in group:
        counts = list(row.results[0].per_worker.values())
        if not counts or not sum(counts):
            continue
        if max(counts) >= factor * sum(counts) / len(counts):
            found.append(f"{row.mode} ({row.cache}: {max(counts)} of {sum(counts)})")
    if not found:
        return ""
    return f"Uneven spread (a worker got ≥ {factor:g}× an even share in the first run): " + "; ".join(found) + "."


FOOT = f"""`kv` prices each candidate by the prefill it would compute, its decode load (the blocks that become active
there: those its running requests do not share), what the request would do to its cache (the pressure of adding
the request's new blocks to a fuller cache and the reused blocks it would have to evict, {REUSED_EVICT_COST:g} prefill
blocks each) and the wait behind a busy worker's running requests (1.5 of its measured steps, plus the fixed time of
a prefill step while one of them has no first token yet, in prefill blocks; docs/routing.md); `approximate` does the
same from what it routed (no events). Round-robin, random and least-loaded ignore the cache. `docs-seq` and
`docs-http` send their requests one after another, so no request queues behind another.
"""


def merge(old: str, head: str, parts: dict[str, str], order: Sequence[str]) -> str:
    """The Routing section: `head`, then every scenario's part — this run's, else the one `old` already had.

    `order`: the scenarios' order in the section; parts of others follow it.
    """
    kept = dict(re.findall(r"^### (\S+)\n(.*?)(?=^### |^`kv` prices|\Z)", old, re.S | re.M))
    names = [n for n in order if n in parts or n in kept] + [n for n in parts if n not in order]
    body = [parts.get(n) or f"### {n}\n{kept[n]}".rstrip("\n") + "\n" for n in names]
    return "\n".join([head, *body, FOOT])

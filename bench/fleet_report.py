"""The docs/benchmarks.md section of bench/fleet.py's runs, and the ISSUE 39 targets each run meets or misses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fleet_sim import WORKERS_PER_COPY
from harness.runinfo import load_sentence, machine, today
from harness.stats import pct


def _per_core(r: dict[str, Any]) -> str:
    """Block-events per CPU-second of the busier router replica (runs before 2026-11-29 evening did not measure it)."""
    v = r.get("events_per_router_cpu_s")
    return "" if v is None else f"; {v:,.0f} per router CPU-second"


TARGETS = {"decision_p99_ms": 1.0, "events_per_s": 1_000_000, "bytes_per_pair": 100, "resync_all_s": 10.0}


def summary(values: Sequence[float]) -> dict[str, float]:
    """p50 / p90 / p99 of `values`."""
    return {f"p{p}": pct(values, p) for p in (50, 90, 99)}


def verdicts(r: dict[str, Any]) -> dict[str, bool]:
    """Each target of ISSUE 39: met or not."""
    return {
        "decision_p99_ms": r["decision_ms"]["p99"] <= TARGETS["decision_p99_ms"],
        "events_per_s": r["events_per_s"] >= TARGETS["events_per_s"],
        "bytes_per_pair": r["bytes_per_pair"] <= TARGETS["bytes_per_pair"],
        "resync_all_s": r["resync_all_s"] <= TARGETS["resync_all_s"],
    }


def render(results: Sequence[dict[str, Any]], loads: Sequence[float] = ()) -> str:
    """The docs/benchmarks.md section of one or more runs (one row per run)."""

    def mark(r: dict[str, Any], key: str) -> str:
        return "met" if r["targets"][key] else "**missed**"

    def ms(d: dict[str, float]) -> str:
        return f"{d['p50']:.2f} / {d['p90']:.2f} / {d['p99']:.2f}"

    def ms3(d: dict[str, float]) -> str:
        return " / ".join(f"{d[p]:.3f}" if p in d else "–" for p in ("p50", "p90", "p99"))

    lines = [
        "## Fleet routing",
        "",
        f"`.venv/bin/python bench/fleet.py --workers N --json OUT`, one row per run (a size run more than once has a "
        f"row for each run, in the order run), on {today()} ({machine()}). "
        "N simulated workers with full caches "
        "(bench/fleet.py's docstring): KV event streams from the Mooncake conversation trace (1 hash id = one 16-token "
        "block; ids in ≥ 1 % of rows shared fleet-wide, the rest renamed per copy of the trace, one copy per "
        f"{WORKERS_PER_COPY} workers), published through a real nats-server to two real `meshllm router` replicas "
        "(etcd discovery). *Decision*: the whole `kv` decision of an aggregated request (hash + `RouterCore.plan`), in "
        "one process, on an index fed the same events; *exhaustive*: the same decision scoring every worker (the "
        "scorer before ISSUE 39; same choice in the share shown); *Route RPC*: `Router.Route` round trips to the router "
        "process (gRPC and protobuf on both sides included). Percentiles over the prompts (3/4 trace rows of random "
        "copies, 1/4 fresh prompts). Targets (ISSUE 39, at 1,024 workers × 16,384 blocks): decision p99 ≤ 1 ms, "
        "≥ 1,000,000 block-events/s, ≤ 100 bytes per indexed pair, full resync ≤ 10 s, the index walk no slower than "
        "Dynamo's `find_matches`.",
    ]
    if loads:
        lines.append(load_sentence(loads))
    for r in results:
        if r.get("load"):
            label = f"{r['workers']:,} workers" + ("" if "route_rpc_ms" in r else " (`--reuse --in-process-only` run)")
            lines += ["", f"{label}: " + load_sentence(r["load"])]
    lines += [
        "",
        "| workers × blocks | decision p50 / p90 / p99 ms | exhaustive p50 / p90 / p99 ms (same choice) "
        "| Route RPC p50 / p90 / p99 ms | candidates scored (median) | block-events/s ingested (both replicas) "
        "| bytes per (worker, block) pair | resync one / all after a NATS outage (s) | replica agreement |",
        "|---|---|---|---|---:|---:|---:|---|---|",
    ]
    for r in [r for r in results if "route_rpc_ms" in r]:
        ex = r.get("exhaustive_ms")
        exhaustive = f"{ms(ex)} ({r['exhaustive_agreement'] * 100:.0f} %)" if ex else "–"
        lines.append(
            f"| {r['workers']:,} × {r['blocks_per_worker']:,} | {ms(r['decision_ms'])} ({mark(r, 'decision_p99_ms')}) "
            f"| {exhaustive} | {ms(r['route_rpc_ms'])} | {r['candidates_scored_median']:g} "
            f"| {r['events_per_s']:,.0f} ({mark(r, 'events_per_s')}; "
            f"{r['in_process_events_per_s']:,.0f} in process{_per_core(r)}) "
            f"| {r['bytes_per_pair']:.0f} ({mark(r, 'bytes_per_pair')}) "
            f"| {r['resync_one_s']:.3f} / {r['resync_all_s']:.2f} ({mark(r, 'resync_all_s')}"
            f"{'; ' + format(r['resubscribed_s'], '.1f') + ' s of it reconnecting' if 'resubscribed_s' in r else ''}) "
            f"| {r['replica_agreement'] * 100:.1f} %{'' if r['replica_same_index'] else ', indexes differ'} |"
        )
    full = [r for r in results if "route_rpc_ms" in r]  # in-process-only runs have no row in the process tables
    releases = sorted({r["dynamo"].get("version", "") for r in full if isinstance(r.get("dynamo"), dict)} - {""})
    dynamo = "Dynamo " + ", ".join(releases) if releases else "Dynamo"
    lines += ["", f"Index walk beside {dynamo}'s `RadixTree.find_matches` on the same stored events and prompts:", ""]
    lines += [
        "| workers × blocks | our walk p50 / p90 / p99 ms (depth groups; as a {worker: depth} dict) "
        "| `find_matches` p50 / p90 / p99 ms "
        "| same overlaps | walk no slower |"
    ]
    lines += ["|---|---|---|---:|---|"]
    for r in full:
        d = r["dynamo"]
        if isinstance(d, dict):
            ours, theirs = d["walk_ms"], d["find_matches_ms"]
            ok = "met" if ours["p99"] <= theirs["p99"] else "**missed**"
            as_dict = d.get("walk_dict_ms")
            dict_part = f" ({ms3(as_dict)} as a dict)" if as_dict and "p90" in as_dict else ""
            lines.append(
                f"| {r['workers']:,} × {r['blocks_per_worker']:,} | {ms3(ours)}{dict_part} | {ms3(theirs)} "
                f"| {d['same_overlaps'] * 100:.0f} % | {ok} (p99) |"
            )
        else:
            lines.append(f"| {r['workers']:,} × {r['blocks_per_worker']:,} | – | {d} | – | – |")
    reused = [r for r in results if "reused" in r]
    if reused:
        lines += [
            "",
            "With reused blocks spread through every eviction order (`--reuse`: every cached block routed again, in runs "
            "of 20 in random order, half the runs as reuses — no bound is exact, each candidate scored costs its "
            "evicted-block count; a run of its own, in process, the same prompts and loads as above):",
            "",
            "| workers × blocks | reused share | decision p50 / p90 / p99 ms | candidates scored p50 / p90 / p99 "
            "| exhaustive p50 / p90 / p99 ms (same choice) |",
            "|---|---:|---|---|---|",
        ]
        for r in reused:
            u = r["reused"]
            ex = u.get("exhaustive_ms")
            exhaustive = f"{ms(ex)} ({u['exhaustive_agreement'] * 100:.0f} %)" if ex else "–"
            sc = u["scored"]
            lines.append(
                f"| {r['workers']:,} × {r['blocks_per_worker']:,} | {u['hot_share'] * 100:.0f} % | {ms(u['decision_ms'])} "
                f"({'met' if u['decision_ms']['p99'] <= TARGETS['decision_p99_ms'] else '**missed**'}) "
                f"| {sc['p50']:g} / {sc['p90']:g} / {sc['p99']:g} | {exhaustive} |"
            )
    return "\n".join(lines) + "\n"

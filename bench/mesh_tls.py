"""The "## TLS cost" section of docs/benchmarks.md, built from what `bench/mesh.py --tls` measured.

Each split system runs plaintext and then with mTLS, right after each other, per repeat. Figures are medians over
the repeats; "× plaintext" is the median of the per-repeat ratios (repeat i's mTLS run against repeat i's plaintext
run) with their range, so a ratio never pairs one lucky run with another.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from harness.runinfo import load_sentence, median_range
from harness.systems import LABELS
from mesh_report import Results

__all__ = ["tls_section"]

Row = dict[str, Any]


def _med(rows: Sequence[Row], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _triple(rows: Sequence[Row], what: str, fmt: str) -> str:
    return " / ".join(fmt.format(_med(rows, f"{what}_p{q}_ms")) for q in (50, 90, 99))


def _mesh_cpu(rows: Sequence[Row]) -> float:
    return statistics.median(sum(r["cpu_ms"].values()) for r in rows)


def _ratios(tls: Sequence[Row], plain: Sequence[Row]) -> list[float]:
    return [t["req_per_s"] / p["req_per_s"] for t, p in zip(tls, plain, strict=False) if p["req_per_s"]]


def tls_section(res: Results, heading: str = "## TLS cost") -> str:
    """The section: how it was run, a row per system and level, CPU per process plaintext → mTLS."""
    info = res.info
    table = [
        "| system | conc | req/s (each repeat) | × plaintext | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | "
        "CPU-ms per request (whole mesh) | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    per_process = []
    for (speedup, kind, c), rows in sorted(res.rows.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        base = kind.removesuffix("+mtls")
        plain = res.rows.get((speedup, base, c), []) if kind != base else []
        vs = median_range(_ratios(rows, plain), "{:.2f}", "×") if plain else "1.00×"
        each = ", ".join(f"{r['req_per_s']:.1f}" for r in rows)
        table.append(
            f"| {LABELS[kind]} | {c} | {_med(rows, 'req_per_s'):.1f} ({each}) | {vs} | {_triple(rows, 'ttft', '{:.1f}')} "
            f"| {_triple(rows, 'itl', '{:.2f}')} | {_mesh_cpu(rows):.2f} | {sum(r['errors'] for r in rows)} |"
        )
        if plain:
            names = [n for n in plain[0]["cpu_ms"] if n in rows[0]["cpu_ms"]]
            moves = ", ".join(
                f"{n} {statistics.median(r['cpu_ms'][n] for r in plain):.2f} → "
                f"{statistics.median(r['cpu_ms'][n] for r in rows):.2f}"
                for n in names
            )
            loadgen = f"{_med(plain, 'loadgen_cpu_ms'):.2f} → {_med(rows, 'loadgen_cpu_ms'):.2f}"
            per_process.append(
                f"- {LABELS[base]}, c={c}, speedup {speedup:g}: {moves}; the load generator (its HTTPS client) {loadgen}."
            )
    text = [
        heading,
        "",
        "What the secure layout of deploy/compose.yaml costs the split mesh: the same system started twice, one "
        "variant right after the other, with the same load, plaintext and then mTLS (`bench/mesh.py --tls`).",
        "",
        f"`{res.argv}` on {info.get('date', '')} ({info['machine']}, Python {info['python']}, commit {info['commit']}; "
        f"{info['packages']}). *meshllm split* = etcd + nats-server + `meshllm frontend` (embedded routing core) + "
        f"{res.workers} `meshllm worker --engine mocker` processes on loopback; *mTLS* = the same with a certificate "
        "per process from `meshllm.certs.make_dev_pki`: mTLS on frontend → worker gRPC and HTTPS between the load "
        "generator and the frontend (`--api-client-certs none`, as in compose); etcd and NATS plaintext in both. "
        f"Load: {res.load}; {res.warmup} warm-up then {res.requests} measured requests per run; {res.repeats} "
        "repeat(s), each system freshly started per repeat; figures are medians over the repeats (each repeat's "
        "req/s in brackets), and × plaintext is the median of the per-repeat ratios with their range. "
        f"{load_sentence(res.load_avg)}",
        "",
        *table,
        "",
        "CPU-ms per request by process, plaintext → mTLS (medians over the repeats):",
        "",
        *per_process,
        "",
        "The gRPC channels between the processes are opened during warm-up; the load generator (a fresh "
        "`meshllm bench` process per run) opens its connections, one TLS handshake each, at the start of the "
        "measured run.",
    ]
    if res.failures:
        text += ["", "**Failed** (no figures from these):", "", *(f"- {f}" for f in res.failures)]
    return "\n".join(text) + "\n"

"""The "## Split mesh" section of docs/benchmarks.md, built from what bench/mesh.py measured.

Every figure is the median over repeats; ratios are against the run's baseline (Dynamo when it ran, else the first
meshllm system). CPU-ms per request is a process's utime + stime (all threads, and its child processes) over the
measured level only, divided by the level's requests.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.runinfo import load_sentence
from harness.stats import figure, median, ratio
from harness.systems import DYNAMO_VERSION, LABELS
from mesh_profile import Profile

__all__ = ["Results", "section", "summary_line"]

Row = dict[str, Any]
ENGINES_LABEL = "mocker engines alone (in-process, no mesh)"


@dataclass(slots=True)
class Results:
    """Everything one bench/mesh.py run measured and how it was run."""

    argv: str
    systems: list[str]
    speedups: list[float]
    levels: list[int]
    requests: int
    warmup: int
    repeats: int
    workers: int
    router_mode: str
    load: str
    extra: str = ""  # extra flags given to meshllm commands, as typed
    rows: dict[tuple[float, str, int], list[Row]] = field(default_factory=dict)
    profiles: dict[tuple[float, str], dict[str, Profile]] = field(default_factory=dict)
    profile_level: tuple[int, int] | None = None  # (concurrency, requests) of the profiled level
    overhead: dict[str, Row] = field(default_factory=dict)
    overhead_requests: int = 0
    engines: dict[tuple[float, int], list[Row]] = field(default_factory=dict)  # (speedup, c) -> engines-alone rows
    failures: list[str] = field(default_factory=list)  # systems that did not start or broke, with the error
    load_avg: list[float] = field(default_factory=list)
    info: dict[str, str] = field(default_factory=dict)

    @property
    def baseline(self) -> str:
        return "dynamo" if "dynamo" in self.systems else self.systems[0]


def _med(rows: Sequence[Row], key: str) -> float:
    return median(r.get(key) for r in rows)


def _cpu(rows: Sequence[Row], proc: str) -> float:
    vals = [r["cpu_ms"][proc] for r in rows if proc in r["cpu_ms"]]
    return statistics.median(vals) if vals else math.nan


def _mesh_cpu(rows: Sequence[Row]) -> float:
    return statistics.median(sum(r["cpu_ms"].values()) for r in rows) if rows else math.nan


def _triple(rows: Sequence[Row], what: str, fmt: str) -> str:
    return " / ".join(figure(_med(rows, f"{what}_{p}_ms"), fmt) for p in ("p50", "p90", "p99"))


def _process_columns(res: Results) -> list[str]:
    seen: list[str] = []
    for rows in res.rows.values():
        for name in rows[0]["cpu_ms"]:
            if name not in seen:
                seen.append(name)
    order = ["frontend", "router", "meshllm run"]
    head = [n for n in order if n in seen]
    workers = sorted((n for n in seen if n.startswith("worker ")), key=lambda n: int(n.split()[1]))
    return head + workers + [n for n in seen if n not in head and n not in workers]


def _speed_row(label: str, c: int, rows: Sequence[Row], base_rows: Sequence[Row]) -> str:
    """One row of the req/s table: medians, the req/s range of repeated rows in brackets, errors summed."""
    rps = _med(rows, "req_per_s")
    spread = f" ({min(r['req_per_s'] for r in rows):.1f}–{max(r['req_per_s'] for r in rows):.1f})" if len(rows) > 1 else ""
    return (
        f"| {label} | {c} | {rps:.1f}{spread} | {ratio(rps, _med(base_rows, 'req_per_s'))} | "
        f"{figure(_med(rows, 'output_tok_per_s'), '{:,.0f}')} | {_triple(rows, 'ttft', '{:.1f}')} | "
        f"{_triple(rows, 'itl', '{:.2f}')} | {figure(_med(rows, 'events_per_request'))} | {sum(r['errors'] for r in rows)} |"
    )


def _speed_tables(res: Results, speedup: float) -> str:
    base = res.baseline
    procs = _process_columns(res)
    t1 = [
        f"| system | conc | req/s | req/s × {LABELS[base]} | output tok/s | TTFT p50 / p90 / p99 ms | "
        "ITL p50 / p90 / p99 ms | SSE chunks per response | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    t2 = [
        "| system | conc | " + " | ".join(procs) + f" | whole mesh | mesh × {LABELS[base]} | frontend µs per output token | "
        "load generator (whole process) |",
        "|---|---:|" + "---:|" * (len(procs) + 4),
    ]
    for c in res.levels:
        base_rows = res.rows.get((speedup, base, c), [])
        for kind in res.systems:
            rows = res.rows.get((speedup, kind, c))
            if not rows:
                continue
            t1.append(_speed_row(LABELS[kind], c, rows, base_rows))
            mesh = _mesh_cpu(rows)
            fe = _cpu(rows, "frontend")
            per_token = fe * 1000 / _med(rows, "mean_osl") if not math.isnan(fe) else math.nan
            cells = " | ".join(figure(_cpu(rows, p), "{:.2f}") for p in procs)
            t2.append(
                f"| {LABELS[kind]} | {c} | {cells} | {mesh:.2f} | {ratio(mesh, _mesh_cpu(base_rows))} | "
                f"{figure(per_token, '{:.0f}')} | {figure(_med(rows, 'loadgen_cpu_ms'), '{:.2f}')} |"
            )
        if rows := res.engines.get((speedup, c)):
            t1.append(_speed_row(ENGINES_LABEL, c, rows, base_rows))
    text = "\n".join(t1)
    if engines := _engines_note(res, speedup):
        text += "\n\n" + engines
    return text + "\n\nCPU-ms per request, by process:\n\n" + "\n".join(t2)


def _engines_note(res: Results, speedup: float) -> str:
    """What the engines-alone rows are, with how busy the engines were in them (measured)."""
    busy = [
        f"{_med(rows, 'model_busy') * 100:.0f}% of the measured time at c={c} (the process spent "
        f"{_med(rows, 'cpu_ms_per_request'):.2f} CPU-ms per request)"
        for c in res.levels
        if (rows := res.engines.get((speedup, c)))
    ]
    if not busy:
        return ""
    return (
        f"*{ENGINES_LABEL}*: the same {res.workers} mockers in the benchmark's own process, driven through their "
        "LLMEngine API by as many callers as the level's concurrency in a closed loop (each sends its next request "
        "when its last one ends, round-robin over the engines), with the level's prompts tokenized before the "
        "clock starts: no HTTP, no gRPC, no tokenizer. Measured right before the systems of each repeat. The "
        f"engines were stepping on their model's timeline for {'; '.join(busy)}; where that is well below 100 % "
        "the figure is the one Python process's CPU, not the engines'. It is not an upper bound for a "
        "mesh: the mocker's prefill step costs a fixed time plus a per-token time, so prompts admitted in one step "
        "share the fixed part, and requests that reach an engine later or in bunches make it faster."
    )


def _verdict(ok: bool) -> str:
    return "meets" if ok else "misses"


def _targets(res: Results) -> list[str]:
    """Issue 15's targets that this run measured (the req/s and TTFT ones only when Dynamo ran in it too)."""
    lines = ["| target (issue 15) | measured | |", "|---|---|---|"]

    def rps(s: float, kind: str, c: int) -> float:
        return _med(res.rows.get((s, kind, c), []), "req_per_s")

    for s in res.speedups:
        for c in res.levels:
            d = rps(s, "dynamo", c)
            # At speedup 10 the issue sets a first milestone and a goal; the CPU targets hold at every speedup.
            goals = (
                (("split", 1.0, ""), ("router", 0.9, ""), ("run", 1.0, ""))
                if s >= 100
                else (("split", 0.7, " (first milestone)"), ("split", 1.0, " (goal)"))
            )
            for kind, goal, what in goals:
                r = rps(s, kind, c)
                if not math.isnan(r) and not math.isnan(d):
                    lines.append(f"| {LABELS[kind]} ≥ {goal}× Dynamo req/s{what}, speedup {s:g}, c={c} | {r / d:.2f}× | "
                                 f"{_verdict(r / d >= goal)} |")  # fmt: skip
            split = res.rows.get((s, "split", c), [])
            if split:
                fe = _cpu(split, "frontend")
                worst = max(_cpu(split, p) for p in split[0]["cpu_ms"] if p.startswith("worker "))
                lines.append(f"| frontend ≤ 4 CPU-ms/request, speedup {s:g}, c={c} | {fe:.2f} | {_verdict(fe <= 4)} |")
                lines.append(f"| each worker ≤ 2 CPU-ms/request, speedup {s:g}, c={c} | {worst:.2f} (max) | "
                             f"{_verdict(worst <= 2)} |")  # fmt: skip
            router = res.rows.get((s, "router", c), [])
            if router:
                hop = _cpu(router, "router")
                lines.append(f"| router process < 1.5 CPU-ms/request, speedup {s:g}, c={c} | {hop:.2f} | "
                             f"{_verdict(hop < 1.5)} |")  # fmt: skip
    if "engine" in res.overhead:
        eng = res.overhead["engine"]
        for kind in ("split", "router", "run"):
            row = res.overhead.get(kind)
            if row is None:
                continue
            for what in ("ttft", "itl"):
                delta = row[f"{what}_p50_ms"] - eng[f"{what}_p50_ms"]
                tail = ", ".join(f"{p} {row[f'{what}_{p}_ms'] - eng[f'{what}_{p}_ms']:+.2f}" for p in ("p90", "p99"))
                lines.append(f"| {LABELS[kind]}: {what.upper()} p50 within 1 ms of the engine alone (speedup 1, c=1) | "
                             f"{delta:+.2f} ms (not judged: {tail} ms) | {_verdict(delta <= 1.0)} |")  # fmt: skip
        if "split" in res.overhead and "dynamo" in res.overhead:
            a, b = res.overhead["split"]["ttft_p50_ms"], res.overhead["dynamo"]["ttft_p50_ms"]
            tail = ", ".join(
                f"{p} {res.overhead['split'][f'ttft_{p}_ms']:.1f} vs {res.overhead['dynamo'][f'ttft_{p}_ms']:.1f}"
                for p in ("p90", "p99")
            )
            lines.append(f"| split mesh TTFT p50 ≤ Dynamo's at c=1 (speedup 1) | {a:.1f} vs {b:.1f} ms (not judged: "
                         f"{tail} ms) | {_verdict(a <= b)} |")  # fmt: skip
    return lines if len(lines) > 2 else []


def _targets_38(res: Results) -> list[str]:
    """Issue 38's targets that this run measured: the default configuration's, or those at one event per token."""
    if "dynamo" not in res.systems:
        return []
    one_per_token = "--no-coalesce" in res.extra
    lines = [f"| target (issue 38, {'`--no-coalesce`' if one_per_token else 'default configuration'}) | measured | |",
             "|---|---|---|"]  # fmt: skip

    def rows(s: float, kind: str, c: int) -> list[Row]:
        return res.rows.get((s, kind, c), [])

    def per_token(r: Sequence[Row]) -> float:
        return _cpu(r, "frontend") * 1000 / _med(r, "mean_osl")

    for s in res.speedups:
        for c in res.levels:
            dyn = rows(s, "dynamo", c)
            if not dyn:
                continue
            d_rps, d_events = _med(dyn, "req_per_s"), _med(dyn, "events_per_request")
            for kind in ("split", "router"):
                mine = rows(s, kind, c)
                if not mine:
                    continue
                label, rps = f"{LABELS[kind]}, speedup {s:g}, c={c}", _med(mine, "req_per_s")
                if one_per_token:
                    events = _med(mine, "events_per_request")
                    lines.append(f"| {label}: SSE events per response ≥ 0.95× Dynamo's | {events:.1f} vs {d_events:.1f} "
                                 f"({events / d_events:.2f}×) | {_verdict(events >= 0.95 * d_events)} |")  # fmt: skip
                    if s < 100:
                        lines.append(f"| {label}: ≥ 1.0× Dynamo req/s | {rps / d_rps:.2f}× | {_verdict(rps >= d_rps)} |")
                    fe, d_fe = per_token(mine), per_token(dyn)
                    lines.append(f"| {label}: frontend CPU µs per output token ≤ Dynamo's | {fe:.1f} vs {d_fe:.1f} | "
                                 f"{_verdict(fe <= d_fe)} |")  # fmt: skip
                    continue
                goal = 1.5 if s >= 100 else 1.1
                lines.append(f"| {label}: ≥ {goal}× Dynamo req/s | {rps / d_rps:.2f}× | {_verdict(rps >= goal * d_rps)} |")
                mesh, d_mesh = _mesh_cpu(mine), _mesh_cpu(dyn)
                lines.append(f"| {label}: whole-mesh CPU per request ≤ 0.8× Dynamo's | {mesh:.2f} vs {d_mesh:.2f} ms "
                             f"({mesh / d_mesh:.2f}×) | {_verdict(mesh <= 0.8 * d_mesh)} |")  # fmt: skip
                if kind == "router" and (split := rows(s, "split", c)):
                    vs_split = rps / _med(split, "req_per_s")
                    lines.append(f"| {label}: ≥ 0.9× the split mesh's req/s | {vs_split:.2f}× | {_verdict(vs_split >= 0.9)} |")
                engines = res.engines.get((s, c))
                if s < 100 and c == 32 and engines:
                    itl, e_itl = _med(mine, "itl_p50_ms"), _med(engines, "itl_p50_ms")
                    lines.append(f"| {label}: ITL p50 within 0.3 ms of the engines alone | {itl:.2f} vs {e_itl:.2f} ms "
                                 f"({itl - e_itl:+.2f}) | {_verdict(itl - e_itl <= 0.3)} |")  # fmt: skip
    return lines if len(lines) > 2 else []


def _overhead(res: Results) -> str:
    eng = res.overhead.get("engine")
    out = [
        "| path | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | SSE chunks per response | "
        "TTFT p50 − engine | ITL p50 − engine |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind, row in res.overhead.items():
        label = "mocker engine alone (in-process LLMEngine API)" if kind == "engine" else LABELS[kind]
        d_ttft = d_itl = "–"
        if eng is not None and kind != "engine":
            d_ttft = f"{row['ttft_p50_ms'] - eng['ttft_p50_ms']:+.2f} ms"
            d_itl = f"{row['itl_p50_ms'] - eng['itl_p50_ms']:+.3f} ms"
        out.append(f"| {label} | {_triple([row], 'ttft', '{:.1f}')} | {_triple([row], 'itl', '{:.2f}')} | "
                   f"{figure(row.get('events_per_request', math.nan))} | {d_ttft} | {d_itl} |")  # fmt: skip
    return "\n".join(out)


def _profiles(res: Results) -> str:
    parts = []
    for (s, kind), procs in res.profiles.items():
        for name, prof in procs.items():
            if not prof.samples:
                parts.append(f"*{LABELS[kind]}, speedup {s:g}, {name}*: no samples (py-spy could not attach)\n")
                continue
            rows = "\n".join(f"| {pct:.1f} | `{frame}` |" for pct, frame in prof.self_top)
            incl = "; ".join(f"`{f.removeprefix('meshllm/')}` {p:.0f} %" for p, f in prof.meshllm_inclusive[:6])
            pkgs = "; ".join(f"{f} {p:.0f} %" for p, f in prof.by_package[:8])
            parts.append(
                f"*{LABELS[kind]}, speedup {s:g}, {name}* ({prof.samples:,} samples), self time:\n\n"
                f"| % | frame |\n|---:|---|\n{rows}\n\nself time by package: {pkgs}\n\n"
                f"meshllm frames, inclusive (below the event loop): {incl or '–'}\n"
            )
    return "\n".join(parts)


def section(res: Results, heading: str) -> str:
    info = res.info
    isl = statistics.median(r["mean_isl"] for rows in res.rows.values() for r in rows) if res.rows else math.nan
    osl = statistics.median(r["mean_osl"] for rows in res.rows.values() for r in rows) if res.rows else math.nan
    text = [
        heading,
        "",
        f"`{res.argv}` on {info.get('date', '')} ({info['machine']}, Python {info['python']}, commit {info['commit']}; "
        f"{info['packages']}).",
        f"Load: `meshllm bench` in its own process, {res.load}; measured mean ISL {figure(isl, '{:.0f}')} and OSL "
        f"{figure(osl, '{:.0f}')} tokens (server-counted, SmolLM2 tokenizer). Each system in turn, never two at once, "
        f"freshly started per speedup and repeat: {res.workers} mocker workers, {res.router_mode} routing"
        f"{'; extra flags: ' + res.extra if res.extra else ''}; per "
        f"level {res.warmup} warm-up requests (unmeasured, other prompts), then {res.requests} measured requests; "
        f"{res.repeats} repeat(s), medians shown (req/s range in brackets when repeated); a ratio divides two "
        f"medians. {load_sentence(res.load_avg)}",
        "",
    ]
    if res.failures:
        text += ["**Failed** (no figures from these):", "", *(f"- {f}" for f in res.failures), ""]
    installed = next((p.split(" ", 1)[1] for p in info["packages"].split(", ") if p.startswith("ai-dynamo ")), None)
    if "dynamo" in res.systems and installed not in (None, DYNAMO_VERSION):
        text += [f"**Dynamo's installed version is {installed}**, not the {DYNAMO_VERSION} the labels name.", ""]
    if info.get("fingerprint_end", info["fingerprint"]) != info["fingerprint"]:
        text += ["**The code under services/ changed while this ran** (someone edited the tree): systems started "
                 "later ran newer code, so the figures mix versions.", ""]  # fmt: skip
    for s in res.speedups if res.rows else []:
        text += [f"**--speedup-ratio {s:g}**", "", _speed_tables(res, s), ""]
    if targets := _targets(res):
        text += targets + [""]
    if targets := _targets_38(res):
        text += targets + [""]
    if res.overhead:
        text += [
            f"**Overhead at --speedup-ratio 1, concurrency 1** ({res.overhead_requests} requests each; the engine "
            "alone is the mocker driven in-process through its LLMEngine API with the same chat-templated, "
            "tokenized prompts; TTFT = call → first chunk with tokens, ITL = gaps between chunks with tokens):",
            "",
            _overhead(res),
            "",
        ]
    if res.profiles:
        c, n = res.profile_level or (0, 0)
        text += [
            f"**Profiles** (py-spy record -f raw --nonblocking --subprocesses on each meshllm process during an "
            f"extra, unmeasured level of {n} requests at concurrency {c}; percent of that process's samples; "
            "py-spy sees Python frames only, so time in native code lands on the innermost Python frame: under "
            "uvloop the C event loop, its transports and grpc's C core show as `asyncio/runners.py Runner.run`, "
            "under the stdlib loop native callbacks show as `asyncio/events.py Handle._run`):",
            "",
            _profiles(res),
        ]
    text += [
        "Systems: *meshllm split* = etcd + nats-server + `meshllm frontend` (embedded routing core) + "
        "`meshllm worker --engine mocker` processes, each its own OS process on loopback; *+ router process* puts "
        "`meshllm router` between the frontend (`--router-address`) and the workers; *meshllm run* is all of it in "
        "one process; *Dynamo 1.6.1* is ../shared/anchors/dynamo/up.sh agg (its frontend with the embedded router, "
        "mocker processes, its own etcd and NATS). Every meshllm side tokenizes with the SmolLM2 directory Dynamo "
        "serves (`--model-path`).",
        "",
        "SSE chunks per response count the events that carried text. TTFT is request sent → first event with "
        "text, ITL the gaps between such events (a server that coalesces sends fewer, larger events; an ITL p50 "
        "near 0 means events reach the client several per read, in bursts). The load "
        "generator column is the whole `meshllm bench` process's CPU (start-up included) per measured request.",
    ]
    return "\n".join(text) + "\n"


def summary_line(kind: str, c: int, row: Mapping[str, Any]) -> str:
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in row["cpu_ms"].items())
    return (
        f"    {LABELS[kind]}, c={c}: {row['req_per_s']:.1f} req/s, {row['output_tok_per_s']:,.0f} tok/s, TTFT p50 "
        f"{row['ttft_p50_ms']:.1f} ms, ITL p50 {row['itl_p50_ms']:.2f} ms, {row.get('events_per_request') or 0:.1f} "
        f"chunks/resp, errors {row['errors']}; CPU-ms/req: {cpu}; whole mesh {sum(row['cpu_ms'].values()):.2f}"
    )

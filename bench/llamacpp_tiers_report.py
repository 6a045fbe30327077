"""bench/llamacpp_tiers.py's report: the "## KV tiers (llama.cpp)" section of docs/benchmarks.md from a run.

A column per configuration (tiers off, tiers on, the control with a slot for every context): TTFT of returning
requests and of first visits, where returning prompts' tokens came from, prefill computed, wall time and whether
greedy outputs matched; then the same through `meshllm run` when run with `--mesh`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from harness.llamacpp import fa_flag
from harness.runinfo import llama_cpp_build, load_sentence, machine, today
from harness.stats import pct, triple

from meshllm.engine.base import KvTier

__all__ = ["HEADING", "Result", "differences", "render", "summary"]

HEADING = "## KV tiers (llama.cpp)"


@dataclass
class Result:
    """One request: where it went, its TTFT, its tokens and where its prompt's tokens came from."""

    context: int
    visit: int
    ttft_s: float
    tokens: list[int]
    prompt: int
    cached: int
    restored: dict[KvTier, int] = field(default_factory=dict)


def summary(results: list[Result]) -> dict[str, Any]:
    back = [r for r in results if r.visit > 0]
    first = [r for r in results if r.visit == 0]
    prompt = sum(r.prompt for r in back)
    host = sum(r.restored.get(KvTier.HOST, 0) for r in back)
    disk = sum(r.restored.get(KvTier.DISK, 0) for r in back)
    cached = sum(r.cached for r in back)
    return {
        "ret_ms": [r.ttft_s * 1000 for r in back],
        "first_ms": [r.ttft_s * 1000 for r in first],
        "n_ret": len(back),
        "device": (cached - host - disk) / prompt,
        "host": host / prompt,
        "disk": disk / prompt,
        "computed": (prompt - cached) / prompt,
        "prefill_all": sum(r.prompt - r.cached for r in results),
        "prefill_ret": prompt - cached,
    }


def p3(ms: list[float]) -> str:
    return triple(ms, "{:.0f}")


def render(args: argparse.Namespace, runs: dict[str, dict[str, Any]], loads: list[float]) -> str:
    off, on, ctl = runs["off"], runs["on"], runs["slots"]
    so, sn, sc = summary(off["results"]), summary(on["results"]), summary(ctl["results"])
    n_req = len(off["results"])
    ratio = pct(so["ret_ms"], 50) / pct(sn["ret_ms"], 50)
    target = "meets" if ratio >= 5 else "MISSES"
    usage_rows = []
    for i, tiers in enumerate(on["usage"]):
        for u in tiers:
            rate = f"{u.restore_bytes_per_s / 1e9:.1f} GB/s" if u.restore_bytes_per_s else "no restore measured"
            usage_rows.append(
                f"worker {i} {u.tier.name.lower()}: {u.blocks} blocks, {u.bytes_used / 2**20:.1f} of "
                f"{u.bytes_capacity / 2**20:.0f} MiB, restore {rate}"
            )
    saves = sum(s.saves for s in on["stats"] if s)
    save_ms = sum(s.save_seconds for s in on["stats"] if s) * 1000
    saved_mb = sum(s.saved_bytes for s in on["stats"] if s) / 1e6
    mesh_flag = (" --mesh" if args.mesh else "") + ("" if args.flash_attn else " --no-flash-attn")
    lines = [
        HEADING,
        "",
        f"`flock /tmp/cpu.lock .venv/bin/python bench/llamacpp_tiers.py --repeat {args.repeat}{mesh_flag}` on {today()} "
        f"({machine()}; {llama_cpp_build()}).",
        f"Workload: {args.contexts} contexts of ~{args.context_tokens} tokens (passages of docs/*.md, as of the run), "
        f"{args.visits} visits each (a different question",
        f"each time), {args.repeat} repeat(s) with their own shuffles: {sn['n_ret']} returning requests per configuration.",
        "2 workers (in-process engines, 1 thread each), "
        f"`--n-seq-max {args.n_seq_max} --n-ctx {args.n_ctx} {fa_flag(args)}`: each worker's",
        f"slots hold {args.n_seq_max} of its {args.contexts // 2} contexts. Context i goes to worker i mod 2; each worker serves",
        f"its requests one at a time, both at once; greedy, max_tokens {args.max_tokens}. Tiers on: `--kv-host-bytes "
        f"{args.host_bytes}` (~{args.host_bytes / 2**20:.0f} MiB)",
        f"and `--kv-disk-bytes {args.disk_bytes}` (~{args.disk_bytes / 2**20:.0f} MiB) per worker. Percentiles are over every",
        "request of the kind in all repeats (nearest rank).",
        load_sentence(loads),
        "",
        "| measurement | tiers off | tiers on | control: every context in a slot, no tiers |",
        "|---|---|---|---|",
        f"| TTFT of returning requests, p50 / p90 / p99 ms | {p3(so['ret_ms'])} | {p3(sn['ret_ms'])} | {p3(sc['ret_ms'])} |",
        f"| TTFT of first visits, p50 / p90 / p99 ms | {p3(so['first_ms'])} | {p3(sn['first_ms'])} | {p3(sc['first_ms'])} |",
        *(
            f"| returning prompt tokens {label} | {so[k]:.1%} | {sn[k]:.1%} | {sc[k]:.1%} |"
            for k, label in (
                ("device", "from device slots"),
                ("host", "from host tier"),
                ("disk", "from disk tier"),
                ("computed", "computed"),
            )
        ),
        f"| prefill tokens computed, returning / all requests | {so['prefill_ret']} / {so['prefill_all']} | "
        f"{sn['prefill_ret']} / {sn['prefill_all']} | {sc['prefill_ret']} / {sc['prefill_all']} |",
        f"| wall time of the workload (s, summed over repeats) | {off['wall_s']:.0f} | {on['wall_s']:.0f} | "
        f"{ctl['wall_s']:.0f} |",
        f"| greedy outputs identical to tiers off | – | {n_req - len(on['diffs'])} of {n_req} | "
        f"{n_req - len(ctl['diffs'])} of {n_req} |",
        "",
        f"- TTFT p50 of returning requests: **{ratio:.1f}× lower with tiers on** ({target} the ≥ 5× target); "
        f"p90 {pct(so['ret_ms'], 90) / pct(sn['ret_ms'], 90):.1f}×, p99 {pct(so['ret_ms'], 99) / pct(sn['ret_ms'], 99):.1f}×; "
        f"the control (slots for every context: the best a device cache alone does) has a p50 "
        f"{pct(sc['ret_ms'], 50) / pct(sn['ret_ms'], 50):.2f}× the tiers'.",
        *(f"- Output differing from tiers off, tiers on: {d}." for d in on["diffs"]),
        *(f"- Output differing from tiers off, control: {d}." for d in ctl["diffs"]),
        f"- Saving evicted prefixes (tiers on): {saves} saves, {saved_mb:.0f} MB, {save_ms:.0f} ms on the engine threads "
        f"in all ({save_ms / max(saves, 1):.1f} ms each: state export, host copy, disk file write).",
        *(f"- Tier usage at the end of the last repeat, {row}." for row in usage_rows),
        "",
        *mesh_lines(args, runs),
        "First visits cost about the same in every configuration (nothing to restore); a returning request with tiers",
        "off finds its context in a slot only when no other context passed through that worker since. With tiers on",
        "the context comes back from host memory or disk (whole blocks: up to 15 tokens of it plus the question",
        "are computed). The restore bandwidth is bytes restored over the time to read and load them",
        "(`llama_state_seq_set_data`), as reported in `LoadMetrics.tiers`. Where an output differs, the greedy",
        "tokens agree up to the token named and the two runs computed the prompt in batches of different shapes",
        "(its cached counts): llama.cpp's CPU kernels are not bit-identical across batch shapes, so near-ties",
        'can flip (docs/engines/llamacpp.md, "Exactness"); the control shows what a device cache alone does.',
        "",
    ]
    return "\n".join(lines)


def differences(base: list[Result], other: list[Result]) -> list[str]:
    """Requests whose greedy tokens differ from `base`'s: where, and how each computed its prompt."""
    ref = {(r.context, r.visit): r for r in base}
    out = []
    for r in other:
        b = ref[r.context, r.visit]
        if b.tokens != r.tokens:
            if b.tokens and isinstance(b.tokens[0], str):  # through the mesh: the text
                where = "the text"
            else:
                at = next((i for i, (x, y) in enumerate(zip(b.tokens, r.tokens, strict=False)) if x != y), len(b.tokens))
                where = f"token {at + 1} of {len(b.tokens)}"
            out.append(f"context {r.context} visit {r.visit}: {where}, {b.prompt}-token prompt, "
                       f"cached {b.cached} (off) vs {r.cached}")  # fmt: skip
    return out


def mesh_lines(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> list[str]:
    """The same workload through `meshllm run` (KV router picks the worker), when run with --mesh."""
    if "mesh-on" not in runs:
        return []
    mo, mn = summary(runs["mesh-off"]["results"]), summary(runs["mesh-on"]["results"])
    n_req = len(runs["mesh-off"]["results"])
    return [
        "Through `meshllm run` (`--mesh`: OpenAI completions with token-id prompts → KV router → the same 2 workers,",
        f"one request at a time; tiers on = host tier only, `--kv-host-bytes {args.mesh_host_bytes}`): the router, not",
        "the affinity rule, picks each request's worker.",
        "",
        "| measurement (through the mesh) | tiers off | tiers on |",
        "|---|---|---|",
        f"| TTFT of returning requests, p50 / p90 / p99 ms | {p3(mo['ret_ms'])} | {p3(mn['ret_ms'])} |",
        f"| TTFT of first visits, p50 / p90 / p99 ms | {p3(mo['first_ms'])} | {p3(mn['first_ms'])} |",
        *(
            f"| returning prompt tokens {label} | {mo[k]:.1%} | {mn[k]:.1%} |"
            for k, label in (("device", "from device slots"), ("host", "from host tier"), ("computed", "computed"))
        ),
        f"| prefill tokens computed, returning / all requests | {mo['prefill_ret']} / {mo['prefill_all']} | "
        f"{mn['prefill_ret']} / {mn['prefill_all']} |",
        f"| greedy outputs (text) identical to tiers off | – | {n_req - len(runs['mesh-on']['diffs'])} of {n_req} |",
        "",
        f"- Through the mesh, TTFT p50 of returning requests is {pct(mo['ret_ms'], 50) / pct(mn['ret_ms'], 50):.1f}× lower "
        f"with tiers on (p90 {pct(mo['ret_ms'], 90) / pct(mn['ret_ms'], 90):.1f}×, "
        f"p99 {pct(mo['ret_ms'], 99) / pct(mn['ret_ms'], 99):.1f}×).",
        *(f"- Output differing from tiers off (mesh): {d}." for d in runs["mesh-on"]["diffs"]),
        "",
    ]

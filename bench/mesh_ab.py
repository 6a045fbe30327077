"""A change against its base, side by side: this tree's services and another commit's, interleaved in one run.

    .venv/bin/python bench/mesh_ab.py --base HEAD~1                  # router process system, speedup 10, c=32,64, 3 pairs
    .venv/bin/python bench/mesh_ab.py --base 6d82cd3 --systems split,router --speedup 1000,10 --pairs 4 --write

On a shared 2-core machine the same system moves by 10 % or more from one minute to the next, so a change's
effect is measured against its base in the same run, not against an older record. Each pair runs both sides
of every system one after the other, each freshly started, the order alternating from pair to pair (base
first, then head first, ...) so that a drift of the machine falls on both. Only the services differ: the
base's `services/` (a temporary `git worktree` of `--base`) comes first on every meshllm process's
PYTHONPATH (`SystemSpec.services_path`); this tree's load generator, prompts and CPU meter drive both sides.
Per system, speedup and concurrency it prints the median (range) of req/s, TTFT and ITL p50, and each
process's CPU-ms per request on each side, and head ÷ base. `--write` puts the table in docs/benchmarks.md
under "## Change against its base" (": LABEL" added with `--label`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.buildinfo import build_info
from harness.doc import write_section
from harness.runinfo import LoadMonitor, command_line, load_sentence
from harness.systems import LABELS, MODEL_DIR, ROOT, SystemSpec, start_system
from mesh import EXTRA_COMMANDS, measure_level
from mesh_load import Load, calibrate_chars_per_token

from meshllm.frontend.text.tokenizer import load_tokenizer

HEADING = "## Change against its base"
SIDES = ("base", "head")


@dataclass(slots=True)
class Results:
    """Every measured row, by (system, speedup, concurrency) and side."""

    rows: dict[tuple[str, float, int], dict[str, list[dict[str, Any]]]] = field(default_factory=dict)

    def add(self, key: tuple[str, float, int], side: str, row: dict[str, Any]) -> None:
        self.rows.setdefault(key, {s: [] for s in SIDES})[side].append(row)


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[tuple[Path, str]]:
    """A detached `git worktree` of `rev` in a temporary directory, and its short commit; removed afterwards."""
    commit = _git("rev-parse", "--short", f"{rev}^{{commit}}")
    with tempfile.TemporaryDirectory(prefix="meshllm-ab-") as tmp:
        path = Path(tmp) / "base"
        _git("worktree", "add", "--detach", str(path), commit)
        try:
            _build_extensions(path)
            yield path, commit
        finally:
            _git("worktree", "remove", "--force", str(path))


def _build_extensions(path: Path) -> None:
    """Build the base's C extensions (the router's KV index) in place, as `pip install -e .` does for this tree, so
    both sides run compiled code; a base without them, or a machine that cannot build them, runs its Python code."""
    if not (path / "setup.py").exists():
        return
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=path, capture_output=True,
                         text=True, check=False)  # fmt: skip
    if out.returncode != 0:
        print(f"bench/mesh_ab.py: the base's C extensions did not build; it runs without them: {out.stderr.strip()[-300:]}",
              file=sys.stderr)  # fmt: skip


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"bench/mesh_ab.py: git {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout.strip()


def order(pair: int) -> tuple[str, str]:
    """The sides of pair `pair` in running order: base first in even pairs, head first in odd ones."""
    return SIDES if pair % 2 == 0 else SIDES[::-1]


def _median(rows: Sequence[dict[str, Any]], get: Any) -> tuple[float, float, float] | None:
    vals = [v for r in rows if (v := get(r)) is not None]
    return (statistics.median(vals), min(vals), max(vals)) if vals else None


def _fmt(m: tuple[float, float, float] | None, fmt: str) -> str:
    if m is None:
        return "–"
    med, lo, hi = m
    return fmt.format(med) if lo == hi else f"{fmt.format(med)} ({fmt.format(lo)}–{fmt.format(hi)})"


def metric_rows(sides: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str, str, str, str]]:
    """(metric, base, head, head ÷ base, whether the two sides' ranges overlap) for one system, speedup and
    concurrency: where they overlap, the pairs do not tell the two apart."""
    procs = [p for p in (sides["head"] or sides["base"])[0]["cpu_ms"] if p not in ("etcd", "nats")]
    metrics: list[tuple[str, Any, str]] = [
        ("req/s", lambda r: r["req_per_s"], "{:.1f}"),
        ("TTFT p50 ms", lambda r: r.get("ttft_p50_ms"), "{:.1f}"),
        ("ITL p50 ms", lambda r: r.get("itl_p50_ms"), "{:.2f}"),
        ("SSE events per response", lambda r: r.get("events_per_request"), "{:.1f}"),
        *((f"CPU-ms/request, {p}", (lambda r, p=p: r["cpu_ms"].get(p)), "{:.2f}") for p in procs),
        ("CPU-ms/request, whole mesh", lambda r: sum(r["cpu_ms"].values()), "{:.2f}"),
    ]
    out = []
    for name, get, fmt in metrics:
        base, head = _median(sides["base"], get), _median(sides["head"], get)
        ratio = f"{head[0] / base[0]:.3f}×" if base and head and base[0] else "–"
        overlap = "–" if not (base and head) else ("yes" if base[1] <= head[2] and head[1] <= base[2] else "no")
        out.append((name, _fmt(base, fmt), _fmt(head, fmt), ratio, overlap))
    return out


def render(res: Results, *, argv: str, base: str, head: str, pairs: int, requests: int, info: dict[str, str],
           load_avg: Sequence[float], heading: str = HEADING) -> str:  # fmt: skip
    lines = [
        heading,
        "",
        f"`{argv}` on {info.get('date', '')} ({info['machine']}, Python {info['python']}; {info['packages']}).",
        f"Base {base}, head {head}{info['dirty']}: the same systems, load and measurement, only the services' code "
        f"differs (bench/mesh_ab.py). {pairs} pair(s) of runs, each side freshly started, the order alternating "
        f"from pair to pair; {requests} measured requests per level after warm-up; medians (range) over the pairs. "
        f"{load_sentence(load_avg)}",
        "",
        "| system | speedup | conc | metric | base | head | head ÷ base | ranges overlap |",
        "|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for (kind, speedup, c), sides in res.rows.items():
        for name, b, h, ratio, overlap in metric_rows(sides):
            lines.append(f"| {LABELS[kind]} | {speedup:g} | {c} | {name} | {b} | {h} | {ratio} | {overlap} |")
    lines += [
        "",
        "A ratio below 1.0× is less of that metric at head (fewer CPU-ms, less latency, but also fewer req/s). "
        "Where the ranges of the two sides overlap, these pairs do not tell base and head apart: the difference "
        "is within the machine's noise. A process whose code the change does not touch shows that noise too.",
    ]
    return "\n".join(lines) + "\n"


async def run(args: argparse.Namespace, base_services: Path, load: Load, res: Results) -> None:
    for pair in range(args.pairs):
        for speedup in args.speedup:
            for kind in args.systems:
                for side in order(pair):
                    path = str(base_services) if side == "base" else ""
                    extra = {cmd: ["--no-coalesce"] for cmd in EXTRA_COMMANDS} if args.no_coalesce else {}
                    spec = SystemSpec(speedup=speedup, workers=args.workers, services_path=path, extra=extra)
                    async with start_system(kind, spec) as running:
                        for c in args.concurrency:
                            row = await measure_level(running, load, c, args.requests, args.warmup, seed=c)
                            res.add((kind, speedup, c), side, row)
                            print(f"  pair {pair + 1}, {side}: {LABELS[kind]}, speedup {speedup:g}, c={c}: "
                                  f"{row['req_per_s']:.1f} req/s, CPU-ms/req "
                                  + ", ".join(f"{k} {v:.2f}" for k, v in row["cpu_ms"].items()), flush=True)  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    def listed(kind: type) -> Any:
        return lambda s: [kind(x) for x in s.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the commit to compare this tree with (e.g. HEAD~1)")
    p.add_argument("--systems", type=listed(str), default=["router"], help="comma-separated: split, router, run")
    p.add_argument("--speedup", type=listed(float), default=[10.0], help="mocker --speedup-ratio list")
    p.add_argument("--concurrency", type=listed(int), default=[32, 64], help="comma-separated levels")
    p.add_argument("--pairs", type=int, default=3, help="pairs of runs (base and head each) per system and speedup")
    p.add_argument("--requests", type=int, default=640, help="measured requests per level")
    p.add_argument("--warmup", type=int, default=64, help="unmeasured requests before each level")
    p.add_argument("--workers", type=int, default=2, help="mocker worker processes")
    p.add_argument("--no-coalesce", action="store_true", help="every meshllm command with --no-coalesce (one SSE event per step)")
    p.add_argument("--write", action="store_true", help=f"write the table to docs/benchmarks.md ({HEADING})")
    p.add_argument("--label", default="", help=f"what changed: the section becomes '{HEADING}: LABEL'")
    args = p.parse_args(argv)
    bad = [k for k in args.systems if k not in ("split", "router", "run")]
    if bad or not args.systems:
        p.error(f"--systems takes split, router and run; got {','.join(bad) or 'none'}")
    if args.pairs < 1 or args.requests < 1 or args.workers < 1 or not args.concurrency or not args.speedup:
        p.error("--pairs, --requests and --workers must be >= 1; --concurrency and --speedup non-empty")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    for key in [k for k in os.environ if k.startswith(("MESHLLM_", "OTEL_"))]:
        del os.environ[key]  # the services read these; the benchmark sets what it means explicitly
    import uvloop

    load = Load(chars_per_token=calibrate_chars_per_token(load_tokenizer(str(MODEL_DIR)), Load()))
    res = Results()
    info = build_info() | {"date": datetime.date.today().isoformat()}
    info["dirty"] = " (with uncommitted changes)" if info["commit"].endswith("changes") else ""
    head = info["commit"].split(" ")[0]
    with worktree(args.base) as (base_dir, base), LoadMonitor() as monitor:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            try:
                runner.run(run(args, base_dir / "services", load, res))
            except (asyncio.CancelledError, KeyboardInterrupt):
                print("bench/mesh_ab.py: interrupted; every process it started was stopped", file=sys.stderr)
                return 130
    heading = f"{HEADING}: {args.label}" if args.label else HEADING
    text = render(res, argv=command_line(["bench/mesh_ab.py", *argv]), base=base, head=head, pairs=args.pairs,
                  requests=args.requests, info=info, load_avg=monitor.samples, heading=heading)  # fmt: skip
    print(text)
    if args.write:
        write_section(heading, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

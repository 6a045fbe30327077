"""Running checks: results, reports, options from strings, the command line."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from meshllm.engine.base import EngineConfig
from meshllm.testing.conformance.checks import CHECKS
from meshllm.testing.conformance.kit import (
    SHAREABLE_CLAUSES,
    TIER_CLAUSES,
    Clause,
    ConformanceError,
    ConformanceOptions,
    EngineFactory,
    NotApplicable,
    SharedEngine,
    _Probe,
    factory_for,
)

__all__ = ["CheckResult", "ConformanceReport", "options_from_strings", "run_check", "run_conformance"]  # and `main`, the CLI

# ------------------------------------------------------------------ running


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The outcome of one clause's check; `skipped` says why a clause did not apply (it then counts as passed)."""

    clause: Clause
    error: ConformanceError | None
    duration_s: float
    notes: tuple[str, ...] = ()
    skipped: str = ""

    @property
    def passed(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class ConformanceReport:
    """Every clause's result, in order."""

    results: tuple[CheckResult, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failed(self) -> list[Clause]:
        return [r.clause for r in self.results if not r.passed]

    def result(self, clause: Clause | str) -> CheckResult:
        return next(r for r in self.results if r.clause == clause)

    def summary(self) -> str:
        lines = []
        for r in self.results:
            word = "SKIP" if r.skipped else "PASS" if r.passed else "FAIL"
            head = f"{word} {r.clause:<30} {r.duration_s:6.2f} s"
            lines.append(f"{head}  {r.skipped}" if r.skipped else head if r.error is None else f"{head}  {r.error}")
            lines.extend(f"     note: {n}" for n in r.notes)
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        errors = [r.error for r in self.results if r.error is not None]
        if errors:
            raise ExceptionGroup(f"{len(errors)} conformance clause(s) failed", errors)


async def run_check(
    clause: Clause | str,
    factory: EngineFactory,
    options: ConformanceOptions | None = None,
    *,
    shared: SharedEngine | None = None,
) -> CheckResult:
    """Run one clause's check; failures are returned, never raised. `shared`, a started engine, serves the clauses
    of SHAREABLE_CLAUSES (and tells the tier clauses whether tiers apply); the others ignore it."""
    clause = Clause(clause)
    notes: list[str] = []
    usable = shared if clause in SHAREABLE_CLAUSES or clause in TIER_CLAUSES else None
    probe = _Probe(clause, options or ConformanceOptions(), notes, usable)
    t0 = time.monotonic()
    error: ConformanceError | None = None
    skipped = ""
    try:
        await CHECKS[clause](factory, probe)
    except NotApplicable as exc:
        skipped = str(exc)
    except ConformanceError as exc:
        error = exc if exc.clause is clause else ConformanceError(clause, str(exc))
    except Exception as exc:
        error = ConformanceError(clause, f"unexpected {type(exc).__name__}: {exc}")
    return CheckResult(clause, error, time.monotonic() - t0, tuple(notes), skipped)


async def run_conformance(
    factory: EngineFactory,
    options: ConformanceOptions | None = None,
    *,
    clauses: Sequence[Clause | str] | None = None,
    share_engine: bool = False,
) -> ConformanceReport:
    """Run the checks of `clauses` (default: all) one after another against fresh engines.

    With `share_engine`, the clauses of SHAREABLE_CLAUSES run in turn on one started engine, as a server would use
    it (an engine that loads slowly then starts about a third as often). If that engine does not start, they run on
    fresh engines, where each reports the failure itself."""
    chosen = list(CHECKS) if clauses is None else [Clause(c) for c in clauses]
    options = options or ConformanceOptions()
    results: dict[Clause, CheckResult] = {}
    if share_engine and any(c in SHAREABLE_CLAUSES for c in chosen):
        shared = await _start_shared(factory, options)
        if shared is not None:
            try:
                for c in chosen:
                    if c in SHAREABLE_CLAUSES:
                        results[c] = await run_check(c, factory, options, shared=shared)
            finally:
                await _Probe(Clause.START_CONFIG, options, []).cleanup_quietly(shared.engine)
            if isinstance(shared.config, EngineConfig) and not shared.config.kv_tiers:
                for c in chosen:
                    if c in TIER_CLAUSES:  # they skip, knowing from the shared engine's config that no tiers apply
                        results[c] = await run_check(c, factory, options, shared=shared)
    for c in chosen:
        if c not in results:
            results[c] = await run_check(c, factory, options)
    return ConformanceReport(tuple(results[c] for c in chosen))


async def _start_shared(factory: EngineFactory, options: ConformanceOptions) -> SharedEngine | None:
    probe = _Probe(Clause.START_CONFIG, options, [])
    try:
        engine = await probe.new_engine(factory)
    except ConformanceError:
        return None
    try:
        config = await probe.call("start()", engine.start("conformance-shared"), options.start_timeout_s)
    except ConformanceError:
        await probe.cleanup_quietly(engine)
        return None
    return SharedEngine(engine, config)


def options_from_strings(pairs: Sequence[str], base: ConformanceOptions | None = None) -> ConformanceOptions:
    """Apply `NAME=VALUE` overrides (e.g. "timeout_s=5") to ConformanceOptions."""
    base = base or ConformanceOptions()
    types = {f.name: type(getattr(base, f.name)) for f in fields(base)}
    changes: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or name not in types:
            raise ValueError(f"conformance option {pair!r}: expected NAME=VALUE with NAME in {', '.join(types)}")
        kind = types[name]
        if kind is bool:
            changes[name] = raw.strip().lower() in ("1", "true", "yes", "on")
        elif kind is tuple:
            changes[name] = tuple(int(t) for t in raw.replace(",", " ").split())
        else:
            changes[name] = kind(raw)
    return replace(base, **changes)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m meshllm.testing.conformance module:Class [-- engine flags]`: print the report."""
    from meshllm.config import ConfigError
    from meshllm.engine import load_engine_class
    from meshllm.lifecycle import command_error

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        print("usage: python -m meshllm.testing.conformance NAME|module:Class [-- engine flags]", file=sys.stderr)
        return 2
    try:
        cls = load_engine_class(args[0])
    except ConfigError as exc:
        return command_error("conformance", exc.message)
    engine_args = args[2:] if args[1:2] == ["--"] else args[1:]
    report = asyncio.run(run_conformance(factory_for(cls, engine_args)))
    print(report.summary())
    return 0 if report.passed else 1

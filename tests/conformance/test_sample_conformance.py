"""The conformance kit passes for the `sample` engine, every clause, with and without a per-token delay."""

from __future__ import annotations

import pytest

from meshllm.engine import load_engine_class
from meshllm.engine.sample import SampleEngine
from meshllm.testing.conformance import (
    CHECKS,
    TIER_CLAUSES,
    Clause,
    RecordingSink,
    factory_for,
    run_check,
    run_conformance,
)


@pytest.mark.parametrize("clause", list(Clause), ids=str)
async def test_sample_passes_clause(clause: Clause) -> None:
    """Locks: sample satisfies every clause of the LLMEngine contract."""
    result = await run_check(clause, factory_for(SampleEngine))
    assert result.passed, result.error
    assert result.notes == (), "sample is deterministic: no check should fall back"


async def test_sample_with_a_token_delay_passes_the_whole_kit() -> None:
    """Locks: the slow path (waiting between tokens, waking early on stop) keeps the contract too."""
    report = await run_conformance(factory_for(SampleEngine, ["--token-delay-ms", "2"]))
    assert report.passed, report.summary()
    assert [r.clause for r in report.results] == list(CHECKS)


async def test_a_shared_engine_passes_the_whole_kit_with_four_starts_instead_of_thirteen() -> None:
    """Locks: share_engine runs the serving clauses on one started engine; only drain and the cleanup clauses (two
    engines) start their own, and the tier clauses skip without starting one."""
    starts: list[str] = []

    async def factory() -> SampleEngine:
        engine = SampleEngine()
        original_start = engine.start

        async def start(worker_id: str):  # type: ignore[no-untyped-def]
            starts.append(worker_id)
            return await original_start(worker_id)

        engine.start = start  # type: ignore[method-assign]
        return engine

    report = await run_conformance(factory, share_engine=True)
    assert report.passed, report.summary()
    assert [r.clause for r in report.results] == list(CHECKS)
    assert {r.clause for r in report.results if r.skipped} == set(TIER_CLAUSES)
    assert len(starts) == 4, starts
    starts.clear()
    assert (await run_conformance(factory)).passed
    assert len(starts) == 13, starts


async def test_the_builtin_name_resolves_to_the_sample_engine() -> None:
    """Locks: `--engine sample` is the engine the kit checks here."""
    assert load_engine_class("sample") is SampleEngine


async def test_the_kit_gives_the_engine_a_recording_sink_before_start() -> None:
    """Locks: engines see a sink before start; sample reports its load through it."""
    seen: list[object] = []

    async def factory() -> SampleEngine:
        engine = SampleEngine()
        original_start = engine.start

        async def start(worker_id: str):  # type: ignore[no-untyped-def]
            seen.append(engine.sink)
            return await original_start(worker_id)

        engine.start = start  # type: ignore[method-assign]
        return engine

    result = await run_check(Clause.BASIC_GENERATE, factory)
    assert result.passed, result.error
    (sink,) = seen
    assert isinstance(sink, RecordingSink)
    assert [m.running for m in sink.loads] == [1, 0]


def test_the_command_line_prints_the_report_and_exits_by_its_outcome(capsys: pytest.CaptureFixture[str]) -> None:
    """Locks: `python -m meshllm.testing.conformance NAME -- flags` works without pytest's plugin."""
    from meshllm.testing.conformance.runner import main

    assert main(["sample", "--", "--model-name", "cli"]) == 0
    out = capsys.readouterr().out
    assert all(f"{'SKIP' if clause in TIER_CLAUSES else 'PASS'} {clause}" in out for clause in Clause)
    assert main(["no_such_module:Engine"]) == 2
    assert "cannot import" in capsys.readouterr().err

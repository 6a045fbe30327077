"""The conformance kit passes for the `mocker` engine (timing model off: --speedup-ratio 0), with and without
host and disk KV tiers (with them, the tier clauses run instead of being skipped).

Like the sample and llamacpp suites, no clause may fall back to a note: the
mocker is the default engine, so losing greedy determinism (or a cleanup that
raises) must fail here rather than pass quietly with a note.
"""

from __future__ import annotations

import pytest
from broken_engines import TIERED_MOCKER_ARGS

from meshllm.engine import load_engine_class
from meshllm.testing.conformance import TIER_CLAUSES, Clause, factory_for, run_check


@pytest.mark.parametrize("clause", list(Clause), ids=str)
async def test_mocker_passes_clause(clause: Clause) -> None:
    """Locks: the default engine satisfies every clause of the LLMEngine contract."""
    result = await run_check(clause, factory_for(load_engine_class("mocker"), ["--speedup-ratio", "0"]))
    assert result.passed, result.error
    assert result.notes == (), f"the mocker is deterministic: no check should fall back ({result.notes})"
    assert bool(result.skipped) == (clause in TIER_CLAUSES), result.skipped


@pytest.mark.parametrize("clause", list(Clause), ids=str)
async def test_mocker_with_kv_tiers_passes_clause(clause: Clause) -> None:
    """Locks: with host and disk tiers the mocker keeps every clause, and the tier clauses really run."""
    result = await run_check(clause, factory_for(load_engine_class("mocker"), TIERED_MOCKER_ARGS))
    assert result.passed, result.error
    assert result.notes == () and result.skipped == "", (result.notes, result.skipped)


@pytest.mark.parametrize("clause", TIER_CLAUSES, ids=str)
async def test_mocker_without_tiers_skips_the_tier_clauses(clause: Clause) -> None:
    result = await run_check(clause, factory_for(load_engine_class("mocker"), ["--speedup-ratio", "0"]))
    assert result.passed and "no lower KV tiers" in result.skipped

"""The kit catches each broken clause: a broken engine fails exactly its clause, with a message naming it."""

from __future__ import annotations

import time

import pytest
from broken_engines import BROKEN, HangingEngine

from meshllm.testing.conformance import CHECKS, Clause, ConformanceOptions, factory_for, run_check, run_conformance

FAST = ConformanceOptions(timeout_s=5.0, start_timeout_s=5.0)


def test_every_clause_has_a_broken_engine() -> None:
    """Locks: adding a clause to the kit without a broken engine that proves the check works fails here."""
    assert set(BROKEN) == set(CHECKS) == set(Clause)


@pytest.mark.parametrize("share_engine", [False, True], ids=["fresh engines", "shared engine"])
@pytest.mark.parametrize("clause", list(Clause), ids=str)
async def test_a_broken_engine_fails_exactly_its_clause_with_a_message_naming_it(clause: Clause, share_engine: bool) -> None:
    """Locks: the engine that breaks one clause fails that clause, and only that one, also when the serving clauses
    share one started engine."""
    report = await run_conformance(factory_for(BROKEN[clause]), FAST, share_engine=share_engine)
    assert report.failed == [clause], report.summary()
    error = report.result(clause).error
    assert error is not None and error.clause is clause
    assert str(error).startswith(f"[{clause}]") and clause.text in str(error)


@pytest.mark.parametrize("where", ["start", "generate", "drain", "cleanup"])
async def test_a_hanging_engine_fails_a_check_instead_of_hanging_the_kit(where: str) -> None:
    """Locks: every engine call runs under a timeout that fails the clause."""
    engine_class = type(f"HangsIn{where.title()}", (HangingEngine,), {"hang": where})
    clause = {
        "start": Clause.START_CONFIG,
        "generate": Clause.BASIC_GENERATE,
        "drain": Clause.DRAIN,
        "cleanup": Clause.CLEANUP_WITHOUT_START,
    }[where]
    options = ConformanceOptions(timeout_s=0.2, start_timeout_s=0.2)
    t0 = time.monotonic()
    result = await run_check(clause, factory_for(engine_class), options)
    assert time.monotonic() - t0 < 5.0
    assert result.error is not None and "within 0.2 s" in str(result.error), result.error


async def test_the_report_raises_an_exception_group_of_every_failed_clause() -> None:
    """Locks: raise_if_failed() carries one ConformanceError per failed clause."""
    report = await run_conformance(factory_for(BROKEN[Clause.DRAIN]), FAST, clauses=[Clause.DRAIN, Clause.BASIC_GENERATE])
    with pytest.raises(ExceptionGroup) as info:
        report.raise_if_failed()
    assert [getattr(e, "clause", None) for e in info.value.exceptions] == [Clause.DRAIN]
    assert "FAIL drain" in report.summary() and "PASS basic_generate" in report.summary()

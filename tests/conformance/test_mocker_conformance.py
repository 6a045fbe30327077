"""The conformance kit passes for the `mocker` engine (timing model off: --speedup-ratio 0).

Like the sample and llamacpp suites, no clause may fall back to a note: the
mocker is the default engine, so losing greedy determinism (or a cleanup that
raises) must fail here rather than pass quietly with a note.
"""

from __future__ import annotations

import pytest

from meshllm.engine import load_engine_class
from meshllm.testing.conformance import Clause, factory_for, run_check


@pytest.mark.parametrize("clause", list(Clause), ids=str)
async def test_mocker_passes_clause(clause: Clause) -> None:
    """Locks: the default engine satisfies every clause of the LLMEngine contract."""
    result = await run_check(clause, factory_for(load_engine_class("mocker"), ["--speedup-ratio", "0"]))
    assert result.passed, result.error
    assert result.notes == (), f"the mocker is deterministic: no check should fall back ({result.notes})"

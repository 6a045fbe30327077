"""The conformance kit passes for the `mocker` engine (timing model off: --speedup-ratio 0)."""

from __future__ import annotations

import pytest

from meshllm.engine import load_engine_class
from meshllm.testing.conformance import Clause, factory_for, run_check


@pytest.mark.parametrize("clause", list(Clause), ids=str)
async def test_mocker_passes_clause(clause: Clause) -> None:
    """Locks: the default engine satisfies every clause of the LLMEngine contract."""
    result = await run_check(clause, factory_for(load_engine_class("mocker"), ["--speedup-ratio", "0"]))
    assert result.passed, result.error

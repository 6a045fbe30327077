"""What the llama.cpp KV-tier scenarios (bench/llamacpp_tiers.py, bench/llamacpp_trace.py) share: the flags of
the workers' engines, their attention flag, and one streamed completion of token ids through a mesh."""

from __future__ import annotations

import argparse
import time
from typing import Any

__all__ = ["add_engine_args", "fa_flag", "stream_completion"]


def add_engine_args(parser: argparse.ArgumentParser, *, host_bytes: int, disk_bytes: int, repeat: int) -> None:
    """The flags both llama.cpp tier benchmarks share: the workers' engines, their tiers, repeats, output."""
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (greedy)")
    parser.add_argument("--n-seq-max", type=int, default=2, help="slots per worker (the device cache)")
    parser.add_argument("--n-ctx", type=int, default=1024, help="context per slot")
    parser.add_argument("--host-bytes", type=int, default=host_bytes, help="host tier budget per worker (bytes)")
    parser.add_argument("--disk-bytes", type=int, default=disk_bytes, help="disk tier budget per worker (bytes)")
    parser.add_argument("--repeat", type=int, default=repeat, help="repeats of the workload (fresh engines each)")
    parser.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=True, help="the engines' flash attention")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")


def fa_flag(args: argparse.Namespace) -> str:
    """The engines' attention flag: flash attention's CPU kernel changes with the batch shape, plain attention does not
    across prompt splits (docs/engines/llamacpp.md, "Exactness")."""
    return "--flash-attn" if args.flash_attn else "--no-flash-attn"


async def stream_completion(client: Any, model: str, prompt: list[int], max_tokens: int) -> tuple[float, str, int]:
    """One greedy streamed OpenAI completion of token ids: (TTFT s, text, cached prompt tokens from usage)."""
    t0 = time.perf_counter()
    first, text, cached = 0.0, "", 0
    stream: Any = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    async for chunk in stream:
        for choice in chunk.choices or ():
            if choice.text:
                first = first or time.perf_counter() - t0
                text += choice.text
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = int(chunk.usage.prompt_tokens_details.cached_tokens or 0)
    return first, text, cached

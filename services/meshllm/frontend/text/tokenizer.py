"""The `Tokenizer` contract the frontend codes against, and `load_tokenizer` for every source.

Sources (`load_tokenizer(source)`):

    builtin:NAME      the file-free byte tokenizer of the mocker / sample engines
                      (`tokenizer_builtin`)
    DIR               a Hugging Face model directory: tokenizer.json, plus
                      tokenizer_config.json (chat_template, bos/eos tokens),
                      chat_template.jinja / chat_template.json and
                      generation_config.json (eos ids) when present (`meshllm.tokenizers.hf`)
    DIR/tokenizer.json  the same, naming the file
    FILE.gguf         a GGUF model: the exact fast tokenizer is built from the
                      file's metadata and cached on disk (`meshllm.tokenizers.gguf`)

A bad source raises `ConfigError` (an `InvalidArgument`) with a one-line message.

Every tokenizer is safe to share between concurrent requests: `encode` and
`decode` hold no per-call state. `encode_async` moves long prompts to a thread so
that tokenizing them never blocks the event loop. A tokenizer whose `encode`
releases the GIL (`releases_gil = True`: the `tokenizers`-backed ones) has
prompts of more than `PARALLEL_ENCODE_THRESHOLD` characters encoded in a
thread: that work then runs on another core, beside the event loop, instead of
taking turns with it — unless the request is the only one in flight (`alone`),
when nothing waits for the loop. Shorter prompts are cheaper inline than the
hop to the thread and back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Protocol, runtime_checkable

from meshllm.config import ConfigError
from meshllm.frontend.text.builtin_tokenizer import BuiltinTokenizer, builtin_tokenizer
from meshllm.tokenizers.gguf import default_cache_dir, is_gguf, load_gguf_tokenizer
from meshllm.tokenizers.hf import HFTokenizer, load_hf_tokenizer

__all__ = [
    "ASYNC_ENCODE_THRESHOLD",
    "PARALLEL_ENCODE_THRESHOLD",
    "BuiltinTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "builtin_tokenizer",
    "default_cache_dir",
    "encode_async",
    "load_tokenizer",
]

# Prompts longer than this (in characters) are tokenized in a worker thread;
# shorter ones are cheaper inline than the hop to the thread and back.
ASYNC_ENCODE_THRESHOLD = 4096
# The same for tokenizers that release the GIL: above this the thread hop buys a second core. The hop (the
# thread's wake-up, the GIL's hand-back) costs about as much as encoding a ~1,000-character prompt, so only
# prompts whose encode costs well over it go to a thread (was 256: docs/benchmarks.md, "Change against its
# base: prompts encoded inline").
PARALLEL_ENCODE_THRESHOLD = 2048


@runtime_checkable
class Tokenizer(Protocol):
    """What the frontend needs from a tokenizer.

    `name` identifies the source ("builtin:mocker", a directory or file name).
    `eos_token_ids` are every id that ends generation (tokenizer eos plus
    generation_config's), `bos_token_id` is None when the model has none.
    `bos_token` / `eos_token` are their texts ("" when absent), passed to chat
    templates. `chat_template` is the model's Jinja template, None when it has none.
    `vocab_size` counts every id, added tokens included.
    """

    name: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    bos_token: str
    eos_token: str
    vocab_size: int
    chat_template: str | None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token texts in `text` become their ids (HF behaviour).

        `add_special_tokens` adds what the model's post-processor adds (usually bos);
        text rendered by a chat template already holds its special tokens, so the
        default is False.
        """
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids`; invalid UTF-8 becomes U+FFFD; special tokens dropped unless asked."""
        ...

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special (control) token such as bos, eos or a chat marker."""
        ...


def load_tokenizer(source: str, *, cache_dir: Path | None = None) -> Tokenizer:
    """Load the tokenizer named by `source` (see the module docstring).

    `cache_dir` is where GGUF-built tokenizers are kept (default
    `default_cache_dir()`); other sources ignore it.
    """
    if not source or not source.strip():
        raise ConfigError("tokenizer source is empty: give builtin:NAME, a model directory or a .gguf file")
    if source.startswith("builtin:"):
        return builtin_tokenizer(source.removeprefix("builtin:"))
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(
            f"tokenizer source {source!r} does not exist (expected builtin:NAME, a model directory or a .gguf file)"
        )
    if path.is_dir():
        return load_hf_tokenizer(path)
    if path.name == "tokenizer.json":
        return load_hf_tokenizer(path.parent)
    if is_gguf(path):
        return load_gguf_tokenizer(path, cache_dir=cache_dir)
    raise ConfigError(f"tokenizer source {source!r} is neither a model directory, a tokenizer.json nor a GGUF file")


async def encode_async(tok: Tokenizer, text: str, *, add_special_tokens: bool = False, alone: bool = False) -> list[int]:
    """`tok.encode(text)`, in a worker thread when `text` is long (see the module docstring).

    `alone`: the caller's request is the only one this process serves, so no
    other work needs the event loop; a GIL-free tokenizer then encodes prompts
    up to `ASYNC_ENCODE_THRESHOLD` inline, since the thread hop would only add
    its latency (~0.25 ms at concurrency 1 on a 2-core VM) to time to first token.
    """
    releases_gil = getattr(tok, "releases_gil", False)
    limit = PARALLEL_ENCODE_THRESHOLD if releases_gil and not alone else ASYNC_ENCODE_THRESHOLD
    if len(text) <= limit:
        return tok.encode(text, add_special_tokens=add_special_tokens)
    encode = partial(tok.encode, text, add_special_tokens=add_special_tokens)
    return await asyncio.get_running_loop().run_in_executor(None, encode)

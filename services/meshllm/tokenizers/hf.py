"""Hugging Face fast tokenizers (`tokenizers`), loaded from a model directory or built in memory.

A model directory holds `tokenizer.json` and usually `tokenizer_config.json`
(chat_template, bos_token, eos_token), sometimes the template in
`chat_template.jinja` or `chat_template.json` (newer transformers), and
`generation_config.json` whose `eos_token_id` (an int or a list) names every id
that ends generation — often more than the tokenizer's own eos.

Decoding is `tokenizers`' decode; transformers' optional
`clean_up_tokenization_spaces` post-pass is deliberately not applied, so a
streamed decode always equals a one-shot decode.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as FastTokenizer

from meshllm.config import ConfigError
from meshllm.errors import InvalidArgument
from meshllm.tokenizers.bytelevel import ByteTable, byte_table
from meshllm.tokenizers.segments import SegmentCache

__all__ = ["HFTokenizer", "load_hf_tokenizer", "read_json"]


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the metadata the frontend needs (see `Tokenizer`)."""

    # `encode` runs in Rust without the GIL (a thread encodes on another core); only ASCII pieces up to
    # words.MAX_PIECE_CHARS are split in Python (tokenizers/words.py), holding it for about a millisecond at most.
    releases_gil = True

    def __init__(
        self,
        fast: FastTokenizer,
        *,
        name: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self.fast = fast
        self.name = name
        self.chat_template = chat_template
        self.vocab_size: int = fast.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.bos_token_id: int | None = fast.token_to_id(bos_token) if bos_token else None
        eos_ids = [fast.token_to_id(eos_token)] if eos_token else []
        eos_ids += list(extra_eos_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos_ids if i is not None))
        self._special = frozenset(i for i, t in fast.get_added_tokens_decoder().items() if t.special)
        # Pieces between special tokens (a chat's messages) are encoded once and reused (tokenizers/segments.py).
        self.segments: SegmentCache | None = SegmentCache.for_tokenizer(fast)
        self._byte_tables: dict[bool, ByteTable | None] = {}

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        if not add_special_tokens and self.segments is not None:
            return self.segments.encode(text)
        # encode_batch_fast skips the character offsets `encode` computes and nobody here reads (the same
        # ids at about two thirds of the CPU), and releases the GIL while it runs, which `encode` does not.
        ids: list[int] = self.fast.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        try:
            text: str = self.fast.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except OverflowError as exc:  # a negative id does not fit the Rust u32
            raise InvalidArgument(f"invalid token id in {list(ids)[:8]}: {exc}", param="token_ids") from exc
        return text

    def byte_pieces(self, *, skip_special_tokens: bool = True) -> ByteTable | None:
        """Every id's bytes for streaming detokenization (tokenizers/bytelevel.py), or None; built once per flag
        (about 0.1 s for a 49k vocabulary: the frontend builds it when it loads the tokenizer)."""
        key = bool(skip_special_tokens)
        if key not in self._byte_tables:
            self._byte_tables[key] = byte_table(self.fast, skip_special_tokens=key)
        return self._byte_tables[key]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. "<|im_end|>"), None when absent."""
        found: int | None = self.fast.token_to_id(token)
        return found


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, {} when the file is absent; a broken file is a ConfigError."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """bos_token / eos_token as tokenizer_config.json spells them: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, then chat_template.json, then tokenizer_config.json."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read {jinja_file}: {exc}") from exc
    template = read_json(directory / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _eos_ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def load_hf_tokenizer(directory: Path) -> HFTokenizer:
    """The tokenizer of a Hugging Face model directory (see the module docstring)."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConfigError(f"model directory {directory} has no tokenizer.json")
    try:
        fast = FastTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ConfigError(f"cannot load {tokenizer_file}: {str(exc).splitlines()[0] if str(exc) else exc!r}") from exc
    config = read_json(directory / "tokenizer_config.json")
    generation = read_json(directory / "generation_config.json")
    model_config = read_json(directory / "config.json")
    extra_eos = _eos_ids(generation.get("eos_token_id")) or _eos_ids(model_config.get("eos_token_id"))
    return HFTokenizer(
        fast,
        name=directory.resolve().name,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        extra_eos_ids=extra_eos,
        chat_template=_chat_template(directory, config),
    )

"""GGUF tokenizer metadata → the tokenizer.json the model's Hugging Face repository would ship.

Two GGUF tokenizer models are supported, as transformers' GGUF converter and
llama.cpp understand them:

* `gpt2` — byte-level BPE (GPT-2, SmolLM, StarCoder, Llama 3, Qwen 2, ...).
  Tokens are already in the byte-level alphabet ("Ġthe"); merges are stored.
  The pre-tokenizer depends on `tokenizer.ggml.pre`; only the types whose
  Hugging Face pre-tokenizer is known exactly are accepted (`PRE_TOKENIZERS`),
  because a wrong split silently changes token ids.
* `llama` — SentencePiece BPE with byte fallback (Llama 2, Mistral v0.1,
  TinyLlama). Merges are derived from the token scores like transformers'
  converter does; "▁" stands for a space, "<0x0A>" tokens for raw bytes.

Control tokens (type 3) become special added tokens, user-defined ones (type 4)
plain added tokens: both are matched in input text before the model runs.
"""

from __future__ import annotations

from typing import Any

from gguf import Keys, TokenType

from meshllm.config import ConfigError

__all__ = ["PRE_TOKENIZERS", "build_tokenizer_json", "sentencepiece_merges"]

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_BYTE_LEVEL_NO_REGEX = {**_BYTE_LEVEL, "use_regex": False}
_DIGITS = {"type": "Digits", "individual_digits": True}
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _sequence(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"type": "Sequence", "pretokenizers": list(steps)}


# tokenizer.ggml.pre → (normalizer, pre_tokenizer, ignore_merges), as in each family's tokenizer.json.
PRE_TOKENIZERS: dict[str, tuple[dict[str, Any] | None, dict[str, Any], bool]] = {
    "default": (None, _BYTE_LEVEL, False),
    "gpt-2": (None, _BYTE_LEVEL, False),
    "smollm": (None, _sequence(_DIGITS, _BYTE_LEVEL), False),
    "starcoder": (None, _sequence(_DIGITS, _BYTE_LEVEL), False),
    "refact": (None, _sequence(_DIGITS, _BYTE_LEVEL), False),
    "llama-bpe": (None, _sequence(_split(_LLAMA3_REGEX), _BYTE_LEVEL_NO_REGEX), True),
    "llama3": (None, _sequence(_split(_LLAMA3_REGEX), _BYTE_LEVEL_NO_REGEX), True),
    "qwen2": ({"type": "NFC"}, _sequence(_split(_QWEN2_REGEX), _BYTE_LEVEL_NO_REGEX), False),
    "deepseek-r1-qwen": ({"type": "NFC"}, _sequence(_split(_QWEN2_REGEX), _BYTE_LEVEL_NO_REGEX), False),
}


def _added_tokens(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    added = []
    for token_id, (token, token_type) in enumerate(zip(tokens, types, strict=True)):
        if token_type in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN):
            special = token_type != TokenType.USER_DEFINED
            added.append(
                {
                    "id": token_id,
                    "content": token,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": special,
                }
            )
    return added


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)  # a duplicate keeps its first id, as llama.cpp does
    return vocab


def _post_processor(meta: dict[str, Any], tokens: list[str], fallback: dict[str, Any] | None) -> dict[str, Any] | None:
    """Adds bos / eos for `encode(add_special_tokens=True)` when the GGUF says so."""
    prefix, suffix = [], []
    if meta.get(Keys.Tokenizer.ADD_BOS) and isinstance(meta.get(Keys.Tokenizer.BOS_ID), int):
        prefix.append(tokens[meta[Keys.Tokenizer.BOS_ID]])
    if meta.get(Keys.Tokenizer.ADD_EOS) and isinstance(meta.get(Keys.Tokenizer.EOS_ID), int):
        suffix.append(tokens[meta[Keys.Tokenizer.EOS_ID]])
    if not prefix and not suffix:
        return fallback
    vocab = _vocab(tokens)

    def piece(token: str) -> dict[str, Any]:
        return {"SpecialToken": {"id": token, "type_id": 0}}

    single = [*map(piece, prefix), {"Sequence": {"id": "A", "type_id": 0}}, *map(piece, suffix)]
    pair = [*single, *map(piece, prefix), {"Sequence": {"id": "B", "type_id": 1}}, *map(piece, suffix)]
    specials = {t: {"id": t, "ids": [vocab[t]], "tokens": [t]} for t in prefix + suffix}
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials}


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str], types: list[int], source: str) -> dict[str, Any]:
    pre = meta.get(Keys.Tokenizer.PRE) or "default"
    if pre not in PRE_TOKENIZERS:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise ConfigError(
            f"{source}: GGUF pre-tokenizer {pre!r} is not supported (supported: {known}); use the HF model directory"
        )
    normalizer, pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]
    merges = []
    for merge in meta.get(Keys.Tokenizer.MERGES) or []:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ConfigError(f"{source}: malformed GGUF merge {merge!r}")
        merges.append(parts)
    model = {
        "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
        "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
        "vocab": _vocab(tokens), "merges": merges,
    }  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, types),
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "model": model,
        "post_processor": _post_processor(meta, tokens, {**_BYTE_LEVEL, "trim_offsets": False}),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    }


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[list[str]]:
    """BPE merges equivalent to SentencePiece's score-ordered merging (transformers' `generate_merges`)."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] == TokenType.NORMAL}
    found: list[tuple[str, str, float]] = []
    for piece, piece_id in normal.items():
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in normal and piece[k:] in normal]
        local.sort(key=lambda lr: (normal[lr[0]], normal[lr[1]]))
        found.extend((left, right, scores[piece_id]) for left, right in local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [[left, right] for left, right, _ in found]


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], types: list[int], source: str) -> dict[str, Any]:
    scores = meta.get(Keys.Tokenizer.SCORES)
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise ConfigError(f"{source}: a llama (SentencePiece) GGUF tokenizer needs one score per token")
    unk_id = meta.get(Keys.Tokenizer.UNK_ID, 0)
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    add_prefix = meta.get(Keys.Tokenizer.ADD_PREFIX, True)
    model = {
        "type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
        "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
        "vocab": _vocab(tokens), "merges": sentencepiece_merges(tokens, scores, types),
    }  # fmt: skip
    replace_space = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, replace_space]}
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, types),
        "normalizer": normalizer if add_prefix else {"type": "Sequence", "normalizers": [replace_space]},
        "pre_tokenizer": None,
        "model": model,
        "post_processor": _post_processor(meta, tokens, None),
        "decoder": {"type": "Sequence", "decoders": decoders},
    }


def build_tokenizer_json(meta: dict[str, Any], *, source: str) -> dict[str, Any]:
    """The tokenizer.json (as a dict) for GGUF metadata `meta`; `source` names the file in errors."""
    tokens = meta.get(Keys.Tokenizer.LIST)
    if not isinstance(tokens, list) or not tokens:
        raise ConfigError(f"{source}: the GGUF file has no tokenizer tokens")
    types = meta.get(Keys.Tokenizer.TOKEN_TYPE) or [int(TokenType.NORMAL)] * len(tokens)
    if len(types) != len(tokens):
        raise ConfigError(f"{source}: GGUF token_type has {len(types)} entries for {len(tokens)} tokens")
    kind = meta.get(Keys.Tokenizer.MODEL)
    if kind == "gpt2":
        return _byte_level_bpe(meta, tokens, types, source)
    if kind == "llama":
        return _sentencepiece_bpe(meta, tokens, types, source)
    raise ConfigError(
        f"{source}: GGUF tokenizer model {kind!r} is not supported (gpt2 and llama are); use the HF model directory"
    )

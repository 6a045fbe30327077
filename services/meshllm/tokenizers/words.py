"""ASCII text encoded word by word: the ids of each pre-token (word) seen before, from a cache.

A byte-level BPE tokenizer (GPT-2's scheme: SmolLM, StarCoder, GPT-2 itself)
splits text with one regular expression into pre-tokens — a word with its
leading space, a run of digits, of punctuation, of whitespace — and runs BPE
on each pre-token on its own. The ids of a text are therefore the ids of its
pre-tokens, in order, and a pre-token's ids never change. `tokenizers` spends
most of an encode on that split and on the objects it builds per token (a
728-token prompt of random words: 0.32 ms in `encode_batch_fast`); splitting
with Python's `re` and taking each word's ids from a dict costs about a third
of it (bench/tokenize_words.py). Words not seen before are encoded by the
library itself, one call each (`encode_each`), and kept.

Exactness: the split must be the library's. `WordCache.for_tokenizer` returns
None unless the tokenizer has no normalizer, its pre-tokenizer is exactly
`ByteLevel(add_prefix_space=false, use_regex=true)`, alone or after `Digits`,
and its model is BPE without dropout. The library's pattern,

    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+

splits ASCII text as `ASCII_PATTERN` below does (`DIGITS_PATTERN` after
`Digits`), where `\\p{L}` is a-z and
A-Z, `\\p{N}` is 0-9 and `\\s` is tab, newline, vertical tab, form feed,
carriage return and space (not 0x1c-0x1f, which Python's `\\s` includes:
the library's `\\s` is Unicode's White_Space). So only ASCII text takes this
path (`str.isascii`, one C pass); any other text is the library's to encode.
tests/unit/test_tokenizer_words.py compares both over random ASCII texts.

Where most words are new the path costs more than the library's (a whole
encode with word ids, to learn them); a moving average of the share of words
found sends texts of new words (identifiers, encoded data) to the library
instead, all but one in `PROBE_EVERY`, once the cache holds `LEARN_WORDS`. The cache is a dict from word to ids,
emptied when it holds `max_words` words; it is safe to use from several threads (nothing is read from it that
another thread's clear could remove half-way).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from itertools import chain, pairwise
from typing import Any

from tokenizers import Tokenizer as FastTokenizer

__all__ = ["ASCII_PATTERN", "DEFAULT_MAX_WORDS", "DIGITS_PATTERN", "MAX_PIECE_CHARS", "WordCache", "encode_each"]

_WS = r"\t\n\x0b\x0c\r "
ASCII_PATTERN = rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"
# Digits(individual_digits) before ByteLevel (llama.cpp's "smollm" pre-tokenizer, which GGUF-built SmolLM2 tokenizers
# carry): every digit is a piece of its own, and the byte-level pattern runs on the text between digits, so a space
# before a digit stands alone and whitespace before a digit ends as it would at the end of a text.
DIGITS_PATTERN = rf"[0-9]|'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}0-9])|[{_WS}]+"
# Digits without individual_digits: a run of digits is one piece.
DIGIT_RUNS_PATTERN = DIGITS_PATTERN.replace("[0-9]|", "[0-9]+|", 1)
# Longer texts go to the library, which encodes them without the GIL (in a thread: frontend/text/tokenizer.py);
# splitting 16 KiB here takes about a millisecond.
MAX_PIECE_CHARS = 16384
# More than 1 in MOSTLY_NEW words unseen: one encode of the whole text (with word ids) beats a batch of single words.
MOSTLY_NEW = 8
# Below FEW_HITS (a moving average of the share of words found, HIT_WEIGHT for the newest text), texts are of
# words never seen (identifiers, encoded data): the library encodes them whole, and 1 in PROBE_EVERY still goes
# word by word, to learn the words and notice when texts repeat them again.
# Until the cache holds LEARN_WORDS words, every text is learned from (a language's common words fit).
FEW_HITS = 0.5
LEARN_WORDS = 10_000
HIT_WEIGHT = 0.2
PROBE_EVERY = 8
# Words kept (~100 bytes each with their ids): a vocabulary's worth of a language's words, about 10 MB at most.
DEFAULT_MAX_WORDS = 100_000


def encode_each(fast: FastTokenizer, texts: Sequence[str]) -> list[list[int]]:
    """`fast`'s ids of each text (no special tokens), one library call per text.

    Why not one `encode_batch_fast(texts)`: a batch of two or more runs on the library's rayon pool, and the
    hand-off to its threads costs more process CPU than the encode: 2 words
    35 vs 8 µs, 64 words 315 vs 261 µs of process CPU (docs/benchmarks.md "Tokenizer batches against one call
    per text"). A batch of one stays in the calling thread (and still releases the GIL).
    """
    return [fast.encode_batch_fast([t], add_special_tokens=False)[0].ids for t in texts]


class WordCache:
    """Encode ASCII texts word by word with the ids of words seen before (see the module docstring)."""

    def __init__(self, fast: FastTokenizer, pattern: str = ASCII_PATTERN, *, max_words: int = DEFAULT_MAX_WORDS) -> None:
        self._fast = fast
        self.pattern = pattern
        self._findall = re.compile(pattern).findall
        self.max_words = max_words
        # Tuples of ints: the collector stops tracking them, so a large cache adds nothing to its passes.
        self._ids: dict[str, tuple[int, ...]] = {}
        self.encoded_words = 0  # words the library encoded (for tests and benchmarks)
        self.hits = 1.0  # moving average of the share of a text's words found here
        self._skipped = 0
        self.library_texts = 0  # texts handed to the library whole because their words were new (tests, benchmarks)

    @classmethod
    def for_tokenizer(cls, fast: FastTokenizer, *, max_words: int = DEFAULT_MAX_WORDS) -> WordCache | None:
        """A cache for `fast`, or None when its split is not GPT-2's byte-level one (module docstring)."""
        if max_words <= 0:
            return None
        try:
            spec: dict[str, Any] = json.loads(fast.to_str())
        except (ValueError, TypeError):
            return None
        pattern = _ascii_pattern(spec)
        return None if pattern is None else cls(fast, pattern, max_words=max_words)

    @property
    def size(self) -> int:
        """Words held now."""
        return len(self._ids)

    def encode(self, text: str) -> list[int]:
        """The ids `fast.encode(text, add_special_tokens=False)` gives; `text` must be ASCII without added tokens."""
        if self.hits < FEW_HITS and len(self._ids) >= LEARN_WORDS:
            self._skipped += 1
            if self._skipped % PROBE_EVERY:  # texts of new words: the library alone is cheaper, bar a probe
                self.library_texts += 1
                ids: list[int] = self._fast.encode_batch_fast([text], add_special_tokens=False)[0].ids
                return ids
        words = self._findall(text)
        known = self._ids
        found = list(map(known.get, words))  # held here: another thread's clear cannot take them away
        missed = found.count(None)
        if words:
            self.hits += HIT_WEIGHT * (1.0 - missed / len(words) - self.hits)
        if not missed:
            return list(chain.from_iterable(found))  # type: ignore[arg-type]  # no None in it
        new = list(dict.fromkeys(w for w, ids in zip(words, found, strict=True) if ids is None))
        if len(new) * MOSTLY_NEW > len(words):
            return self._encode_whole(text, words)
        fresh = {w: tuple(ids) for w, ids in zip(new, encode_each(self._fast, new), strict=True)}
        self._keep(fresh)
        out: list[int] = []
        for word, held in zip(words, found, strict=True):
            out += fresh[word] if held is None else held
        return out

    def _encode_whole(self, text: str, words: list[str]) -> list[int]:
        """Mostly new words: the library encodes the whole text, and its words' ids are kept from `word_ids`."""
        enc = self._fast.encode(text, add_special_tokens=False)
        ids: list[int] = enc.ids
        word_of = enc.word_ids
        n = len(words)
        if not ids or len(word_of) != len(ids) or None in word_of or word_of[0] != 0 or word_of[-1] != n - 1:
            return ids  # not the split this cache assumes: keep nothing
        cuts = [i for i, (a, b) in enumerate(pairwise(word_of), 1) if a != b]
        if len(cuts) == n - 1:  # with the first word 0 and the last n-1: every word in order, each with ids
            spans = zip([0, *cuts], [*cuts, len(ids)], strict=True)
            self._keep(dict(zip(words, (tuple(ids[a:b]) for a, b in spans), strict=True)))
        return ids

    def _keep(self, fresh: dict[str, tuple[int, ...]]) -> None:
        known = self._ids
        self.encoded_words += len(fresh)
        if len(known) + len(fresh) > self.max_words:
            known.clear()
        known.update(fresh)


def _ascii_pattern(spec: dict[str, Any]) -> str | None:
    """The pattern that splits ASCII text as the tokenizer described by `spec` (its JSON) does, or None."""
    model = spec.get("model") or {}
    if spec.get("normalizer") is not None or model.get("type") != "BPE" or model.get("dropout") is not None:
        return None
    pre = spec.get("pre_tokenizer")
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    if not isinstance(steps, list) or not steps or not _is_bytelevel(steps[-1]):
        return None
    if len(steps) == 1:
        return ASCII_PATTERN
    first = steps[0]
    if len(steps) == 2 and isinstance(first, dict) and first.get("type") == "Digits":
        return DIGITS_PATTERN if first.get("individual_digits") else DIGIT_RUNS_PATTERN
    return None


def _is_bytelevel(step: Any) -> bool:
    return (
        isinstance(step, dict)
        and step.get("type") == "ByteLevel"
        and step.get("add_prefix_space") is False
        and step.get("use_regex", True) is True
    )

"""Prompt encoding that reuses the token ids of text seen before: a cache of special-token-delimited pieces.

A `tokenizers` fast tokenizer first splits its input at the texts of its
added tokens (leftmost-longest match), then normalizes, pre-tokenizes and
models every piece between them on its own. The ids of a text are therefore
the ids of its pieces, in order, with each added token's id between them. A
chat rendered by its template is made of such pieces — one per message,
between `<|im_start|>` and `<|im_end|>` — and the next turn of a conversation
repeats every earlier piece verbatim, as does every request that starts with
the same system prompt. `SegmentCache.encode` splits the text the same way,
takes the ids of the pieces it has seen from its cache and encodes only the
others: ASCII ones word by word where the tokenizer allows it
(tokenizers/words.py), the rest by the library, one call per piece
(`words.encode_each`: no thread hand-off), each releasing the GIL. Requests of
~12,000 tokens (turns 9–16 of 32 interleaved conversations) encode in 0.53 ms
instead of 3.2 ms at the median (bench/tokenize_cache.py).

Exactness: the split must be the library's, so `SegmentCache.for_tokenizer`
returns None — and the tokenizer encodes whole texts — unless every added
token is special and matched as plain text (`normalized`, `lstrip`,
`rstrip` and `single_word` all false) and no truncation or padding is set.
The post-processor's special tokens (`add_special_tokens=True`) are not the
cache's concern: callers use it for `add_special_tokens=False` only.

The cache is a least-recently-used map from piece to ids, bounded by the
token ids it holds (`budget_tokens`); a piece longer than an eighth of the
budget is encoded but not kept. Ids are stored as `array('I')`, 4 bytes an
id. It is safe to use from several threads (`encode_async` encodes long
prompts in a worker thread).
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from tokenizers import Tokenizer as FastTokenizer

from meshllm.tokenizers.words import MAX_PIECE_CHARS, WordCache, encode_each

__all__ = ["DEFAULT_BUDGET_TOKENS", "SegmentCache"]

# Token ids the cache keeps (~8 MB of ids, plus the pieces' text): a few hundred long conversations.
DEFAULT_BUDGET_TOKENS = 2_000_000


class SegmentCache:
    """Encode texts piece by piece, reusing the ids of pieces seen before (see the module docstring)."""

    def __init__(
        self,
        fast: FastTokenizer,
        added: dict[str, int],
        *,
        budget_tokens: int = DEFAULT_BUDGET_TOKENS,
        words: WordCache | None = None,
    ) -> None:
        self._fast = fast
        self._added = added
        self.words = words  # new ASCII pieces are encoded word by word (tokenizers/words.py)
        # Longest first: Python's alternation takes the first that matches, which is then the longest at that position.
        alternatives = sorted(added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")").split if added else None
        self.budget_tokens = budget_tokens
        self._pieces: OrderedDict[str, array[int]] = OrderedDict()
        self._held = 0  # token ids in _pieces
        self._lock = threading.Lock()
        self.reused_tokens = 0  # ids taken from the cache (for tests and benchmarks)
        self.encoded_tokens = 0  # ids the tokenizer computed

    @classmethod
    def for_tokenizer(cls, fast: FastTokenizer, *, budget_tokens: int = DEFAULT_BUDGET_TOKENS) -> SegmentCache | None:
        """A cache for `fast`, or None when piecewise encoding could differ from the library's (module docstring)."""
        if budget_tokens <= 0 or fast.truncation is not None or fast.padding is not None:
            return None
        added: dict[str, int] = {}
        for token_id, tok in fast.get_added_tokens_decoder().items():
            if not tok.special or tok.normalized or tok.lstrip or tok.rstrip or tok.single_word or not tok.content:
                return None
            added[tok.content] = token_id
        return cls(fast, added, budget_tokens=budget_tokens, words=WordCache.for_tokenizer(fast))

    @property
    def held_tokens(self) -> int:
        """Token ids the cache holds now (at most `budget_tokens`)."""
        return self._held

    def encode(self, text: str) -> list[int]:
        """The ids `fast.encode(text, add_special_tokens=False)` gives, from cached pieces where it can."""
        parts = self._split(text) if self._split is not None else [text]
        # parts alternate: text piece, added token, text piece, ...; pieces may be empty.
        found: list[Sequence[int] | None] = [None] * len(parts)
        missing: dict[str, None] = {}
        with self._lock:
            pieces = self._pieces
            for i in range(0, len(parts), 2):
                piece = parts[i]
                if not piece:
                    continue
                ids = pieces.get(piece)
                if ids is None:
                    missing[piece] = None
                else:
                    pieces.move_to_end(piece)
                    found[i] = ids
                    self.reused_tokens += len(ids)
        fresh = self._encode_new(list(missing)) if missing else {}
        out: list[int] = []
        added = self._added
        for i, part in enumerate(parts):
            if i % 2:
                out.append(added[part])
            elif part:
                cached = found[i]
                out.extend(fresh[part] if cached is None else cached)
        return out

    def _encode_new(self, pieces: Sequence[str]) -> dict[str, list[int]]:
        """Encode `pieces` (ASCII ones word by word, the others in one library call) and keep them."""
        fresh: dict[str, list[int]] = {}
        rest = list(pieces)
        if self.words is not None:
            rest = []
            for piece in pieces:
                if len(piece) <= MAX_PIECE_CHARS and piece.isascii():
                    fresh[piece] = self.words.encode(piece)
                else:
                    rest.append(piece)
        if rest:
            fresh.update(zip(rest, encode_each(self._fast, rest), strict=True))
        limit = self.budget_tokens // 8
        with self._lock:
            for piece, ids in fresh.items():
                self.encoded_tokens += len(ids)
                if len(ids) > limit or piece in self._pieces:
                    continue
                self._pieces[piece] = array("I", ids)
                self._held += len(ids)
            while self._held > self.budget_tokens:
                _, old = self._pieces.popitem(last=False)
                self._held -= len(old)
        return fresh

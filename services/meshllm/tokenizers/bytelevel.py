"""Byte-level detokenization by table: every token id's bytes, for tokenizers whose decoder is `ByteLevel` alone.

A GPT-2 style byte-level BPE (SmolLM2, Llama 3, Qwen, ...) spells each token
as a string over a 256-character alphabet standing for the 256 byte values
(`bytes_to_unicode`); `tokenizers` decodes a list of ids by mapping every
token's characters back to bytes, concatenating them, and reading the result
as UTF-8 with each invalid sequence replaced by U+FFFD. So the text of a
stream is a function of the concatenated bytes alone, and a table of each
id's bytes turns an id into its text without a call into the library.

`byte_table` builds that table and then checks it against the library's own
decode of every id (one batched call); any disagreement — another decoder, an
added token the decoder treats differently — returns None, and the caller
keeps using `tokenizers.decoders.DecodeStream`. The streaming rule that
uses the table is in meshllm/frontend/text/detokenize.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from tokenizers import Tokenizer as FastTokenizer
from tokenizers import decoders

__all__ = ["REPLACEMENT", "ByteTable", "byte_table", "bytes_to_unicode"]

REPLACEMENT = "\ufffd"


@dataclass(frozen=True, slots=True)
class ByteTable:
    """Per token id: `pieces[id]`, its bytes; `texts[id]`, its text when those bytes alone are valid UTF-8 that does
    not end with U+FFFD (a token a stream can emit as it is), else None."""

    pieces: tuple[bytes, ...]
    texts: tuple[str | None, ...]


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → character map: printable Latin-1 bytes stand for themselves, the rest for chars from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def byte_table(fast: FastTokenizer, *, skip_special_tokens: bool) -> ByteTable | None:
    """Each id's bytes as `fast.decode` concatenates them (b"" for a skipped special token), or None.

    None when the tokenizer's decoder is not `ByteLevel` alone, or when the
    bytes of some id do not decode (as UTF-8, invalid sequences replaced) to
    exactly what `fast.decode([id], skip_special_tokens=...)` returns.
    """
    if not isinstance(fast.decoder, decoders.ByteLevel):
        return None
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    added = fast.get_added_tokens_decoder()
    size = fast.get_vocab_size(with_added_tokens=True)
    table: list[bytes] = []
    for i in range(size):
        token = added.get(i)
        if token is not None and token.special and skip_special_tokens:
            table.append(b"")
            continue
        text = token.content if token is not None else fast.id_to_token(i)
        if text is None:  # a hole in the vocabulary: decode skips the id
            table.append(b"")
            continue
        try:
            table.append(bytes(to_byte[c] for c in text))
        except KeyError:  # a character outside the byte alphabet: the decoder keeps the token's own UTF-8
            table.append(text.encode())
    expected = fast.decode_batch([[i] for i in range(size)], skip_special_tokens=skip_special_tokens)
    if any(b.decode("utf-8", "replace") != e for b, e in zip(table, expected, strict=True)):
        return None
    return ByteTable(tuple(table), tuple(_complete_text(b) for b in table))


def _complete_text(b: bytes) -> str | None:
    try:
        text = b.decode()
    except UnicodeDecodeError:
        return None
    return text if text and not text.endswith(REPLACEMENT) else None

"""Incremental detokenization: token ids in, only new and complete text out, one object per stream.

The technique is vLLM's / HF TGI's prefix and read offsets. The detokenizer keeps
a small window of ids: the *prefix* (ids already turned into text, kept only as
context) followed by the *pending* ids (from the read offset on). Each push
decodes the window and the prefix alone; the text beyond the prefix's text is
new. Decoding the prefix together with the new ids matters for tokenizers whose
decoder depends on context (SentencePiece drops a leading space at the start of
a decode; a byte-level token may hold half a character).

While the window's text ends with U+FFFD, the last ids may hold the first bytes
of a character whose other bytes are still to come, so that text is held back.
If earlier ids in the same push already make complete text, that part is
emitted and only the undecided tail waits. Invalid bytes followed by anything
else are settled: they come out as U+FFFD like a one-shot decode would; an
invalid tail at the end of the stream comes out of `flush`.

Cost: two decodes of a window of a few ids per push — constant per token,
never a re-decode of the whole output. For byte-level tokenizers (the built-in
one, GPT-2 style BPE) the concatenated output equals `tok.decode(all_ids)`.

Tokenizers backed by the `tokenizers` library (HF directories, GGUF-built)
use its `DecodeStream` instead: the same prefix/read-offset technique in Rust,
one call per token (about 1.5 µs against 5.5 µs here). Ids it holds back (an
unfinished character) come out of `flush` the same way. Those whose decoder is
`ByteLevel` alone offer a table of every id's bytes
(meshllm/tokenizers/bytelevel.py); the detokenizer then applies DecodeStream's
rule to the bytes itself, without a call into the library (about 0.45 µs).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as FastTokenizer
from tokenizers.decoders import DecodeStream

from meshllm.frontend.text.tokenizer import Tokenizer
from meshllm.tokenizers.bytelevel import REPLACEMENT, ByteTable

__all__ = ["PROMPT_CONTEXT_TOKENS", "IncrementalDetokenizer"]

# How many prompt ids give the first output ids their context (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5
# An incomplete UTF-8 character has at most 3 of its bytes, so it sits in the last 3 ids.
_MAX_UNDECIDED_IDS = 3


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces (see the module docstring).

    `prompt_ids` (optional) are the ids before the output; their last few give
    the first output ids their context. `skip_special_tokens` as in `decode`.
    Not thread-safe: one instance per choice of one stream.
    """

    def __init__(self, tok: Tokenizer, *, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tok = tok
        self._skip_special = skip_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if PROMPT_CONTEXT_TOKENS else []
        fast = getattr(tok, "fast", None)
        self._fast: FastTokenizer | None = fast if isinstance(fast, FastTokenizer) else None
        self._stream: DecodeStream | None = None
        self._held: list[int] = []  # ids DecodeStream (or the byte table) has not turned into text yet
        pieces = getattr(tok, "byte_pieces", None)
        self._table: ByteTable | None = pieces(skip_special_tokens=skip_special_tokens) if pieces is not None else None
        self._pending = b""  # the byte table's bytes of the held ids
        if self._fast is not None and self._table is None:
            self._stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)
        if self._table is not None or self._stream is not None:
            context = []  # the window below is not used: DecodeStream took its context, and bytes need none
        prefix_text = self._decode(context) if context else ""
        if prefix_text.endswith(REPLACEMENT):  # the prompt ends inside a character: no usable context
            context, prefix_text = [], ""
        self._window: list[int] = context  # ids from the prefix offset on
        self._read = len(context)  # window index of the first id not yet turned into text
        self._prefix_text = prefix_text  # decode(window[:read])
        self.token_count = 0  # output ids pushed so far

    def push(self, ids: Sequence[int]) -> str:
        """Add output ids; return the text they complete ("" while a character is unfinished)."""
        if not ids:
            return ""
        self.token_count += len(ids)
        if self._table is not None:
            return self._push_table(ids)
        if self._stream is not None:
            return self._push_stream(ids)
        self._window.extend(ids)
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT):
            return self._emit_settled(text)
        return self._emit(text, len(self._window))

    def _push_stream(self, ids: Sequence[int]) -> str:
        assert self._stream is not None and self._fast is not None
        step, fast, held = self._stream.step, self._fast, self._held
        out = []
        for i in ids:
            piece = step(fast, i)
            if piece is None:
                held.append(i)
            else:
                held.clear()
                out.append(piece)
        return "".join(out)

    def _push_table(self, ids: Sequence[int]) -> str:
        # DecodeStream's rule on the bytes alone: the held ids' bytes come out once they decode to text that does
        # not end with U+FFFD (a character still unfinished, or an invalid tail that more bytes cannot fix yet).
        assert self._table is not None
        table, texts, held = self._table.pieces, self._table.texts, self._held
        size, pending, out = len(table), self._pending, []
        for i in ids:
            if not pending and 0 <= i < size and (text := texts[i]) is not None:
                out.append(text)  # the usual token: complete characters of its own
                held.clear()
                continue
            pending += table[i] if 0 <= i < size else b""  # an id outside the vocabulary decodes to nothing
            held.append(i)
            text = pending.decode("utf-8", "replace")
            if text and not text.endswith(REPLACEMENT):
                out.append(text)
                pending = b""
                held.clear()
        self._pending = pending
        return "".join(out)

    def flush(self) -> str:
        """At the end of the stream: the text still held back (an invalid tail decodes to U+FFFD)."""
        if self._table is not None or self._stream is not None:
            self._pending = b""
            held, self._held = self._held, []
            return self._decode(held) if held else ""
        text = self._decode(self._window)
        rest = text[len(self._prefix_text) :] if len(text) > len(self._prefix_text) else ""
        self._window, self._read, self._prefix_text = [], 0, ""
        return rest

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)

    def _emit(self, text: str, cut: int) -> str:
        """Emit `text` (the decode of window[:cut]) beyond the prefix; window[cut:] stays pending."""
        if len(text) <= len(self._prefix_text):
            return ""  # no new characters yet (a skipped special token, an empty piece)
        new = text[len(self._prefix_text) :]
        self._window = self._window[self._read :]
        self._read = cut - self._read
        self._prefix_text = self._decode(self._window[: self._read])
        return new

    def _emit_settled(self, text: str) -> str:
        """The window ends with U+FFFD: emit what the last few ids cannot change any more."""
        end = len(self._window)
        for cut in range(end - 1, max(self._read, end - _MAX_UNDECIDED_IDS - 1), -1):
            head = self._decode(self._window[:cut])
            # head's characters are final if the longer decode starts with them and goes on.
            if len(head) < len(text) and text.startswith(head):
                return self._emit(head, cut)
        return ""

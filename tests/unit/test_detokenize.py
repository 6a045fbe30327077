"""Incremental detokenization: byte-correct streaming of UTF-8 split across tokens, equal to a one-shot decode."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from meshllm.frontend.text.detokenize import IncrementalDetokenizer
from meshllm.frontend.text.tokenizer import Tokenizer, builtin_tokenizer

REPLACEMENT = "\ufffd"


def stream(tok: Tokenizer, ids: Sequence[int], chunks: Sequence[int] | None = None, **kwargs: object) -> list[str]:
    """Push `ids` in chunks of the given sizes (1 by default); return every piece, the flush last."""
    detok = IncrementalDetokenizer(tok, **kwargs)  # type: ignore[arg-type]
    pieces, i = [], 0
    for size in chunks or [1] * len(ids):
        pieces.append(detok.push(ids[i : i + size]))
        i += size
    pieces.append(detok.push(ids[i:]))
    pieces.append(detok.flush())
    return pieces


def test_emoji_split_across_byte_tokens_is_held_until_complete() -> None:
    """The four byte tokens of 😀 give "", "", "", "😀": never a replacement character."""
    tok = builtin_tokenizer()
    ids = tok.encode("a😀b")
    assert len(ids) == 6
    assert stream(tok, ids)[:6] == ["a", "", "", "", "😀", "b"]


def test_multibyte_characters_in_one_chunk_with_a_split_tail() -> None:
    """A coalesced chunk emits its complete text at once and holds only the unfinished character."""
    tok = builtin_tokenizer()
    ids = tok.encode("héllo 日本😀")
    pieces = stream(tok, ids, chunks=[len(ids) - 2, 1, 1])
    assert pieces[0] == "héllo 日本"
    assert "".join(pieces) == "héllo 日本😀"


@pytest.mark.parametrize("seed", range(30))
def test_random_text_and_chunking_stream_equals_one_shot_decode(seed: int) -> None:
    """Valid UTF-8 in random chunks: the pieces join to the text and none holds U+FFFD."""
    rng = random.Random(seed)
    alphabet = "aé日😀👍🏽 \n€ü"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
    tok = builtin_tokenizer()
    ids = tok.encode(text)
    chunks = [rng.randint(1, 5) for _ in range(len(ids))]
    pieces = stream(tok, ids, chunks)
    assert "".join(pieces) == text == tok.decode(ids)
    assert not any(REPLACEMENT in p for p in pieces)


@pytest.mark.parametrize("seed", range(30))
def test_invalid_bytes_stream_like_a_one_shot_decode(seed: int) -> None:
    """Random bytes (much invalid UTF-8), special ids and words: the stream equals decode(all ids)."""
    rng = random.Random(seed)
    ids = [rng.choice([rng.randint(3, 258), rng.randint(3, 258), rng.randint(0, 2), rng.randint(259, 31999)]) for _ in range(50)]
    tok = builtin_tokenizer()
    for skip in (True, False):
        chunks = [rng.randint(1, 4) for _ in range(len(ids))]
        assert "".join(stream(tok, ids, chunks, skip_special_tokens=skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_a_truly_invalid_tail_comes_out_of_flush() -> None:
    """A lead byte with no continuation is held (it might complete) and flushed as U+FFFD at the end."""
    tok = builtin_tokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.push(tok.encode("ok")) == "ok"
    assert detok.push([0xF0 + 3]) == ""
    assert detok.flush() == REPLACEMENT


def test_invalid_bytes_followed_by_text_are_settled_without_waiting() -> None:
    """Invalid bytes followed by more text are final: they stream as U+FFFD right away."""
    tok = builtin_tokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.push([0x80 + 3]) == ""
    assert detok.push(tok.encode("x")) == REPLACEMENT + "x"
    assert detok.push([0x80 + 3, 0x80 + 3, 0xE2 + 3]) == REPLACEMENT * 2
    assert detok.push([0x82 + 3, 0xAC + 3]) == "€"


def test_special_tokens_are_skipped_or_kept() -> None:
    tok = builtin_tokenizer()
    ids = [*tok.encode("hi"), 2]
    assert "".join(stream(tok, ids)) == "hi"
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == "hi</s>"


def test_prompt_context_does_not_leak_into_the_output() -> None:
    """The prompt's last ids are context only; a prompt ending mid-character is ignored safely."""
    tok = builtin_tokenizer()
    prompt = tok.encode("question?")
    assert "".join(stream(tok, tok.encode(" answer"), prompt_ids=prompt)) == " answer"
    half_char = tok.encode("é")[:1]
    assert "".join(stream(tok, tok.encode("ok"), prompt_ids=[*prompt, *half_char])) == "ok"


def test_pushing_nothing_and_long_streams_stay_cheap() -> None:
    """Empty pushes emit nothing; the window stays a few ids long however long the stream is."""
    tok = builtin_tokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.push([]) == ""
    out = [detok.push([300 + i % 1000]) for i in range(5000)]
    assert "".join(out) == tok.decode([300 + i % 1000 for i in range(5000)])
    assert len(detok._window) <= 2
    assert detok.token_count == 5000


SMOLLM2_TEXTS = [
    "Hello, world! How are you today?",
    "héllo 😀 日本語 👨‍👩‍👧‍👦 Ελληνικά Русский",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Prices: 12.50€, ¥3000, £7 — “quotes” and ‘apostrophes’…",
    "🧑🏽‍💻🏳️‍🌈 emoji sequences and \t tabs   spaces\n\n",
]


@pytest.mark.parametrize("text", SMOLLM2_TEXTS)
def test_smollm2_stream_equals_one_shot_decode(smollm2: Tokenizer, text: str) -> None:
    """Real byte-level BPE: streaming token by token gives the exact text, with no stray U+FFFD."""
    ids = smollm2.encode(text)
    pieces = stream(smollm2, ids)
    assert "".join(pieces) == smollm2.decode(ids) == text
    assert not any(REPLACEMENT in p for p in pieces)


def test_smollm2_emoji_split_across_two_tokens(smollm2: Tokenizer) -> None:
    """ " 😀" is two SmolLM2 tokens (space + 3 bytes, then the last byte): the first emits nothing."""
    ids = smollm2.encode(" 😀")
    assert len(ids) == 2
    assert REPLACEMENT in smollm2.decode(ids[:1])
    assert stream(smollm2, ids)[:2] == ["", " 😀"]


def test_smollm2_special_tokens_in_the_output(smollm2: Tokenizer) -> None:
    """<|im_end|> (id 2) disappears by default and appears verbatim when special tokens are kept."""
    prompt = smollm2.encode("<|im_start|>assistant\n")
    ids = [*smollm2.encode("Sure."), 2]
    assert "".join(stream(smollm2, ids, prompt_ids=prompt)) == "Sure."
    assert "".join(stream(smollm2, ids, prompt_ids=prompt, skip_special_tokens=False)) == "Sure.<|im_end|>"


# ---------------------------------------------------------------- tokenizers' DecodeStream (HF fast tokenizers)


@pytest.mark.parametrize("seed", range(20))
def test_fast_tokenizer_stream_equals_one_shot_decode(smollm2: Tokenizer, seed: int) -> None:
    """SmolLM2 (a `tokenizers` tokenizer, so DecodeStream): random text in random chunks joins to the text."""
    rng = random.Random(seed)
    alphabet = ["a", "é", "日本", "😀", "👍🏽", " ", "\n", "€", "ü", "def f(x):", " the", "\t"]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
    ids = smollm2.encode(text)
    prompt = smollm2.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    pieces = stream(smollm2, ids, [rng.randint(1, 5) for _ in range(len(ids))], prompt_ids=prompt)
    assert "".join(pieces) == text == smollm2.decode(ids)
    assert not any(REPLACEMENT in p for p in pieces)


@pytest.mark.parametrize("seed", range(20))
def test_fast_tokenizer_random_ids_stream_like_a_one_shot_decode(smollm2: Tokenizer, seed: int) -> None:
    """Random ids (byte tokens that make invalid UTF-8, special tokens, words): the stream equals decode(all ids)."""
    rng = random.Random(seed)
    ids = [rng.choice([rng.randint(0, 300), rng.randint(0, 16), rng.randint(300, smollm2.vocab_size - 1)]) for _ in range(40)]
    for skip in (True, False):
        chunks = [rng.randint(1, 4) for _ in range(len(ids))]
        assert "".join(stream(smollm2, ids, chunks, skip_special_tokens=skip)) == smollm2.decode(ids, skip_special_tokens=skip)


class WithoutTable:
    """A tokenizers-backed tokenizer whose byte table is not offered: the detokenizer falls back to DecodeStream."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.fast = tok.fast  # type: ignore[attr-defined]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("table", [True, False], ids=["byte table", "DecodeStream"])
def test_fast_tokenizer_holds_an_unfinished_character_and_flushes_a_held_tail(smollm2: Tokenizer, table: bool) -> None:
    """The first bytes of an emoji are held until the rest arrives; a tail that never completes comes out of flush."""
    tok: Tokenizer = smollm2 if table else WithoutTable(smollm2)  # type: ignore[assignment]
    ids = smollm2.encode("ok 😀")
    detok = IncrementalDetokenizer(tok)
    assert (detok._table is not None) is table and (detok._stream is not None) is not table
    text = "".join(detok.push([i]) for i in ids[:-1])
    assert text.startswith("ok") and "😀" not in text
    assert detok.push(ids[-1:]).endswith("😀")
    detok = IncrementalDetokenizer(tok)
    pushed = detok.push(ids[:-1])
    flushed = detok.flush()
    assert REPLACEMENT in flushed and pushed + flushed == smollm2.decode(ids[:-1])


@pytest.mark.parametrize("seed", range(30))
def test_the_byte_table_emits_exactly_what_decode_stream_emits(smollm2: Tokenizer, seed: int) -> None:
    """Push by push, the same pieces as tokenizers' DecodeStream: random ids mixing raw byte tokens (invalid and
    split UTF-8), special tokens, ids outside the vocabulary and text, in random chunks, both skip settings."""
    rng = random.Random(seed)
    table = smollm2.byte_pieces(skip_special_tokens=True)  # type: ignore[attr-defined]
    assert table is not None
    byte_ids = [i for i, b in enumerate(table.pieces) if len(b) == 1 and b[0] >= 0x80]  # one raw non-ASCII byte each
    text_ids = smollm2.encode("héllo 😀 日本語 👍🏽 €\n def f(x): return x  # ü")

    def pick() -> int:
        kind = rng.random()
        if kind < 0.45:
            return rng.choice(byte_ids)
        if kind < 0.55:
            return rng.randint(0, 16)  # special tokens
        if kind < 0.58:
            return smollm2.vocab_size + rng.randint(0, 5)  # outside the vocabulary: decodes to nothing
        if kind < 0.8:
            return rng.choice(text_ids)
        return rng.randint(17, smollm2.vocab_size - 1)

    ids = [pick() for _ in range(60)]
    prompt = smollm2.encode("<|im_start|>assistant\n")
    for skip in (True, False):
        chunks = [rng.randint(1, 4) for _ in range(len(ids))]
        got = stream(smollm2, ids, chunks, skip_special_tokens=skip, prompt_ids=prompt)
        want = stream(WithoutTable(smollm2), ids, chunks, skip_special_tokens=skip, prompt_ids=prompt)  # type: ignore[arg-type]
        assert got == want


def test_a_decoder_that_is_not_byte_level_gets_no_table() -> None:
    """Another decoder (here a WordPiece-style one) keeps DecodeStream: the table is only for ByteLevel alone."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models

    from meshllm.tokenizers.bytelevel import byte_table

    fast = FastTokenizer(models.WordLevel({"a": 0, "##b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    fast.decoder = decoders.WordPiece()
    assert byte_table(fast, skip_special_tokens=True) is None
    fast.decoder = decoders.ByteLevel()
    assert byte_table(fast, skip_special_tokens=True) is not None

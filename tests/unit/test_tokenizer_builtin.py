"""The built-in byte tokenizer: exact round trips, fixed special ids, readable pseudo-words, ChatML template."""

from __future__ import annotations

from typing import Any

import pytest

from meshllm.config import ConfigError
from meshllm.errors import InvalidArgument
from meshllm.frontend.text.builtin_tokenizer import BYTE_OFFSET, FIRST_WORD_ID, pseudo_word
from meshllm.frontend.text.chat_template import chat_template_for
from meshllm.frontend.text.tokenizer import Tokenizer, builtin_tokenizer, load_tokenizer

TEXTS = [
    "",
    "hello world",
    "héllo wörld — ünïcödé",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧‍👦",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "مرحبا بالعالم",
    "e\u0301 combining, \u200b zero width, \t tabs\r\n newlines",
    "def f(x):\n    return {'a': [1, 2]}  # code\n",
    "<|im_start|>user\nnot special here<|im_end|>\n</s><s>",
]


@pytest.mark.parametrize("text", TEXTS)
def test_any_text_round_trips_exactly(text: str) -> None:
    """Every string encodes to its UTF-8 bytes and decodes back unchanged."""
    tok = builtin_tokenizer()
    ids = tok.encode(text)
    assert ids == [b + BYTE_OFFSET for b in text.encode()]
    assert tok.decode(ids) == text


def test_special_ids_are_fixed_and_bos_is_added_only_when_asked() -> None:
    """0=<pad>, 1=<s> (bos), 2=</s> (eos); special tokens decode to nothing unless kept."""
    tok = builtin_tokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2,), 32000)
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert tok.encode("a", add_special_tokens=True) == [1, ord("a") + BYTE_OFFSET]
    assert [tok.is_special(i) for i in (0, 1, 2, 3, 300)] == [True, True, True, False, False]
    assert tok.decode([1, 107, 2]) == "h"
    assert tok.decode([0, 1, 107, 2], skip_special_tokens=False) == "<pad><s>h</s>"


def test_high_ids_decode_to_deterministic_pseudo_words() -> None:
    """Ids from 259 up read as space-separated words, the same on every run and for every instance."""
    tok = builtin_tokenizer()
    words = [tok.decode([i]) for i in range(FIRST_WORD_ID, FIRST_WORD_ID + 200)]
    assert all(w.startswith(" ") and len(w) > 2 and w[1:].rstrip(",.").isalpha() for w in words)
    assert len(set(words)) > 150
    other = builtin_tokenizer("sample")
    assert words == [other.decode([i]) for i in range(FIRST_WORD_ID, FIRST_WORD_ID + 200)]
    assert tok.decode([31999]) == pseudo_word(31999)
    assert tok.decode([50000]) == pseudo_word(50000)  # beyond the vocab: still text, never a crash
    assert pseudo_word(259) == pseudo_word(259)


def test_random_mocker_output_reads_like_text() -> None:
    """A run of word ids is printable ASCII prose: letters, spaces, commas, full stops."""
    text = builtin_tokenizer().decode(list(range(1000, 1100)))
    assert text.isascii() and text.isprintable()
    assert len(text.split()) == 100


def test_negative_id_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument):
        builtin_tokenizer().decode([-1])


def test_builtin_names_and_sources() -> None:
    """builtin:mocker and builtin:sample load without files; other names are a one-line ConfigError."""
    assert load_tokenizer("builtin:mocker").name == "builtin:mocker"
    assert load_tokenizer("builtin:sample").name == "builtin:sample"
    with pytest.raises(ConfigError, match="unknown builtin tokenizer 'gpt5'"):
        load_tokenizer("builtin:gpt5")
    with pytest.raises(ConfigError, match="vocab_size"):
        builtin_tokenizer(vocab_size=100)


def test_builtin_chat_template_is_chatml_with_markers_as_plain_bytes() -> None:
    """The built-in template renders ChatML; its markers encode as bytes, not special ids."""
    tok = builtin_tokenizer()
    template = chat_template_for(tok)
    assert template is not None
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None},
    ]
    prompt = template.render(messages)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not any(tok.is_special(i) for i in tok.encode(prompt))
    assert template.render(messages[:1], add_generation_prompt=False).endswith("<|im_end|>\n")

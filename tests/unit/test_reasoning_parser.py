"""Reasoning parsers: `<think>` text split exactly at the tags, whatever the streaming split."""

from __future__ import annotations

import pytest

from meshllm.frontend.text.reasoning import ReasoningParser, detect_reasoning_parser

# (parser, output, reasoning, content) — the DeepSeek-R1 and Qwen3 model cards' output shapes
CASES = [
    (
        "qwen3",
        "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is 4.",
        "\nThe user asks 2+2. That is 4.\n",
        "The answer is 4.",
    ),
    ("qwen3", "The answer is 4.", "", "The answer is 4."),
    ("qwen3", "<think></think>Hi <thin", "", "Hi <thin"),
    ("qwen3", "<think>never closed <", "never closed <", ""),
    ("qwen3", "  <thinking> is a word", "", "  <thinking> is a word"),
    ("deepseek_r1", "Okay, 2+2=4.\n</think>\n\n**4**", "Okay, 2+2=4.\n", "**4**"),
    ("deepseek_r1", "<think>Hmm.</think>Done </think>", "Hmm.", "Done </think>"),
    ("deepseek_r1", "all reasoning, no end", "all reasoning, no end", ""),
]


def _run(name: str, pieces: list[str]) -> tuple[str, str]:
    p = ReasoningParser(name)
    r, c = [], []
    for piece in pieces:
        a, b = p.feed(piece)
        r.append(a)
        c.append(b)
    a, b = p.finish()
    return "".join(r) + a, "".join(c) + b


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_split_at_every_boundary(name: str, text: str, reasoning: str, content: str) -> None:
    assert _run(name, [text]) == (reasoning, content)
    assert _run(name, list(text)) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert _run(name, [text[:cut], text[cut:]]) == (reasoning, content), cut


def test_tag_bytes_are_held_only_while_they_can_grow() -> None:
    p = ReasoningParser("qwen3")
    assert p.feed("<think>abc</th") == ("abc", "")
    assert p.feed("ink>x") == ("", "x")


def test_detect() -> None:
    assert detect_reasoning_parser("{{ messages }}") is None
    assert detect_reasoning_parser("{% if x %}<think>{% endif %}", "<|Assistant|><think>\n") == "deepseek_r1"
    assert detect_reasoning_parser("{% if x %}<think>{% endif %}", "<|im_start|>assistant\n") == "qwen3"
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("nope")

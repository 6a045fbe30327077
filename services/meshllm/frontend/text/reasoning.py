"""Reasoning parsers: a model's `<think>…</think>` text → `reasoning_content`, split exactly at the tags.

Formats (`--reasoning-parser`):

    qwen3        reasoning only when the output opens with `<think>` (Qwen3, QwQ with
                 the tag in the output); otherwise everything is content
    deepseek_r1  the output starts inside the reasoning (the template's generation
                 prompt opens `<think>`; one in the output is dropped too) and it
                 ends at `</think>`; an output that never closes it is all reasoning

The tags never reach the client; whitespace right after `</think>` is
dropped. Bytes that could still grow into a tag are held back, so splitting
the text differently never moves the boundary. `detect_reasoning_parser`
reads a chat template: off unless it mentions `<think>`.
"""

from __future__ import annotations

from meshllm.frontend.text.stop_strings import partial_tail

__all__ = ["REASONING_PARSERS", "ReasoningParser", "detect_reasoning_parser"]

START, END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


class ReasoningParser:
    """One choice's streaming splitter: `feed(text)` / `finish()` → (reasoning, content)."""

    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}")
        self._state = "reasoning_open" if name == "deepseek_r1" else "start"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        buf = self._buf + text
        self._buf = ""
        reasoning = content = ""
        while buf:
            state = self._state
            if state in ("start", "reasoning_open"):
                s = buf.lstrip()
                if s.startswith(START):
                    self._state, buf = "reasoning", s[len(START) :]
                elif START.startswith(s):  # empty, or the tag still arriving
                    self._buf = buf
                    return reasoning, content
                else:
                    self._state = "content" if state == "start" else "reasoning"
            elif state == "reasoning":
                i = buf.find(END)
                if i >= 0:
                    reasoning += buf[:i]
                    self._state, buf = "after", buf[i + len(END) :]
                    continue
                keep = partial_tail(buf, (END,))
                reasoning += buf[: len(buf) - keep]
                self._buf = buf[len(buf) - keep :]
                return reasoning, content
            elif state == "after":
                buf = buf.lstrip()
                if buf:
                    self._state = "content"
            else:
                content += buf
                buf = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        held, self._buf = self._buf, ""
        if self._state == "reasoning":
            return held, ""
        if self._state == "reasoning_open":
            return held, ""
        return "", held if self._state in ("start", "content") else ""


def detect_reasoning_parser(template: str | None, generation_prompt: str | None = None) -> str | None:
    """The parser a chat template implies: none unless it mentions `<think>`.

    `generation_prompt` (the template rendered for one user message with the
    generation prompt) ending in `<think>` means the model starts inside its
    reasoning: deepseek_r1; otherwise qwen3.
    """
    if not template or START not in template:
        return None
    if generation_prompt is not None and generation_prompt.rstrip().endswith(START):
        return "deepseek_r1"
    return "qwen3"

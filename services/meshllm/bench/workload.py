"""Synthetic requests for `meshllm bench`: prompt lengths, output lengths, shared prefixes, all seeded.

Prompts are random words. Their length is set in characters from the target
input length (`isl × chars_per_token`): 1 character per token is exact for
the mocker's built-in byte tokenizer, about 4 fits the BPE tokenizers of real
models; the table reports the prompt tokens the server counted. Output
lengths are exact with `ignore_eos` (the default): max_tokens = OSL.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Any, Literal

import orjson

__all__ = ["BenchRequest", "Workload", "WorkloadSpec"]

Api = Literal["chat", "completions"]


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadSpec:
    """What to send: lengths (mean ± spread, uniform), prefix sharing, API, model."""

    model: str
    api: Api = "chat"
    isl: int = 600
    isl_spread: int = 0
    osl: int = 150
    osl_spread: int = 0
    prefix_len: int = 0  # tokens of shared prefix at the start of each prompt
    num_prefixes: int = 1  # distinct shared prefixes (requests pick one at random)
    chars_per_token: float = 1.0
    ignore_eos: bool = True
    temperature: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.isl < 1 or self.osl < 1:
            raise ValueError("--isl and --osl must be >= 1")
        if not 0 <= self.isl_spread < self.isl or not 0 <= self.osl_spread < self.osl:
            raise ValueError("--isl-spread / --osl-spread must be >= 0 and smaller than --isl / --osl")
        if self.prefix_len < 0 or self.prefix_len > self.isl - self.isl_spread:
            raise ValueError("--prefix-len must be between 0 and the shortest prompt (--isl - --isl-spread)")
        if self.num_prefixes < 1:
            raise ValueError("--num-prefixes must be >= 1")
        if self.chars_per_token <= 0:
            raise ValueError("--chars-per-token must be > 0")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request ready to send: path, JSON body, the output length asked for."""

    path: str
    body: bytes
    osl: int


class Workload:
    """Deterministic stream of requests for a spec (same seed → same requests)."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self._rng = random.Random(spec.seed)
        words_rng = random.Random(spec.seed ^ 0x5EED)
        self._words = ["".join(words_rng.choices(string.ascii_lowercase, k=words_rng.randint(2, 8))) for _ in range(4096)]
        self._prefixes = [self._text(spec.prefix_len) for _ in range(spec.num_prefixes)] if spec.prefix_len else [""]

    def _text(self, tokens: int) -> str:
        target = int(tokens * self.spec.chars_per_token)
        parts: list[str] = []
        size = 0
        choice, words = self._rng.choice, self._words
        while size < target:
            w = choice(words)
            parts.append(w)
            size += len(w) + 1
        return " ".join(parts)[:target]

    def next(self) -> BenchRequest:
        s, rng = self.spec, self._rng
        isl = rng.randint(s.isl - s.isl_spread, s.isl + s.isl_spread)
        osl = rng.randint(s.osl - s.osl_spread, s.osl + s.osl_spread)
        prefix = rng.choice(self._prefixes)
        prompt = prefix + self._text(max(isl - s.prefix_len, 1))
        body: dict[str, Any] = {"model": s.model, "max_tokens": osl, "stream": True, "stream_options": {"include_usage": True}}
        if s.ignore_eos:
            body["ignore_eos"] = True
        if s.temperature is not None:
            body["temperature"] = s.temperature
        if s.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            path = "/chat/completions"
        else:
            body["prompt"] = prompt
            path = "/completions"
        return BenchRequest(path, orjson.dumps(body), osl)

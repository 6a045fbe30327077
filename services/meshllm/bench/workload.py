"""Synthetic requests for `meshllm bench`: prompt lengths, output lengths, shared prefixes, arrivals, all seeded.

Prompts are random words. With a `PromptBuilder` (the model's tokenizer,
`meshllm.bench.prompts`) a prompt counts exactly the input length drawn for
it, chat template included. Without one the length is set in characters
(`isl × chars_per_token`): 1 character per token is exact for the mocker's
built-in byte tokenizer, about 4 fits the BPE tokenizers of real models. The
report shows the prompt tokens the server counted. Output lengths are exact
with `ignore_eos` (the default): max_tokens = OSL. `poisson_arrivals` gives
the send times of `--request-rate`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import orjson

from meshllm.bench.prompts import random_words

if TYPE_CHECKING:
    from meshllm.bench.prompts import PromptBuilder

__all__ = ["BenchRequest", "Workload", "WorkloadSpec", "make_request", "poisson_arrivals", "with_arrivals"]

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
    """One request ready to send: path, JSON body, the output length asked for.

    `isl` is the prompt length the server will count when the generator knew
    it (a tokenizer was used), else None; `arrival_s` the send time in rate
    mode (seconds from the start of the level).
    """

    path: str
    body: bytes
    osl: int
    isl: int | None = None
    arrival_s: float = 0.0


class Workload:
    """Deterministic stream of requests for a spec (same seed → same requests)."""

    def __init__(self, spec: WorkloadSpec, builder: PromptBuilder | None = None) -> None:
        self.spec, self.builder = spec, builder
        self._rng = random.Random(spec.seed)
        self._words = random_words(spec.seed)
        if not spec.prefix_len:
            self._prefixes = [""]
        elif builder is not None:
            self._prefixes = [builder.build_content(spec.prefix_len, self._rng) for _ in range(spec.num_prefixes)]
        else:
            self._prefixes = [self._text(spec.prefix_len) for _ in range(spec.num_prefixes)]

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
        if self.builder is not None:
            prompt = self.builder.build(isl, rng, prefix=prefix)
        else:
            prompt = prefix + self._text(max(isl - s.prefix_len, 1))
        isl_known = isl if self.builder is not None else None
        if s.api == "chat":
            return make_request(s, osl, messages=[{"role": "user", "content": prompt}], isl=isl_known)
        return make_request(s, osl, prompt=prompt, isl=isl_known)


def make_request(
    spec: WorkloadSpec, osl: int, *, messages: list[dict[str, str]] | None = None, prompt: str | None = None,
    isl: int | None = None,
) -> BenchRequest:  # fmt: skip
    """A streaming request of `spec`'s API: chat with `messages`, or completions with `prompt`."""
    body: dict[str, Any] = {"model": spec.model, "max_tokens": osl, "stream": True, "stream_options": {"include_usage": True}}
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.temperature is not None:
        body["temperature"] = spec.temperature
    if messages is not None:
        body["messages"] = messages
        path = "/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/completions"
    return BenchRequest(path, orjson.dumps(body), osl, isl)


def poisson_arrivals(n: int, rate: float, seed: int, *, burstiness: float = 1.0) -> list[float]:
    """Send times (s) of `n` requests at `rate` per second: the first at 0, then gamma-distributed gaps.

    `burstiness` 1 gives a Poisson process (exponential gaps); lower is
    burstier, higher more regular, the mean rate unchanged (vLLM's
    `--burstiness`). Seeded: the same seed gives the same times.
    """
    if not rate > 0 or math.isinf(rate):
        raise ValueError("--request-rate must be a finite number > 0")
    if not burstiness > 0:
        raise ValueError("--burstiness must be > 0")
    rng = random.Random(seed ^ 0xA441)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


def with_arrivals(requests: list[BenchRequest], arrivals: list[float]) -> list[BenchRequest]:
    """The requests, each with its send time."""
    return [replace(r, arrival_s=a) for r, a in zip(requests, arrivals, strict=True)]

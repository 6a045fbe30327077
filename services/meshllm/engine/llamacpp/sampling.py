"""`SamplingSpec`: a request's sampling options, validated once on the event loop.

The engine thread turns a spec into a `llama_sampler` chain (`backend.py`) in
llama.cpp's usual order: [suppress eos/stop until min_tokens] → grammar →
penalties → greedy, or top_k → top_p → min_p → temperature → dist(seed).
Guided decoding maps onto llama.cpp grammars: `grammar` is GBNF as is,
`json_schema` / `json_object` / `choice` / `regex` are converted to GBNF
(llamacpp/json_gbnf.py: every sentence parses and validates).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from meshllm.engine.llamacpp.json_gbnf import JSON_OBJECT_GBNF, SchemaUnsupported, regex_grammar, schema_grammar
from meshllm.errors import InvalidArgument
from meshllm.protocol.types import GuidedSettings, SamplingSettings
from meshllm.protocol.validate import check_logit_bias

__all__ = ["DEFAULT_TEMPERATURE", "PENALTY_LAST_N", "SamplingSpec", "guided_grammar"]

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request names none
PENALTY_LAST_N = 64


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """How one sequence samples; `temperature == 0` is greedy (seed and top-* are then moot)."""

    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    grammar: str = ""  # GBNF with a `root` rule; "" = unconstrained
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @classmethod
    def from_options(cls, opts: SamplingSettings) -> SamplingSpec:
        """Validate a request's options (InvalidArgument names the bad field)."""
        temperature = float(opts.get("temperature", DEFAULT_TEMPERATURE))
        top_k = int(opts.get("top_k", 0))
        top_p = float(opts.get("top_p", 1.0))
        min_p = float(opts.get("min_p", 0.0))
        checks = (
            ("temperature", math.isfinite(temperature) and temperature >= 0.0, temperature, ">= 0"),
            ("top_k", top_k >= -1, top_k, ">= 0 (0 or -1 = off)"),
            ("top_p", 0.0 < top_p <= 1.0, top_p, "in (0, 1]"),
            ("min_p", 0.0 <= min_p <= 1.0, min_p, "in [0, 1]"),
        )
        for name, ok, value, expected in checks:
            if not ok:
                raise InvalidArgument(f"{name} must be {expected}, got {value}", param=name)
        rep = float(opts.get("repetition_penalty", 1.0)) or 1.0  # proto3: 0 = unset
        freq = float(opts.get("frequency_penalty", 0.0))
        pres = float(opts.get("presence_penalty", 0.0))
        if rep < 0 or not all(math.isfinite(v) and -2.0 <= v <= 2.0 for v in (freq, pres)):
            raise InvalidArgument("penalties out of range: repetition > 0, frequency and presence in [-2, 2]", param="penalty")
        seed = opts.get("seed")
        return cls(
            temperature=temperature,
            top_k=max(top_k, 0),
            top_p=top_p,
            min_p=min_p,
            seed=None if seed is None else int(seed) & 0xFFFFFFFF,
            repetition_penalty=rep,
            frequency_penalty=freq,
            presence_penalty=pres,
            grammar=guided_grammar(opts.get("guided")),
            logit_bias=_logit_bias(opts.get("logit_bias")),
        )


def _logit_bias(bias: dict[int, float] | None) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    check_logit_bias("logit_bias", bias)  # the token ids against the vocabulary: LlamaBackend.new_sampler
    return tuple(sorted((int(t), float(v)) for t, v in bias.items()))


def _literal(text: str) -> str:
    """A GBNF string literal (JSON escaping is GBNF-compatible for quotes, backslashes and controls)."""
    return json.dumps(text, ensure_ascii=False)


def guided_grammar(guided: GuidedSettings | None) -> str:
    """The GBNF grammar of a guided-decoding request ("" when unconstrained); every sentence of it is valid output."""
    if not guided:
        return ""
    try:
        if regex := guided.get("regex"):
            return regex_grammar(regex)
        if grammar := guided.get("grammar"):
            return grammar
        if choice := guided.get("choice"):
            return "root ::= " + " | ".join(_literal(c) for c in choice)
        if schema := guided.get("json_schema"):
            return schema_grammar(schema)
    except SchemaUnsupported as exc:
        raise InvalidArgument(f"guided decoding: {exc}", param="guided") from None
    if guided.get("json_object"):
        return JSON_OBJECT_GBNF
    return ""

"""The one validation layer: limits and messages shared by every entry point (pure, no I/O).

    HTTP (/v1/chat/completions, /v1/completions)   protocol/openai/request.py reads fields with these checkers
    Inference gRPC (text)                          the same parser (frontend/openai/grpc_api.py builds the body)
    Router / Worker Generate, GenerateSession      `validate_generate` on the converted TokenRequest
    Router.Route                                   `validate_prompt` on its token ids

The same value is refused with the same message everywhere, e.g.
"'temperature': nan is outside [0, 2]". Every integer that ends up in a
protobuf field is bounded so that conversion can never overflow (the proto
types are int32 / uint32 / uint64). Numbers follow OpenAI's documented ranges.

`top_k`: 0 and -1 both mean "disabled" (0 is the proto's unset value, -1
vLLM's convention); any other negative value is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshllm.errors import ContextLengthExceeded, InvalidArgument
from meshllm.protocol.types import TokenRequest

__all__ = [
    "FLOAT_RANGES",
    "INT32_MAX",
    "MAX_COUNT",
    "MAX_N",
    "MAX_PROMPT_TOKENS",
    "MAX_REQUEST_ID_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_TOP_LOGPROBS",
    "UINT32_MAX",
    "UINT64_MAX",
    "Limits",
    "bad",
    "check_float",
    "check_int",
    "check_logit_bias",
    "check_top_k",
    "validate_generate",
    "validate_prompt",
]

INT32_MAX = (1 << 31) - 1
UINT32_MAX = (1 << 32) - 1
UINT64_MAX = (1 << 64) - 1
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_COUNT = INT32_MAX  # max_tokens, min_tokens, top_k: what every engine takes as a C int
MAX_PROMPT_TOKENS = 1 << 20  # the hard cap where the model's context length is unknown
MAX_REQUEST_ID_CHARS = 1024  # token level; the HTTP API allows 256 (the frontend appends a choice suffix)

# name -> (low, high, low end open)
FLOAT_RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "presence_penalty": (-2.0, 2.0, False),
    "repetition_penalty": (0.0, 2.0, True),
}


def bad(param: str, why: str) -> InvalidArgument:
    """The one shape of a field error: "'param': why", with `param` set."""
    return InvalidArgument(f"'{param}': {why}", param=param)


def _num(v: float) -> str:
    return f"{v:g}"


def check_float(param: str, value: float, key: str | None = None) -> float:
    """`value` within the documented range of sampling field `key` (default: `param`); NaN and inf are refused."""
    lo, hi, lo_open = FLOAT_RANGES[key or param]
    v = float(value)
    if math.isnan(v) or v < lo or v > hi or (lo_open and v == lo):
        bound = f"({_num(lo)}, {_num(hi)}]" if lo_open else f"[{_num(lo)}, {_num(hi)}]"
        raise bad(param, f"{_num(v)} is outside {bound}")
    return v


def check_int(param: str, value: int, lo: int | None = None, hi: int | None = None) -> int:
    """`lo <= value <= hi` (either bound optional)."""
    if lo is not None and value < lo:
        raise bad(param, f"{value} is less than the minimum of {lo}")
    if hi is not None and value > hi:
        raise bad(param, f"{value} is greater than the maximum of {hi}")
    return value


def check_top_k(param: str, value: int) -> int | None:
    """top_k in [-1, INT32_MAX]; None when it means "disabled" (0 or -1)."""
    check_int(param, value, -1, MAX_COUNT)
    return value if value > 0 else None


@dataclass(frozen=True, slots=True)
class Limits:
    """What an entry point knows about the model behind it; 0 = unknown (that check is skipped)."""

    context_length: int = 0
    vocab_size: int = 0


def _check_ids(param: str, ids: Iterable[int], vocab_size: int) -> None:
    # max() runs in C: every prompt is checked on each hop, so no per-token Python loop unless one is bad.
    ids = ids if isinstance(ids, Sequence) else list(ids)
    if vocab_size and ids and max(ids) >= vocab_size:
        t = next(t for t in ids if t >= vocab_size)
        raise bad(param, f"token id {t} is outside the vocabulary (size {vocab_size})")


def validate_prompt(token_ids: Sequence[int], limits: Limits = Limits(), *, param: str = "token_ids") -> None:
    """A prompt's token ids: not empty, within the context length (or the hard cap) and the vocabulary."""
    n = len(token_ids)
    if not n:
        raise bad(param, "must not be empty")
    if limits.context_length and n >= limits.context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limits.context_length} tokens. However, your prompt has {n} "
            "tokens; please reduce the length of the prompt.",
            param=param,
        )
    if n > MAX_PROMPT_TOKENS:
        raise bad(param, f"{n} tokens is more than the maximum of {MAX_PROMPT_TOKENS}")
    _check_ids(param, token_ids, limits.vocab_size)


def check_logit_bias(param: str, bias: Mapping[int, float], vocab_size: int = 0) -> None:
    """OpenAI's rules: at most MAX_LOGIT_BIAS entries, each a bias in [-100, 100] of a token id of the model."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad(param, f"{len(bias)} entries; at most {MAX_LOGIT_BIAS}")
    for token, value in bias.items():
        v = float(value)
        if math.isnan(v) or not -100.0 <= v <= 100.0:
            raise bad(param, f"the bias of token {token} is {_num(v)}, outside [-100, 100]")
        if token < 0 or (vocab_size and token >= vocab_size):
            raise bad(param, f"token {token} is not in the model's vocabulary (0..{vocab_size - 1})")


def _check_sampling(s: dict[str, Any], vocab_size: int = 0) -> None:
    for key in FLOAT_RANGES:
        if key in s:
            check_float(f"sampling.{key}", s[key], key)
    if "top_k" in s:
        check_top_k("sampling.top_k", s["top_k"])
    if "logit_bias" in s:
        check_logit_bias("sampling.logit_bias", s["logit_bias"], vocab_size)


def validate_generate(req: TokenRequest, limits: Limits = Limits()) -> None:
    """A token-level request (Router/Worker Generate, a GenerateSession open) against the HTTP API's limits.

    Raises InvalidArgument (ContextLengthExceeded for a prompt too long for the
    model) naming the field, with the message the HTTP API gives for it.
    """
    if len(req.get("request_id", "")) > MAX_REQUEST_ID_CHARS:
        raise bad("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters")
    disagg = req.get("disagg", {})
    if disagg.get("request_type") != "generation_only":  # a decode leg's prompt may end at the context's edge
        validate_prompt(req["token_ids"], limits)
    elif not req["token_ids"]:
        raise bad("token_ids", "must not be empty")
    _check_sampling(dict(req.get("sampling", {})), limits.vocab_size)
    stop = req.get("stop", {})
    max_tokens = stop.get("max_tokens")
    if max_tokens is not None:
        check_int("stop.max_tokens", max_tokens, 1, MAX_COUNT)
    min_tokens = stop.get("min_tokens", 0)
    check_int("stop.min_tokens", min_tokens, 0, MAX_COUNT)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad("stop.min_tokens", f"{min_tokens} is greater than stop.max_tokens ({max_tokens})")
    _check_ids("stop.stop_token_ids", stop.get("stop_token_ids", ()), limits.vocab_size)
    _check_ids("eos_token_ids", req.get("eos_token_ids", ()), limits.vocab_size)
    output = req.get("output", {})
    for key in ("logprobs", "prompt_logprobs"):
        if key in output:
            check_int(f"output.{key}", output[key], 0, MAX_TOP_LOGPROBS)
    aggregated_or_prefill = disagg.get("request_type") != "generation_only"
    if aggregated_or_prefill and limits.context_length and max_tokens is not None:
        n = len(req["token_ids"])
        if n + max_tokens > limits.context_length:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limits.context_length} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). "
                "Please reduce the length of the prompt or of max_tokens.",
                param="max_tokens",
            )

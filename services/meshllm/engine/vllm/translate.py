"""A TokenRequest as vLLM `SamplingParams` keywords, and vLLM's outputs as chunk fields (pure: no vLLM import).

Field names as vLLM 0.32 defines them (`vllm/sampling_params.py`,
`vllm/outputs.py`, `vllm/logprobs.py`): a `Logprob` has `logprob` and `rank`;
a step's `logprobs` is one `{token_id: Logprob}` per new token holding the
sampled token and the `logprobs` likeliest; `prompt_logprobs` is one such map
per prompt token, `None` for the first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from meshllm.errors import InvalidArgument
from meshllm.protocol.types import FinishReason, LogprobItem, TokenRequest

__all__ = ["logprob_items", "map_finish", "prompt_logprob_items", "refusal_types", "sampling_kwargs"]

_SAMPLING = ("temperature", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty")


def sampling_kwargs(request: TokenRequest, *, context_length: int, prompt_len: int) -> dict[str, Any]:
    """vLLM SamplingParams keywords (plus `structured_outputs` as a dict of StructuredOutputsParams fields)."""
    s = request.get("sampling", {})
    st = request.get("stop", {})
    out = request.get("output", {})
    kw: dict[str, Any] = {k: s[k] for k in _SAMPLING if k in s}  # type: ignore[literal-required]
    if (top_k := s.get("top_k")) is not None and top_k > 0:
        kw["top_k"] = top_k
    room = context_length - prompt_len
    if room <= 0:
        raise InvalidArgument(f"the prompt has {prompt_len} tokens; the model's context is {context_length}", param="token_ids")
    kw["max_tokens"] = min(st.get("max_tokens", room), room)
    if (m := st.get("min_tokens")) is not None:
        kw["min_tokens"] = m
    if ids := st.get("stop_token_ids"):
        kw["stop_token_ids"] = list(ids)
    if st.get("ignore_eos"):
        kw["ignore_eos"] = True
    if (n := out.get("logprobs")) is not None:
        kw["logprobs"] = n
    if (n := out.get("prompt_logprobs")) is not None and request.get("disagg", {}).get("request_type") != "generation_only":
        kw["prompt_logprobs"] = n
    if "skip_special_tokens" in out:
        kw["skip_special_tokens"] = out["skip_special_tokens"]
    if guided := s.get("guided"):
        kw["structured_outputs"] = _structured(guided)
    if bias := s.get("logit_bias"):
        kw["logit_bias"] = {int(t): float(b) for t, b in bias.items()}  # vLLM refuses ids outside its vocabulary
    return kw


def _structured(guided: Mapping[str, Any]) -> dict[str, Any]:
    if schema := guided.get("json_schema"):
        try:
            return {"json": json.loads(schema) if isinstance(schema, str) else schema}
        except ValueError:
            raise InvalidArgument("guided json_schema is not JSON", param="guided") from None
    for key, field in (("regex", "regex"), ("grammar", "grammar"), ("choice", "choice")):
        if value := guided.get(key):
            return {field: list(value) if key == "choice" else value}
    if guided.get("json_object"):
        return {"json_object": True}
    raise InvalidArgument("guided decoding names no constraint", param="guided")


def _item(token_id: int, entries: Mapping[int, Any], top_n: int) -> LogprobItem:
    own = entries.get(token_id)
    item = LogprobItem(token_id=token_id, logprob=float(own.logprob) if own is not None else float("-inf"))
    if top_n:
        ranked = sorted(entries.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        item["top"] = [(int(t), float(lp.logprob)) for t, lp in ranked if lp.rank is not None and lp.rank <= top_n][:top_n]
    return item


def logprob_items(logprobs: Sequence[Mapping[int, Any] | None], tokens: Sequence[int], top_n: int) -> list[LogprobItem]:
    """One LogprobItem per new token: its own logprob and `top_n` alternatives."""
    return [_item(t, entries or {}, top_n) for t, entries in zip(tokens, logprobs, strict=False)]


def prompt_logprob_items(logprobs: Sequence[Mapping[int, Any] | None], prompt: Sequence[int], top_n: int) -> list[LogprobItem]:
    """Prompt tokens 1..N-1 (the first has no logprob), each with `top_n` alternatives."""
    return [_item(t, entries or {}, top_n) for t, entries in zip(prompt[1:], logprobs[1:], strict=False)]


def map_finish(finish: str | None, stop_reason: Any, tokens: list[int]) -> tuple[FinishReason, str, list[int]]:
    """(our finish reason, stop reason, the tokens to emit): a stop token id is not emitted; EOS is."""
    if finish == "length":
        return "length", "", tokens
    if finish == "abort":
        return "cancelled", "", tokens
    if finish == "stop":
        if isinstance(stop_reason, int):
            if tokens and tokens[-1] == stop_reason:
                tokens = tokens[:-1]
            return "stop", str(stop_reason), tokens
        if stop_reason is None:
            return "eos", "", tokens
        return "stop", str(stop_reason), tokens
    return "error", str(stop_reason or finish or ""), tokens


def refusal_types() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses: ValueError, and (0.32) its VLLMClientError, not a ValueError."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)

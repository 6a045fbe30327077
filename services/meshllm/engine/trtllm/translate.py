"""Pure translations between meshllm's request/chunk types and TensorRT-LLM's LLM API objects.

Nothing here imports TensorRT-LLM: requests become plain keyword dicts (the
engine passes them to `SamplingParams(**kw)`, `GuidedDecodingParams(**kw)`,
`DisaggregatedParams(**kw)`), and TensorRT-LLM's outputs are read by attribute
name. The names and shapes come from NVIDIA/TensorRT-LLM:

- `tensorrt_llm/sampling_params.py`: `SamplingParams` (max_tokens, min_tokens,
  end_id, stop_token_ids, ignore_eos, temperature, top_k, top_p, min_p, seed,
  frequency/presence/repetition_penalty, logprobs, detokenize,
  return_perf_metrics, guided_decoding) and `GuidedDecodingParams` (json,
  regex, grammar, json_object, structural_tag; it has no "choice", so a choice
  list becomes an alternation regex, as Dynamo's trtllm handler does).
- `tensorrt_llm/executor/result.py`: `CompletionOutput.token_ids` is
  *cumulative* (streaming appends), `logprobs` is a list aligned with it of
  `{token_id: Logprob(logprob, rank)}` dicts (or plain floats on the C++
  path), `finish_reason` is "stop" | "length" | "timeout" | "cancelled" and
  `stop_reason` is the matched stop token id (None for the end id), and a
  stop token is trimmed from `token_ids` when the request finishes.
- `tensorrt_llm/disaggregated_params.py`: `DisaggregatedParams` (request_type,
  first_gen_tokens, ctx_request_id: int, opaque_state: bytes, draft_tokens,
  disagg_request_id, ctx_dp_rank, ctx_info_endpoint).

Disaggregation: our `DisaggParams` proto has first_token_ids, ctx_request_id
(string), opaque_state; the other DisaggregatedParams fields a generation-only
leg needs (draft tokens, the Python transceiver's endpoint and dp rank, the
disagg request id) travel inside `kv_handle` as `b"trtllm1:" + JSON`, so a
context-only answer survives the router's proto hop unchanged.

A generation-only leg's `token_ids` start with the prefill's first token(s)
(TensorRT-LLM's own disaggregated tests assert generation output equals the
aggregated output), so its deltas skip `len(first_token_ids)` tokens: the
decode leg continues after them, as the engine contract asks.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from meshllm.errors import ContextLengthExceeded, FailedPrecondition, InvalidArgument
from meshllm.protocol.types import DisaggInfo, FinishReason, LogprobItem, TokenRequest, TokenUsage

__all__ = [
    "HANDLE_PREFIX",
    "cached_tokens",
    "decode_handle",
    "disagg_from_trtllm",
    "disagg_to_trtllm",
    "encode_handle",
    "extra_eos_ids",
    "logprob_delta",
    "map_finish_reason",
    "sampling_kwargs",
    "token_delta",
    "usage",
]

HANDLE_PREFIX = b"trtllm1:"
# DisaggregatedParams fields our proto has no slot for; carried in kv_handle.
_HANDLE_FIELDS = ("draft_tokens", "disagg_request_id", "ctx_dp_rank", "ctx_info_endpoint")
_OPTIONAL_SAMPLING = ("seed", "frequency_penalty", "presence_penalty", "repetition_penalty")


# --------------------------------------------------------------- request side


# size: one sampling option after another, in the order of the mesh's SamplingOptions
def sampling_kwargs(request: TokenRequest, *, default_max_tokens: int, context_length: int = 0) -> dict[str, Any]:
    """`SamplingParams` keyword arguments for `request` ("guided_decoding" is a nested kwargs dict).

    `context_length` (0 = unknown) bounds prompt + max_tokens; without an explicit
    max_tokens the request may use the rest of the context (else `default_max_tokens`).
    A context-only (prefill) leg produces exactly one token.
    """
    prompt = request["token_ids"]
    s = request.get("sampling", {})
    st = request.get("stop", {})
    role = request.get("disagg", {}).get("request_type")
    if context_length and len(prompt) >= context_length:
        raise ContextLengthExceeded(
            f"prompt of {len(prompt)} tokens does not fit the context length {context_length}", param="token_ids"
        )
    max_tokens = st.get("max_tokens") or 0
    if max_tokens < 0:
        raise InvalidArgument(f"max_tokens must be >= 0, got {max_tokens}", param="max_tokens")
    if not max_tokens:
        max_tokens = context_length - len(prompt) if context_length else default_max_tokens
    elif context_length and len(prompt) + max_tokens > context_length:
        raise ContextLengthExceeded(
            f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the context length {context_length}",
            param="max_tokens",
        )
    if role == "context_only":
        max_tokens = 1
    kw: dict[str, Any] = {"max_tokens": max_tokens, "detokenize": False, "return_perf_metrics": True}
    if min_tokens := st.get("min_tokens", 0):
        kw["min_tokens"] = min(min_tokens, max_tokens)
    ignore_eos = bool(st.get("ignore_eos"))
    if ignore_eos:
        kw["ignore_eos"] = True
    eos = list(request.get("eos_token_ids", ()))
    if eos:
        kw["end_id"] = eos[0]
    stop_ids = list(st.get("stop_token_ids", ()))
    if not ignore_eos:
        stop_ids += [t for t in eos[1:] if t not in stop_ids]
    if stop_ids:
        kw["stop_token_ids"] = stop_ids
    kw.update(_sampling_values(s))
    logprobs = request.get("output", {}).get("logprobs")
    if logprobs is not None:
        if logprobs < 0:
            raise InvalidArgument(f"logprobs must be >= 0, got {logprobs}", param="logprobs")
        kw["logprobs"] = max(1, logprobs)  # 0 top alternatives still returns the chosen token's logprob
    if guided := s.get("guided"):
        kw["guided_decoding"] = _guided_kwargs(guided)
    if s.get("logit_bias"):  # SamplingParams has no per-token bias map (embedding_bias is a dense tensor)
        raise InvalidArgument("logit_bias is not supported by the trtllm engine", param="logit_bias")
    return kw


def _sampling_values(s: Mapping[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    temperature = s.get("temperature")
    if temperature is not None and (temperature < 0 or not math.isfinite(temperature)):
        raise InvalidArgument(f"temperature must be a finite number >= 0, got {temperature}", param="temperature")
    if temperature == 0:
        # Greedy: TensorRT-LLM treats top_k=1 as greedy on every sampler and version.
        kw["top_k"] = 1
    else:
        if temperature is not None:
            kw["temperature"] = temperature
        if (top_k := s.get("top_k")) is not None and top_k > 0:
            kw["top_k"] = top_k
        if (top_p := s.get("top_p")) is not None:
            if not 0.0 < top_p <= 1.0:
                raise InvalidArgument(f"top_p must be in (0, 1], got {top_p}", param="top_p")
            kw["top_p"] = top_p
        if (min_p := s.get("min_p")) is not None and min_p > 0:
            kw["min_p"] = min_p
    for name in _OPTIONAL_SAMPLING:
        if name in s:
            kw[name] = s[name]
    return kw


def _guided_kwargs(g: Mapping[str, Any]) -> dict[str, Any]:
    present = [k for k in ("json_schema", "regex", "grammar", "choice", "json_object") if g.get(k)]
    if len(present) > 1:
        raise InvalidArgument(f"at most one guided decoding constraint, got {', '.join(present)}", param="guided")
    if not present:
        return {}
    kind = present[0]
    if kind == "json_schema":
        return {"json": g["json_schema"]}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "choice":
        return {"regex": "(" + "|".join(re.escape(c) for c in g["choice"]) + ")"}
    return {kind: g[kind]}


def extra_eos_ids(request: TokenRequest) -> frozenset[int]:
    """EOS ids sent to TensorRT-LLM as stop tokens (all but the first); their hit means "eos", not "stop"."""
    if request.get("stop", {}).get("ignore_eos"):
        return frozenset()
    explicit = set(request.get("stop", {}).get("stop_token_ids", ()))
    return frozenset(t for t in request.get("eos_token_ids", ())[1:] if t not in explicit)


# -------------------------------------------------------------- disaggregation


def encode_handle(extras: Mapping[str, Any]) -> bytes:
    """The kv_handle of a context-only answer: the DisaggregatedParams fields our proto lacks."""
    return HANDLE_PREFIX + json.dumps(dict(extras), separators=(",", ":"), sort_keys=True).encode()


def decode_handle(handle: bytes) -> dict[str, Any]:
    """Inverse of `encode_handle`; an empty handle is no extras."""
    if not handle:
        return {}
    if not handle.startswith(HANDLE_PREFIX):
        raise InvalidArgument("disagg.kv_handle was not made by a trtllm prefill worker", param="disagg")
    try:
        extras = json.loads(handle[len(HANDLE_PREFIX) :])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InvalidArgument("disagg.kv_handle is corrupt", param="disagg") from None
    if not isinstance(extras, dict) or not set(extras) <= set(_HANDLE_FIELDS):
        raise InvalidArgument("disagg.kv_handle carries unknown fields", param="disagg")
    return extras


def disagg_from_trtllm(params: Any, *, cached: int = 0) -> DisaggInfo:
    """Our DisaggInfo from a context-only output's `DisaggregatedParams`."""
    first = [int(t) for t in (getattr(params, "first_gen_tokens", None) or ())]
    if not first:
        raise FailedPrecondition(
            "TensorRT-LLM returned a context-only result without first_gen_tokens (is cache_transceiver_config set?)"
        )
    d: DisaggInfo = {"first_token_ids": first}
    ctx_id = getattr(params, "ctx_request_id", None)
    if ctx_id is not None:
        d["ctx_request_id"] = str(ctx_id)
    opaque = getattr(params, "opaque_state", None)
    if opaque:
        d["opaque_state"] = bytes(opaque)
    extras = {name: _plain(value) for name in _HANDLE_FIELDS if (value := getattr(params, name, None)) is not None}
    d["kv_handle"] = encode_handle(extras)
    if cached:
        d["cached_tokens"] = cached
    return d


def _plain(value: Any) -> Any:
    """JSON-safe: lists of ints stay lists, enums and numpy ints become ints."""
    if isinstance(value, str | bool | float):
        return value
    if isinstance(value, Sequence):
        return [int(v) for v in value]
    return int(value)


def disagg_to_trtllm(d: DisaggInfo) -> dict[str, Any]:
    """`DisaggregatedParams` kwargs that make a generation-only leg continue a prefill answer."""
    first = list(d.get("first_token_ids", ()))
    if not first:
        raise InvalidArgument("a generation_only request needs disagg.first_token_ids", param="disagg")
    raw_id = d.get("ctx_request_id", "")
    try:
        ctx_id = int(raw_id)
    except ValueError:
        raise InvalidArgument(
            f"a generation_only request needs an integer disagg.ctx_request_id, got {raw_id!r}", param="disagg"
        ) from None
    kw: dict[str, Any] = {
        "request_type": "generation_only",
        "first_gen_tokens": first,
        "ctx_request_id": ctx_id,
        "opaque_state": d.get("opaque_state") or None,
    }
    kw.update(decode_handle(d.get("kv_handle", b"")))
    return kw


# ---------------------------------------------------------------- output side


def token_delta(token_ids: Sequence[int], cursor: int) -> tuple[list[int], int]:
    """The tokens of a cumulative output past `cursor`, and the new cursor.

    Tokens already emitted cannot be taken back: if TensorRT-LLM trims the
    output below the cursor (a stop sequence), nothing is emitted and the
    cursor stays.
    """
    if len(token_ids) <= cursor:
        return [], cursor
    return [int(t) for t in token_ids[cursor:]], len(token_ids)


def logprob_delta(
    logprobs: Sequence[Any] | None, token_ids: Sequence[int], start: int, end: int, top_n: int
) -> list[LogprobItem]:
    """TokenLogprobs for output positions [start, end); empty unless every position has one."""
    if not logprobs or end <= start or len(logprobs) < end:
        return []
    out: list[LogprobItem] = []
    for pos in range(start, end):
        token = int(token_ids[pos])
        entry = logprobs[pos]
        if isinstance(entry, Mapping):
            chosen = entry.get(token)
            item = LogprobItem(token_id=token, logprob=_logprob(chosen) if chosen is not None else -math.inf)
            ranked = sorted(entry.items(), key=lambda kv: (_rank(kv[1]), -_logprob(kv[1])))
            item["top"] = [(int(t), _logprob(v)) for t, v in ranked[:top_n]]
        else:
            item = LogprobItem(token_id=token, logprob=float(entry))
        out.append(item)
    return out


def _logprob(value: Any) -> float:
    if isinstance(value, Mapping):
        return float(value["logprob"])
    return float(getattr(value, "logprob", value))


def _rank(value: Any) -> float:
    rank = value.get("rank") if isinstance(value, Mapping) else getattr(value, "rank", None)
    return math.inf if rank is None else float(rank)


def map_finish_reason(
    reason: str | None, stop_reason: int | str | None, *, extra_eos: Collection[int] = ()
) -> tuple[FinishReason, str]:
    """(finish_reason, stop_reason) for a CompletionOutput's finish_reason / stop_reason.

    TensorRT-LLM reports the end id and stop tokens both as "stop"; the end id
    has no stop_reason, and an extra EOS id we sent as a stop token is an EOS too.
    """
    if reason == "stop":
        if stop_reason is None or (isinstance(stop_reason, int) and stop_reason in extra_eos):
            return "eos", ""
        return "stop", str(stop_reason)
    if reason == "length":
        return "length", ""
    if reason == "cancelled":
        return "cancelled", ""
    if reason == "timeout":
        return "error", "timeout"
    return "error", reason or "finished without a finish reason"


def cached_tokens(result: Any, output: Any, *, block_size: int, prompt_len: int) -> int:
    """Prompt tokens served from the prefix cache, from the request's KV reuse metrics.

    Newer TensorRT-LLM results carry `cached_tokens`; otherwise
    `output.request_perf_metrics.kv_cache_metrics.num_reused_blocks` × block
    size (needs `return_perf_metrics`), as Dynamo's trtllm handler computes it.
    """
    direct = getattr(result, "cached_tokens", None)
    if isinstance(direct, int) and not isinstance(direct, bool):
        return max(0, min(prompt_len, direct))
    metrics = getattr(getattr(output, "request_perf_metrics", None), "kv_cache_metrics", None)
    reused = getattr(metrics, "num_reused_blocks", None)
    if isinstance(reused, int) and not isinstance(reused, bool) and block_size > 0:
        return max(0, min(prompt_len, reused * block_size))
    return 0


def usage(prompt_len: int, completion_tokens: int, cached: int) -> TokenUsage:
    return {"prompt_tokens": prompt_len, "completion_tokens": completion_tokens, "cached_tokens": min(cached, prompt_len)}

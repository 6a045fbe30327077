"""OpenAI chat/completions responses: internal values → OpenAI-shaped dicts (pure, no I/O).

Objects, choice fields, logprob layouts and usage (with
`prompt_tokens_details.cached_tokens`) as OpenAI's API returns them, for
whole responses and for streamed chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from meshllm.protocol.openai.request import RequestKind
from meshllm.protocol.types import FinishReason

__all__ = [
    "ChoiceResult",
    "LogprobEntry",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "finish_reason_openai",
    "model_list",
    "model_object",
    "prompt_logprobs_body",
    "usage_body",
    "usage_chunk",
]


_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "content_filter": "content_filter", "cancelled": "abort"}


def finish_reason_openai(reason: FinishReason | None) -> str | None:
    """Internal finish reason → OpenAI's ("eos" and "stop" both read "stop")."""
    return None if reason is None else _FINISH.get(reason, reason)


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """One token's logprob with its text and top alternatives (text, logprob).

    `logprob` is None only for a prompt's first token (nothing predicts it); `token_id` and `top_ids` feed
    vLLM's `prompt_logprobs` layout, keyed by token id.
    """

    token: str
    logprob: float | None
    top: Sequence[tuple[str, float]] = ()
    token_id: int = -1
    top_ids: Sequence[int] = ()


def _chat_logprobs(entries: Sequence[LogprobEntry]) -> dict[str, Any]:
    def item(token: str, lp: float) -> dict[str, Any]:
        return {"token": token, "logprob": lp, "bytes": list(token.encode())}

    return {"content": [{**item(e.token, e.logprob or 0.0), "top_logprobs": [item(t, p) for t, p in e.top]} for e in entries]}


def _completion_logprobs(entries: Sequence[LogprobEntry], offset: int) -> dict[str, Any]:
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_completion_top(e) for e in entries],
        "text_offset": offsets,
    }


def _completion_top(e: LogprobEntry) -> dict[str, float] | None:
    """The token itself, then its top alternatives (so `logprobs: 0` still names the token), as vLLM returns them."""
    if e.logprob is None:
        return None
    return {e.token: e.logprob, **{t: p for t, p in e.top if t != e.token}}


def prompt_logprobs_body(entries: Sequence[LogprobEntry]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id: {logprob, rank, decoded_token}}.

    Each position holds the prompt's own token and the top alternatives; `rank` (1 = likeliest) is null for a
    prompt token outside the alternatives asked for.
    """
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        ranks = {t: r for r, t in enumerate(e.top_ids, 1)}
        pos = {str(e.token_id): {"logprob": e.logprob, "rank": ranks.get(e.token_id), "decoded_token": e.token}}
        for tid, (text, lp) in zip(e.top_ids, e.top, strict=False):
            pos.setdefault(str(tid), {"logprob": lp, "rank": ranks[tid], "decoded_token": text})
        out.append(pos)
    return out


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    *,
    content: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    logprobs: Sequence[LogprobEntry] | None = None,
    usage: dict[str, Any] | None = None,
    include_usage: bool = False,
    reasoning: str | None = None,
    tool_calls: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk` with a single choice (`reasoning`: vLLM's `reasoning_content`)."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    if reasoning:
        delta["reasoning_content"] = reasoning
    if tool_calls:
        delta["tool_calls"] = list(tool_calls)
    choice = {
        "index": index,
        "delta": delta,
        "logprobs": None if logprobs is None else _chat_logprobs(logprobs),
        "finish_reason": finish_reason,
    }
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    if include_usage:
        out["usage"] = usage
    return out


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    text: str,
    *,
    finish_reason: str | None = None,
    logprobs: Sequence[LogprobEntry] | None = None,
    text_offset: int = 0,
    include_usage: bool = False,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed `text_completion` object with a single choice."""
    choice = {
        "index": index,
        "text": text,
        "logprobs": None if logprobs is None else _completion_logprobs(logprobs, text_offset),
        "finish_reason": finish_reason,
    }
    out: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if include_usage:
        out["usage"] = usage
    return out


def usage_chunk(rid: str, created: int, model: str, kind: RequestKind, usage: dict[str, Any]) -> dict[str, Any]:
    """The last streamed object when `stream_options.include_usage` is set: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}


@dataclass(slots=True)
class ChoiceResult:
    """A finished choice of a non-streaming response."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: list[LogprobEntry] | None = None
    reasoning: str | None = None  # chat: reasoning_content (None: no reasoning parser)
    tool_calls: list[dict[str, Any]] | None = None  # chat: parsed tool calls (content is null when empty)


def _message(c: ChoiceResult) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": c.text if c.text or not c.tool_calls else None}
    if c.reasoning is not None:
        msg["reasoning_content"] = c.reasoning or None
    if c.tool_calls:
        msg["tool_calls"] = c.tool_calls
    return msg


def chat_response(rid: str, created: int, model: str, choices: Sequence[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": _message(c),
                "logprobs": None if c.logprobs is None else _chat_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage,
    }


def completion_response(
    rid: str, created: int, model: str, choices: Sequence[ChoiceResult], usage: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": None if c.logprobs is None else _completion_logprobs(c.logprobs, 0),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage,
    }


def model_object(name: str, created: int, context_length: int) -> dict[str, Any]:
    """One OpenAI model object (GET /v1/models/{model}, and each entry of /v1/models)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "meshllm", "max_model_len": context_length}


def model_list(models: Sequence[tuple[str, int, int]]) -> dict[str, Any]:
    """/v1/models from (name, created, context_length) triples."""
    return {"object": "list", "data": [model_object(*m) for m in models]}

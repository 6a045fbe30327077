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
    """One generated token's logprob with its text and top alternatives (text, logprob)."""

    token: str
    logprob: float
    top: Sequence[tuple[str, float]] = ()


def _chat_logprobs(entries: Sequence[LogprobEntry]) -> dict[str, Any]:
    def item(token: str, lp: float) -> dict[str, Any]:
        return {"token": token, "logprob": lp, "bytes": list(token.encode())}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, p) for t, p in e.top]} for e in entries]}


def _completion_logprobs(entries: Sequence[LogprobEntry], offset: int) -> dict[str, Any]:
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


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
) -> dict[str, Any]:
    """One `chat.completion.chunk` with a single choice."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
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
        out["usage"] = None
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


def chat_response(rid: str, created: int, model: str, choices: Sequence[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
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


def model_list(models: Sequence[tuple[str, int, int]]) -> dict[str, Any]:
    """/v1/models from (name, created, context_length) triples."""
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "meshllm", "max_model_len": ctx}
            for name, created, ctx in models
        ],
    }

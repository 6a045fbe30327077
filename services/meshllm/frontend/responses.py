"""OpenAI response bodies from a Completion: SSE events (streaming) or one JSON object.

SSE is framed exactly as OpenAI frames it: `data: {json}\\n\\n` per event, the
first event of each choice carries `role`, the one that finishes it carries
`finish_reason`, then (with `stream_options.include_usage`) one event with
empty `choices` and the usage, then `data: [DONE]\\n\\n`. An error after the
stream has started is sent as `data: {"error": {...}}` followed by [DONE]
(the OpenAI SDKs raise it as an APIError). One upstream chunk, however many
tokens it coalesces, becomes at most one event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from meshllm.errors import MeshError, openai_error_body
from meshllm.frontend.inference import Completion
from meshllm.protocol.openai import (
    ChoiceResult,
    LogprobEntry,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    usage_chunk,
)

__all__ = ["DONE", "collect", "content_event_frame", "sse_events"]

DONE = b"data: [DONE]\n\n"


def _event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def content_event_frame(rid: str, created: int, model: str, index: int, include_usage: bool) -> tuple[bytes, bytes]:
    """The bytes around the content of a chat delta that carries only text (no role, logprobs or finish).

    `prefix + orjson.dumps(text) + suffix` is byte for byte `_event(chat_chunk(..., content=text))`:
    the per-token event of a stream is built without a dict per token.
    """
    marker = "\x00"
    whole = _event(chat_chunk(rid, created, model, index, content=marker, include_usage=include_usage))
    prefix, _, suffix = whole.partition(orjson.dumps(marker))
    return prefix, suffix


async def sse_events(c: Completion) -> AsyncIterator[bytes]:
    """The SSE byte events of a streaming response; raises only before the first event."""
    req = c.request
    chat = req.kind == "chat"
    rid, created, model, include_usage = c.id, c.created, req.model, req.include_usage
    started = [False] * len(c.choices)
    frames: dict[int, tuple[bytes, bytes]] = {}
    dumps = orjson.dumps
    sent_any = False
    try:
        async for d in c.deltas():
            if not d.text and d.finish_reason is None and not d.logprobs:
                continue  # bytes of a split character or a possible stop string are held back
            i = d.index
            first_of_choice = not started[i]
            started[i] = True
            if chat and not first_of_choice and d.finish_reason is None and d.logprobs is None:
                frame = frames.get(i)
                if frame is None:
                    frame = frames[i] = content_event_frame(rid, created, model, i, include_usage)
                yield frame[0] + dumps(d.text) + frame[1]
                sent_any = True
                continue
            if chat:
                content = d.text if (d.text or first_of_choice or d.finish_reason is None) else None
                obj = chat_chunk(
                    rid,
                    created,
                    model,
                    i,
                    content=content,
                    role=first_of_choice,
                    finish_reason=d.finish_reason,
                    logprobs=d.logprobs,
                    include_usage=include_usage,
                )
            else:
                text = d.text
                if req.echo and first_of_choice:
                    text = c.plan.prompts[c.choices[i].prompt_index].text + text
                obj = completion_chunk(
                    rid,
                    created,
                    model,
                    i,
                    text,
                    finish_reason=d.finish_reason,
                    logprobs=d.logprobs,
                    text_offset=d.offset,
                    include_usage=include_usage,
                )
            yield _event(obj)
            sent_any = True
    except MeshError as exc:
        if not sent_any:
            raise
        yield _event(openai_error_body(exc))
        yield DONE
        return
    if include_usage:
        yield _event(usage_chunk(rid, created, model, req.kind, c.usage()))
    yield DONE


async def collect(c: Completion) -> dict[str, Any]:
    """The whole non-streaming response body."""
    req = c.request
    n = len(c.choices)
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[LogprobEntry] | None] = [[] if req.logprobs is not None else None for _ in range(n)]
    async for d in c.deltas():
        if d.text:
            texts[d.index].append(d.text)
        lp = logprobs[d.index]
        if d.logprobs and lp is not None:
            lp.extend(d.logprobs)
    results = []
    for i, choice in enumerate(c.choices):
        text = "".join(texts[i])
        if req.echo:
            text = c.plan.prompts[choice.prompt_index].text + text
        results.append(ChoiceResult(i, text, choice.finish_reason, logprobs[i]))
    shape = chat_response if req.kind == "chat" else completion_response
    return shape(c.id, c.created, req.model, results, c.usage())

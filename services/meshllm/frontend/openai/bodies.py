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
from dataclasses import replace
from typing import Any

import orjson

from meshllm.errors import MeshError, openai_error_body
from meshllm.frontend.openai.inference import Completion
from meshllm.frontend.text.postprocess import ChoiceStream
from meshllm.protocol.openai import (
    ChoiceResult,
    LogprobEntry,
    TextRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    prompt_logprobs_body,
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


# size: the per-token SSE loop stays inline: a helper call per event costs on every token (bench/mesh_ab.py)
async def sse_events(c: Completion) -> AsyncIterator[bytes]:
    """The SSE byte events of a streaming response; raises only before the first event."""
    req = c.request
    chat = req.kind == "chat"
    rid, created, model, include_usage = c.id, c.created, req.model, req.include_usage
    started = [False] * len(c.choices)
    pending_prompt: dict[int, list[LogprobEntry]] = {}  # held until the choice's first event
    frames: dict[int, tuple[bytes, bytes]] = {}
    dumps = orjson.dumps
    sent_any = False
    try:
        async for d in c.deltas():
            if d.prompt_logprobs is not None:
                pending_prompt[d.index] = d.prompt_logprobs
            if not d.text and d.finish_reason is None and not d.logprobs and not d.reasoning and not d.tool_calls:
                continue  # bytes of a split character, a possible stop string or tool-call marker are held back
            i = d.index
            first_of_choice = not started[i]
            started[i] = True
            plain = not d.reasoning and not d.tool_calls and not req.continuous_usage
            if chat and plain and not first_of_choice and d.finish_reason is None and d.logprobs is None:
                frame = frames.get(i)
                if frame is None:
                    frame = frames[i] = content_event_frame(rid, created, model, i, include_usage)
                yield frame[0] + dumps(d.text) + frame[1]
                sent_any = True
                continue
            usage = c.usage() if req.continuous_usage else None
            if chat:
                bare = not d.tool_calls and not d.reasoning  # a delta of only tool calls or reasoning has no content
                content = d.text if (d.text or (bare and (first_of_choice or d.finish_reason is None))) else None
                if first_of_choice and (echoed := _chat_echo(req)):
                    content = echoed + (content or "")
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
                    usage=usage,
                    reasoning=d.reasoning or None,
                    tool_calls=[t.openai() for t in d.tool_calls] if d.tool_calls else None,
                )
            else:
                text, logprobs, offset = d.text, d.logprobs, d.offset
                if req.echo:
                    prompt_text = c.plan.prompts[c.choices[i].prompt_index].text
                    offset += len(prompt_text)
                    if first_of_choice:
                        text = prompt_text + text
                        logprobs, offset = _echoed(req, pending_prompt.get(i), logprobs), 0
                obj = completion_chunk(
                    rid,
                    created,
                    model,
                    i,
                    text,
                    finish_reason=d.finish_reason,
                    logprobs=logprobs,
                    text_offset=offset,
                    include_usage=include_usage,
                    usage=usage,
                )
            if first_of_choice and req.prompt_logprobs is not None:
                _add_prompt_logprobs(obj, req, pending_prompt.get(i), 0)
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
    reasoning: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[LogprobEntry] | None] = [[] if req.logprobs is not None else None for _ in range(n)]
    prompt: list[list[LogprobEntry] | None] = [None] * n
    async for d in c.deltas():
        if d.prompt_logprobs is not None:
            prompt[d.index] = d.prompt_logprobs
        if d.text:
            texts[d.index].append(d.text)
        if d.reasoning:
            reasoning[d.index].append(d.reasoning)
        lp = logprobs[d.index]
        if d.logprobs and lp is not None:
            lp.extend(d.logprobs)
    results = []
    for i, choice in enumerate(c.choices):
        text = "".join(texts[i])
        lp = logprobs[i]
        if req.kind == "chat":
            results.append(_chat_choice(req, i, choice, text, lp, "".join(reasoning[i])))
            continue
        if req.echo:
            text = c.plan.prompts[choice.prompt_index].text + text
            lp = _echoed(req, prompt[i], lp)
        results.append(ChoiceResult(i, text, choice.finish_reason, lp))
    shape = chat_response if req.kind == "chat" else completion_response
    body = shape(c.id, c.created, req.model, results, c.usage())
    if req.prompt_logprobs is not None:
        for i in range(n):
            _add_prompt_logprobs(body, req, prompt[i], i)
    return body


def _chat_echo(req: TextRequest) -> str:
    """Chat `echo` (vLLM): the last message's content, when it is the assistant's, opens the answer."""
    if not req.echo or not req.messages or req.messages[-1]["role"] != "assistant":
        return ""
    return str(req.messages[-1].get("content") or "")


def _chat_choice(
    req: TextRequest, i: int, choice: ChoiceStream, content: str, lp: list[LogprobEntry] | None, reasoning: str
) -> ChoiceResult:
    """A chat choice: tool calls and reasoning split out when a parser is on, the echo prepended."""
    finish, calls = choice.finish_reason, None
    out = choice.output
    if out is not None:
        parsed = out.whole(content)
        content = parsed.content or ""
        calls = [t.openai() for t in parsed.calls] or None
        if calls is None and finish == "tool_calls":  # the calls were not valid JSON: the text is the answer
            finish = "stop"
    has_reasoning = out is not None and out.reasons
    return ChoiceResult(
        i, _chat_echo(req) + content, finish, lp, reasoning=reasoning if has_reasoning else None, tool_calls=calls
    )


def _trimmed(entries: list[LogprobEntry], k: int) -> list[LogprobEntry]:
    """Entries with at most `k` alternatives (the engine computed as many as the larger of two asks)."""
    return [e if len(e.top) <= k else replace(e, top=e.top[:k], top_ids=e.top_ids[:k]) for e in entries]


def _echoed(
    req: TextRequest, prompt: list[LogprobEntry] | None, generated: list[LogprobEntry] | None
) -> list[LogprobEntry] | None:
    """Completions `echo` + `logprobs`: the prompt tokens' entries (the first without a logprob), then the generated."""
    if req.kind != "completion" or req.logprobs is None or prompt is None:
        return generated
    return [*_trimmed(prompt, req.logprobs), *(generated or ())]


def _add_prompt_logprobs(body: dict[str, Any], req: TextRequest, prompt: list[LogprobEntry] | None, position: int) -> None:
    """vLLM's `prompt_logprobs`: on the completion choice at `position`, at the top level of a chat body (as vLLM)."""
    if prompt is None or req.prompt_logprobs is None:
        return
    value = prompt_logprobs_body(_trimmed(prompt, req.prompt_logprobs))
    if req.kind == "chat":
        body["prompt_logprobs"] = value
    else:
        body["choices"][position]["prompt_logprobs"] = value

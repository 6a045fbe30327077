"""`POST /v1/responses`: OpenAI's Responses API, run as a chat completion through the same path as /v1/chat/completions.

    api = ResponsesApi()                    # one per HTTP app: holds the stored responses
    req = api.parse(body)                   # a chat TextRequest (+ the Response's context), or a 400/404
    completion = await core.begin(req)      # the chat path: template, tools, tokenization, upstream
    await api.collect(completion)           # the Response object          (stream: false)
    api.events(completion)                  # its SSE events, OpenAI's order (stream: true)

The output is what the chat path makes of the model's text, whatever its
parsers split off: content → a `message` item with `output_text`;
`tool_calls` → `function_call` items (with `--tool-call-parser`, see
frontend/tools); `reasoning_content` → a `reasoning` item. Streams follow
OpenAI's event sequence, each event with a `sequence_number`:
`response.created`, `response.in_progress`, then per item
`response.output_item.added`, (`response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done` | `response.function_call_arguments.delta`...,
`response.function_call_arguments.done` | `response.reasoning_text.delta`...,
`response.reasoning_text.done`), `response.output_item.done`, and last
`response.completed` (`response.incomplete` when `max_output_tokens` cut it
short). An error after the stream started is an `error` event then
`response.failed`.

`previous_response_id` continues a stored response: its input and output
are placed before the new input (its `instructions` are not carried over,
as OpenAI does). `GET /v1/responses/{id}` returns a stored response,
`DELETE /v1/responses/{id}` forgets it. Responses are stored unless
`store: false`, in this process's memory only (with `--workers N` an id is
known to the process that answered it): at most `MAX_STORED_RESPONSES`
conversations and `MAX_STORED_CHARS` characters of them in all, least
recently used first out, each for `STORED_TTL_S` after its last use.

A stored response belongs to the tenant (API key id) that made it: for any
other tenant its id does not exist. An unknown, expired or another tenant's
id is the same 404, with the same message.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import orjson

from meshllm.errors import InvalidArgument, MeshError, NotFound, openai_error_body, shorten
from meshllm.frontend.http.auth import ANONYMOUS
from meshllm.frontend.openai.bodies import collect
from meshllm.frontend.openai.inference import Completion
from meshllm.frontend.openai.response_store import ResponseStore
from meshllm.frontend.text.postprocess import Delta
from meshllm.protocol.openai import TextRequest, parse_chat
from meshllm.protocol.openai.responses_schema import (
    ResponseEcho,
    chat_body_of,
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    remap_error,
    response_object,
    responses_usage,
)

__all__ = ["ResponsesApi", "ResponsesRequest"]


@dataclass(frozen=True, slots=True)
class ResponseContext:
    """What the Response of a request needs beyond the chat request: its id, echo fields, the conversation so far."""

    id: str
    created_at: int
    model: str
    echo: ResponseEcho
    conversation: tuple[dict[str, Any], ...]  # history + new input (no instructions): stored with the output
    tenant: str  # who owns the stored response


@dataclass(frozen=True, kw_only=True, slots=True)
class ResponsesRequest(TextRequest):
    """A chat TextRequest that a Responses API call became."""

    context: ResponseContext | None = None


@dataclass(slots=True)
class _Output:
    """The output items of a streamed response, built as the deltas arrive."""

    items: list[dict[str, Any]] = field(default_factory=list)
    open_kind: str | None = None  # "message" | "reasoning" | "function_call"
    text: list[str] = field(default_factory=list)
    calls: dict[int, int] = field(default_factory=dict)  # tool call index → output index


class ResponsesApi:
    """Parsing, shaping and storage of the Responses API (see the module docstring)."""

    def __init__(self, store: ResponseStore | None = None) -> None:
        self.store = store if store is not None else ResponseStore()

    def parse(self, body: Any, *, strict: bool = False, tenant: str = ANONYMOUS) -> ResponsesRequest:
        """A validated Responses body of `tenant` as a chat request; 404 for an unknown `previous_response_id`.

        Unknown fields are always refused here (`strict` is for the chat parsers' signature): the chat body
        is built from known fields only.
        """
        history: tuple[dict[str, Any], ...] = ()
        prev = body.get("previous_response_id") if isinstance(body, dict) else None
        if isinstance(prev, str):
            found = self.store.get(prev, tenant)
            if found is None:
                raise NotFound(f"Previous response with id '{shorten(prev, 100)}' not found.", param="previous_response_id")
            history = found.messages
        chat, new, echo = chat_body_of(body, history)
        try:
            req = parse_chat(chat, strict=True)
        except InvalidArgument as exc:
            raise remap_error(exc) from None
        rid = new_id("resp")
        context = ResponseContext(rid, int(time.time()), req.model, echo, (*history, *new), tenant)
        values = {f.name: getattr(req, f.name) for f in fields(req)}
        return ResponsesRequest(**values, context=context)

    def retrieve(self, rid: str, tenant: str) -> dict[str, Any]:
        """`GET /v1/responses/{id}`: the stored Response object of `tenant`, else NotFound."""
        found = self.store.get(rid, tenant)
        if found is None:
            raise _unknown(rid)
        return found.response

    def delete(self, rid: str, tenant: str) -> dict[str, Any]:
        """`DELETE /v1/responses/{id}`: OpenAI's deletion object, else NotFound."""
        if not self.store.delete(rid, tenant):
            raise _unknown(rid)
        return {"id": rid, "object": "response", "deleted": True}

    # ------------------------------------------------------------ non-streaming
    async def collect(self, c: Completion) -> dict[str, Any]:
        ctx = _context(c)
        body = await collect(c)
        choice = body["choices"][0]
        msg = choice["message"]
        output: list[dict[str, Any]] = []
        if msg.get("reasoning_content"):
            output.append(reasoning_item(new_id("rs"), msg["reasoning_content"]))
        if msg.get("content") or not msg.get("tool_calls"):
            output.append(message_item(new_id("msg"), msg.get("content") or ""))
        for call in msg.get("tool_calls") or ():
            fn = call["function"]
            output.append(function_call_item(new_id("fc"), call["id"], fn["name"], fn["arguments"]))
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        final = response_object(
            ctx.id, ctx.created_at, ctx.model, ctx.echo, status=status, output=output, usage=responses_usage(body["usage"])
        )
        self._remember(ctx, output, final)
        return final

    # ------------------------------------------------------------ streaming
    # size: the Responses API's per-delta event loop stays inline: a helper call per event costs on every token
    async def events(self, c: Completion) -> AsyncIterator[bytes]:
        """The SSE events; raises (an HTTP error) only before the first.

        Built from the completion's deltas directly (not from the chat stream's JSON events: no JSON
        round trip per token). Held-back deltas (nothing to show yet) are skipped as the chat stream does.
        """
        ctx = _context(c)
        deltas = c.deltas()
        first = await anext(deltas)
        while not _shows(first):  # upstream errors before any output are a plain HTTP error
            first = await anext(deltas)
        seq = [0]

        def event(kind: str, **data: Any) -> bytes:
            obj = {"type": kind, "sequence_number": seq[0], **data}
            seq[0] += 1
            return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"

        def response(status: str, output: Sequence[dict[str, Any]] = (), **extra: Any) -> dict[str, Any]:
            return response_object(ctx.id, ctx.created_at, ctx.model, ctx.echo, status=status, output=output, **extra)

        yield event("response.created", response=response("in_progress"))
        yield event("response.in_progress", response=response("in_progress"))
        out = _Output()
        finish: str | None = None
        d: Delta | None = first
        try:
            while d is not None:
                for b in _feed(out, d, event):
                    yield b
                finish = d.finish_reason or finish
                d = await anext(deltas, None)
        except MeshError as exc:
            for b in _close(out, event):
                yield b
            err = openai_error_body(exc)["error"]
            yield event("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
            yield event(
                "response.failed",
                response=response("failed", out.items, error={"code": "server_error", "message": err.get("message")}),
            )
            return
        for b in _close(out, event):
            yield b
        if not out.items:  # nothing was generated: still one (empty) message, as OpenAI answers
            for b in _open(out, "message", event):
                yield b
            for b in _close(out, event):
                yield b
        status = "incomplete" if finish == "length" else "completed"
        final = response(status, out.items, usage=responses_usage(c.usage()))
        self._remember(ctx, out.items, final)
        yield event("response.incomplete" if status == "incomplete" else "response.completed", response=final)

    def _remember(self, ctx: ResponseContext, output: Sequence[dict[str, Any]], response: dict[str, Any]) -> None:
        if not ctx.echo.store:
            return
        reply: list[dict[str, Any]] = []
        for item in output:
            if item["type"] == "message":
                reply.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
            elif item["type"] == "function_call":
                call = {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
                if reply and reply[-1].get("tool_calls"):
                    reply[-1]["tool_calls"].append(call)
                else:
                    reply.append({"role": "assistant", "content": "", "tool_calls": [call]})
        self.store.put(ctx.id, ctx.tenant, [*ctx.conversation, *reply], response)


Event = Callable[..., bytes]


def _unknown(rid: str) -> NotFound:
    """The one answer for an id this tenant cannot see: unknown, expired, deleted or another tenant's."""
    return NotFound(f"Response with id '{shorten(rid, 100)}' not found.")


def _context(c: Completion) -> ResponseContext:
    req = c.request
    if not isinstance(req, ResponsesRequest) or req.context is None:
        raise MeshError("a Responses API completion was begun from a plain chat request")
    return req.context


def _open(out: _Output, kind: str, event: Event, **item: Any) -> list[bytes]:
    events = _close(out, event)
    index = len(out.items)
    if kind == "message":
        added = message_item(new_id("msg"), "", status="in_progress")
    elif kind == "reasoning":
        added = {**reasoning_item(new_id("rs"), ""), "content": []}
    else:
        added = function_call_item(new_id("fc"), item["call_id"], item["name"], "", status="in_progress")
    out.items.append(added)
    out.open_kind, out.text = kind, []
    events.append(event("response.output_item.added", output_index=index, item=added))
    if kind == "message":
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events.append(event("response.content_part.added", item_id=added["id"], output_index=index, content_index=0, part=part))
    return events


def _close(out: _Output, event: Event) -> list[bytes]:
    if out.open_kind is None:
        return []
    index = len(out.items) - 1
    item = out.items[index]
    text = "".join(out.text)
    ids = {"item_id": item["id"], "output_index": index}
    events: list[bytes] = []
    if out.open_kind == "message":
        events.append(event("response.output_text.done", **ids, content_index=0, text=text, logprobs=[]))
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        events.append(event("response.content_part.done", **ids, content_index=0, part=part))
        item = message_item(item["id"], text)
    elif out.open_kind == "reasoning":
        events.append(event("response.reasoning_text.done", **ids, content_index=0, text=text))
        item = reasoning_item(item["id"], text)
    else:
        events.append(event("response.function_call_arguments.done", **ids, name=item["name"], arguments=text))
        item = {**item, "arguments": text, "status": "completed"}
    out.items[index] = item
    out.open_kind, out.text = None, []
    events.append(event("response.output_item.done", output_index=index, item=item))
    return events


def _shows(d: Delta) -> bool:
    """Whether a delta has anything to show (else bytes are held back: a split character, a possible marker)."""
    return bool(d.text or d.finish_reason is not None or d.reasoning or d.tool_calls)


def _feed(out: _Output, d: Delta, event: Event) -> list[bytes]:
    """Events for one delta: reasoning, content, tool-call pieces (each opens its item when needed)."""
    events: list[bytes] = []
    for kind, text, name in (
        ("reasoning", d.reasoning, "response.reasoning_text.delta"),
        ("message", d.text, "response.output_text.delta"),
    ):
        if not text:
            continue
        if out.open_kind != kind:
            events += _open(out, kind, event)
        out.text.append(text)
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append(
            event(name, item_id=out.items[-1]["id"], output_index=len(out.items) - 1, content_index=0, delta=text, **extra)
        )
    for call in d.tool_calls or ():
        if call.id is not None:  # the first piece of a call: its id and name
            events += _open(out, "function_call", event, call_id=call.id, name=call.name or "")
            out.calls[call.index] = len(out.items) - 1
        args = call.arguments
        if args and out.open_kind == "function_call" and out.calls.get(call.index) == len(out.items) - 1:
            out.text.append(args)
            events.append(
                event(
                    "response.function_call_arguments.delta",
                    item_id=out.items[-1]["id"],
                    output_index=len(out.items) - 1,
                    delta=args,
                )
            )
    return events

"""The text-level `Inference` gRPC service: the HTTP API's chat and completion semantics for other languages.

Requests are turned into the OpenAI body they stand for and validated by the
same parser as HTTP (one set of rules, one set of error messages); errors
cross as gRPC statuses through the transport's error mapping (InvalidArgument
→ INVALID_ARGUMENT, NotFound → NOT_FOUND, Overloaded → RESOURCE_EXHAUSTED,
...). Each streamed TextChunk carries new text; the last one of a choice has
its finish reason and usage. A cancelled call cancels the request upstream.

The chunks carry what the HTTP stream's deltas carry, from the same
`Delta`s: `reasoning` (the reasoning parser's split), `tool_calls` pieces
(the tool-call parser's, in OpenAI's streaming order; `tool_calls_finished`
on the terminal chunk stands for finish_reason "tool_calls"), `logprobs`,
and `prompt_logprobs` on a choice's first chunk. `tools` / `tool_choice`
become the OpenAI body's fields, so a forced choice is enforced (and
refused on engines that cannot) exactly as over HTTP.

With API keys set (frontend/http/auth.py), every method needs the metadata
`authorization: Bearer KEY`; a missing or wrong key ends the call with
UNAUTHENTICATED before anything runs. The server's health and reflection
services stay open.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import orjson

from meshllm.errors import InvalidArgument
from meshllm.frontend.http.auth import ANONYMOUS, ApiKeys, AuthFailure
from meshllm.frontend.openai.inference import InferenceCore
from meshllm.frontend.text.postprocess import Delta
from meshllm.plane.request.server import ServiceBinding
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.openai import LogprobEntry, TextRequest, parse_chat, parse_completion
from meshllm.v1 import generate_pb2, inference_pb2, inference_pb2_grpc

__all__ = ["InferenceServicer", "chat_body", "inference_binding", "params_body"]

_FINISH = {
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "content_filter": generate_pb2.FINISH_REASON_CONTENT_FILTER,
    "abort": generate_pb2.FINISH_REASON_CANCELLED,
    "tool_calls": generate_pb2.FINISH_REASON_STOP,  # with tool_calls_finished
}
_MODES = {
    inference_pb2.ToolChoice.MODE_NONE: "none",
    inference_pb2.ToolChoice.MODE_AUTO: "auto",
    inference_pb2.ToolChoice.MODE_REQUIRED: "required",
}
_OPTIONAL = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)


def params_body(p: inference_pb2.TextParams, *, chat: bool) -> dict[str, Any]:
    """TextParams → the OpenAI body fields they mean (validated later by the shared parser)."""
    body: dict[str, Any] = {k: getattr(p, k) for k in _OPTIONAL if p.HasField(k)}
    if p.stop:
        body["stop"] = list(p.stop)
    if p.stop_token_ids:
        body["stop_token_ids"] = list(p.stop_token_ids)
    if p.ignore_eos:
        body["ignore_eos"] = True
    if p.min_tokens:
        body["min_tokens"] = p.min_tokens
    if p.HasField("logprobs"):
        if chat:
            body["logprobs"], body["top_logprobs"] = True, p.logprobs
        else:
            body["logprobs"] = p.logprobs
    if p.HasField("prompt_logprobs"):
        body["prompt_logprobs"] = p.prompt_logprobs
    if p.HasField("guided"):
        kind = p.guided.WhichOneof("kind")
        if kind == "json_schema":
            body["guided_json"] = p.guided.json_schema
        elif kind == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif kind == "regex":
            body["guided_regex"] = p.guided.regex
        elif kind == "grammar":
            body["guided_grammar"] = p.guided.grammar
        elif kind == "choice":
            body["guided_choice"] = list(p.guided.choice.values)
    return body


def _tools(tools: Sequence[inference_pb2.Tool]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        fn: dict[str, Any] = {"name": t.name}
        if t.description:
            fn["description"] = t.description
        if t.parameters:
            try:
                fn["parameters"] = orjson.loads(t.parameters)
            except orjson.JSONDecodeError as exc:
                where = f"tools[{i}].parameters"
                raise InvalidArgument(f"'{where}': not valid JSON ({exc})", param=where) from None
        if not t.name:
            raise InvalidArgument(f"'tools[{i}].name': a function name is required", param=f"tools[{i}].name")
        out.append({"type": "function", "function": fn})
    return out


def chat_body(request: inference_pb2.ChatRequest) -> dict[str, Any]:
    """A ChatRequest → the OpenAI chat body it stands for (validated later by `parse_chat`, as HTTP's)."""
    messages = []
    for m in request.messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls
            ]
        messages.append(msg)
    body = {"model": request.model, "messages": messages, "stream": True, **params_body(request.params, chat=True)}
    if request.tools:
        body["tools"] = _tools(request.tools)
    if request.HasField("tool_choice"):
        which = request.tool_choice.WhichOneof("choice")
        if which == "function":
            body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.function}}
        elif which == "mode" and request.tool_choice.mode in _MODES:
            body["tool_choice"] = _MODES[request.tool_choice.mode]
    if request.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = request.parallel_tool_calls
    if request.request_id:
        body["request_id"] = request.request_id
    return body


def _logprobs(entries: Sequence[LogprobEntry], k: int | None = None) -> list[inference_pb2.TextLogprob]:
    """LogprobEntries → TextLogprobs (at most `k` alternatives each: the engine computed the larger of two asks)."""
    out = []
    for e in entries:
        top = [
            inference_pb2.TopTextLogprob(token=text, token_id=tid, logprob=lp)
            for (text, lp), tid in zip(e.top[:k], e.top_ids[:k] if e.top_ids else [0] * len(e.top), strict=False)
        ]
        item = inference_pb2.TextLogprob(token=e.token, token_id=max(e.token_id, 0), top=top)
        if e.logprob is not None:
            item.logprob = e.logprob
        out.append(item)
    return out


def _chunk(d: Delta, rid: str, req: TextRequest) -> inference_pb2.TextChunk:
    """One Delta as a TextChunk (finish reason and usage are added by the caller)."""
    msg = inference_pb2.TextChunk(text=d.text, index=d.index, request_id=rid, token_ids=d.token_ids or (), reasoning=d.reasoning)
    if d.tool_calls:
        msg.tool_calls.extend(
            inference_pb2.ToolCall(index=c.index, id=c.id or "", name=c.name or "", arguments=c.arguments) for c in d.tool_calls
        )
    if d.logprobs:
        msg.logprobs.extend(_logprobs(d.logprobs))
    if d.prompt_logprobs is not None and req.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(_logprobs(d.prompt_logprobs, req.prompt_logprobs))
    return msg


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Serves `meshllm.v1.Inference` over an InferenceCore."""

    def __init__(self, core: InferenceCore, api_keys: ApiKeys | None = None) -> None:
        self.core = core
        self.api_keys = api_keys if api_keys is not None else ApiKeys()

    async def _authorize(self, context: grpc.aio.ServicerContext, route: str) -> str:
        """The call's tenant (its key's id; ANONYMOUS without keys); aborts with UNAUTHENTICATED without an accepted key."""
        if not self.api_keys:
            return ANONYMOUS
        header = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
        result = self.api_keys.check(header if isinstance(header, str | bytes) else None)
        metrics = self.core.metrics
        if isinstance(result, AuthFailure):
            metrics.auth_failures.labels("grpc", result.value).inc()
            metrics.requests.labels(f"grpc:{route}", "unauthenticated", "").inc()
            how = "send the metadata 'authorization: Bearer YOUR_KEY'"
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{result.message} ({how})")
        metrics.key_used(str(result), "grpc")
        return str(result)

    async def ChatCompletion(
        self, request: inference_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.TextChunk]:
        tenant = await self._authorize(context, "ChatCompletion")
        async for chunk in self._run(parse_chat(chat_body(request)), context, "ChatCompletion", tenant):
            yield chunk

    async def Completion(
        self, request: inference_pb2.CompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.TextChunk]:
        tenant = await self._authorize(context, "Completion")
        body = {"model": request.model, "prompt": request.prompt, "stream": True, **params_body(request.params, chat=False)}
        if request.request_id:
            body["request_id"] = request.request_id
        async for chunk in self._run(parse_completion(body), context, "Completion", tenant):
            yield chunk

    async def _run(
        self, req: TextRequest, context: grpc.aio.ServicerContext, route: str, tenant: str
    ) -> AsyncIterator[inference_pb2.TextChunk]:
        status = "error"
        completion = None
        try:
            completion = await self.core.begin(req, call=CallInfo.from_context(context), tenant=tenant)
            rid = completion.id
            async for d in completion.deltas():
                if not (d.text or d.finish_reason or d.reasoning or d.tool_calls or d.logprobs or d.prompt_logprobs):
                    continue  # bytes held back: a split character, a possible stop string or tool-call marker
                msg = _chunk(d, rid, req)
                if d.finish_reason is not None:
                    c = completion.choices[d.index]
                    msg.finish_reason = _FINISH.get(d.finish_reason, generate_pb2.FINISH_REASON_STOP)  # type: ignore[assignment]
                    msg.tool_calls_finished = d.finish_reason == "tool_calls"
                    msg.usage.prompt_tokens = c.prompt_tokens
                    msg.usage.completion_tokens = c.completion_tokens
                    msg.usage.cached_tokens = c.cached_tokens
                yield msg
            status = "ok"
        finally:
            if completion is not None:
                await completion.aclose()
            model = completion.model.name if completion is not None else ""  # a served model only: no client-made series
            self.core.metrics.requests.labels(f"grpc:{route}", status, model).inc()

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        await self._authorize(context, "ListModels")
        return inference_pb2.ListModelsResponse(
            models=[
                inference_pb2.ModelInfo(id=m.name, owned_by="meshllm", context_length=m.context_length, instances=m.instances)
                for m in self.core.registry.list()
            ]
        )


def inference_binding(core: InferenceCore, api_keys: ApiKeys | None = None) -> ServiceBinding:
    """How `start_server` registers the Inference service (`api_keys`: the keys its callers need)."""
    servicer = InferenceServicer(core, api_keys)
    return ServiceBinding("meshllm.v1.Inference", servicer, inference_pb2_grpc.add_InferenceServicer_to_server)

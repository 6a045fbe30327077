"""The text-level `Inference` gRPC service: the HTTP API's chat and completion semantics for other languages.

Requests are turned into the OpenAI body they stand for and validated by the
same parser as HTTP (one set of rules, one set of error messages); errors
cross as gRPC statuses through the transport's error mapping (InvalidArgument
→ INVALID_ARGUMENT, NotFound → NOT_FOUND, Overloaded → RESOURCE_EXHAUSTED,
...). Each streamed TextChunk carries new text; the last one of a choice has
its finish reason and usage. A cancelled call cancels the request upstream.

With API keys set (frontend/auth.py), every method needs the metadata
`authorization: Bearer KEY`; a missing or wrong key ends the call with
UNAUTHENTICATED before anything runs. The server's health and reflection
services stay open.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from meshllm.frontend.auth import ApiKeys, AuthFailure
from meshllm.frontend.inference import InferenceCore
from meshllm.plane.transport import CallInfo, ServiceBinding
from meshllm.protocol.openai import TextRequest, parse_chat, parse_completion
from meshllm.v1 import generate_pb2, inference_pb2, inference_pb2_grpc

__all__ = ["InferenceServicer", "inference_binding", "params_body"]

_FINISH = {
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "content_filter": generate_pb2.FINISH_REASON_CONTENT_FILTER,
    "abort": generate_pb2.FINISH_REASON_CANCELLED,
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


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Serves `meshllm.v1.Inference` over an InferenceCore."""

    def __init__(self, core: InferenceCore, api_keys: ApiKeys | None = None) -> None:
        self.core = core
        self.api_keys = api_keys if api_keys is not None else ApiKeys()

    async def _authorize(self, context: grpc.aio.ServicerContext, route: str) -> None:
        """Return when the call carries an accepted key (or none is needed); else abort with UNAUTHENTICATED."""
        if not self.api_keys:
            return
        header = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
        result = self.api_keys.check(header if isinstance(header, str | bytes) else None)
        metrics = self.core.metrics
        if isinstance(result, AuthFailure):
            metrics.auth_failures.labels("grpc", result.value).inc()
            metrics.requests.labels(f"grpc:{route}", "unauthenticated", "").inc()
            how = "send the metadata 'authorization: Bearer YOUR_KEY'"
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{result.message} ({how})")
        metrics.key_used(str(result), "grpc")

    async def ChatCompletion(
        self, request: inference_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.TextChunk]:
        await self._authorize(context, "ChatCompletion")
        messages = []
        for m in request.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.name:
                msg["name"] = m.name
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            messages.append(msg)
        body = {"model": request.model, "messages": messages, "stream": True, **params_body(request.params, chat=True)}
        if request.request_id:
            body["request_id"] = request.request_id
        async for chunk in self._run(parse_chat(body), context, "ChatCompletion"):
            yield chunk

    async def Completion(
        self, request: inference_pb2.CompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.TextChunk]:
        await self._authorize(context, "Completion")
        body = {"model": request.model, "prompt": request.prompt, "stream": True, **params_body(request.params, chat=False)}
        if request.request_id:
            body["request_id"] = request.request_id
        async for chunk in self._run(parse_completion(body), context, "Completion"):
            yield chunk

    async def _run(
        self, req: TextRequest, context: grpc.aio.ServicerContext, route: str
    ) -> AsyncIterator[inference_pb2.TextChunk]:
        status = "error"
        completion = None
        try:
            completion = await self.core.begin(req, call=CallInfo.from_context(context))
            rid = completion.id
            async for d in completion.deltas():
                if not d.text and d.finish_reason is None:
                    continue
                msg = inference_pb2.TextChunk(text=d.text, index=d.index, request_id=rid, token_ids=d.token_ids or ())
                if d.finish_reason is not None:
                    c = completion.choices[d.index]
                    msg.finish_reason = _FINISH.get(d.finish_reason, generate_pb2.FINISH_REASON_STOP)  # type: ignore[assignment]
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

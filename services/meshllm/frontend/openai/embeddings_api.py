"""`POST /v1/embeddings`: OpenAI's embeddings on engines that can embed (llama.cpp), a clear 400 elsewhere.

    req = parse_embeddings(body)            # a completion-kind TextRequest: one prompt per input, max_tokens 1
    completion = await core.begin(req)      # admission, model, tokenization, context length (as completions)
    body = await collect(completion)        # each input's TokenRequest with output.embedding, in parallel

`input` is a string, an array of strings, an array of token ids or an array
of token-id arrays (at most `MAX_INPUTS`); strings are tokenized as
completions prompts are. Each becomes one upstream request with
`output.embedding` set, answered by one terminal chunk with the pooled,
L2-normalized vector (generate.proto). An engine that does not embed (the
mocker, TensorRT-LLM) answers with tokens instead: that is a 400 saying so.
`encoding_format` "float" (default) or "base64" (little-endian float32, as
OpenAI; the `openai` SDK asks for it); `dimensions` is refused (no
truncation of the model's vector).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from meshllm.errors import InvalidArgument, MeshError, StreamIncomplete, error_from_code
from meshllm.frontend.openai.inference import Completion
from meshllm.protocol.openai.extensions import request_fields
from meshllm.protocol.openai.request import EmbeddingsRequest
from meshllm.protocol.types import TokenRequest
from meshllm.protocol.validate import UINT32_MAX
from meshllm.protocol.validate import bad as _bad

__all__ = ["MAX_INPUTS", "EmbeddingsRequest", "collect", "events", "parse_embeddings"]

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
FIELDS = frozenset({"model", "input", "encoding_format", "dimensions"})


def _inputs(value: Any) -> tuple[str | tuple[int, ...], ...]:
    def ids(v: Any) -> bool:
        return (
            isinstance(v, list)
            and bool(v)
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX for t in v)
        )

    if isinstance(value, str):
        items: list[Any] = [value]
    elif ids(value):
        items = [value]
    elif isinstance(value, list) and value and (all(isinstance(v, str) for v in value) or all(ids(v) for v in value)):
        items = value
    else:
        raise _bad("input", "expected a string, an array of strings, an array of token ids or an array of token-id arrays")
    if len(items) > MAX_INPUTS:
        raise _bad("input", f"at most {MAX_INPUTS} inputs per request")
    if any(isinstance(v, str) and not v for v in items):
        raise _bad("input", "inputs must not be empty strings")
    return tuple(v if isinstance(v, str) else tuple(v) for v in items)


def parse_embeddings(body: Any, *, strict: bool = False) -> EmbeddingsRequest:
    """Validate a /v1/embeddings body (`strict`: an unknown field is a 400, as for chat and completions)."""
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    ignored = request_fields(body, FIELDS, strict=strict)
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise _bad("model", "a model name (non-empty string) is required")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise _bad("encoding_format", f"must be 'float' or 'base64', got {fmt!r}")
    if body.get("dimensions") is not None:
        raise _bad("dimensions", "is not supported: embeddings have the model's own dimension")
    return EmbeddingsRequest(
        kind="completion",
        model=model,
        prompts=_inputs(body.get("input")),
        max_tokens=1,
        request_id=f"embd-{uuid.uuid4().hex}",
        encoding_format=fmt,
        ignored=ignored,
    )


async def _embed_one(c: Completion, request: TokenRequest) -> list[float]:
    request = {**request, "output": {**request.get("output", {}), "embedding": True}}  # type: ignore[typeddict-item]
    stream = c.core.upstream.generate(request, call=c.call)
    try:
        async for chunk in stream:
            if chunk.get("finish_reason") == "error":
                err = chunk.get("error") or {"code": "Unknown", "message": "upstream error"}
                raise error_from_code(err["code"], err["message"])
            if "embedding" in chunk:
                return chunk["embedding"]
            if chunk.get("token_ids") or "finish_reason" in chunk:
                raise InvalidArgument(
                    f"the engine serving model {c.model.name!r} does not compute embeddings (llamacpp does)", param="model"
                )
        raise StreamIncomplete("the upstream stream ended without an embedding")
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(MeshError, RuntimeError, StopAsyncIteration):
                await aclose()


def _encoded(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


async def collect(c: Completion) -> dict[str, Any]:
    """The embeddings response body: every input embedded in parallel, in input order."""
    req = c.request
    fmt = req.encoding_format if isinstance(req, EmbeddingsRequest) else "float"
    vectors = await asyncio.gather(*(_embed_one(c, r) for r in c.plan.requests))
    tokens = sum(len(p.token_ids) for p in c.plan.prompts)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, fmt)} for i, v in enumerate(vectors)],
        "model": req.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def events(c: Completion) -> AsyncIterator[bytes]:
    """Embeddings do not stream (`parse_embeddings` never sets `stream`)."""
    raise InvalidArgument("embeddings do not stream", param="stream")
    yield b""  # pragma: no cover - makes this an async generator

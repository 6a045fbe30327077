"""The 400s refusing what the engines behind a model cannot do (their combined `Capabilities`).

`check_capabilities` runs in `InferenceCore.begin`, before preprocessing and
before any engine sees the request: prompt logprobs (`prompt_logprobs`, or
completions' `echo` + `logprobs`), embeddings and a forced `tool_choice`
("required" / a named function: guided decoding) on an engine without them
are a 400. With None the frontend behaves as before the field existed: the
engine's answer tells for prompt logprobs and embeddings, the engine's name
for guided decoding (`check_guided_engines`).
"""

from __future__ import annotations

from meshllm.errors import InvalidArgument
from meshllm.frontend.models import ModelRegistry, ServedModel
from meshllm.frontend.text.output_parsers import check_guided_engines, unguided
from meshllm.protocol.openai.request import EmbeddingsRequest, TextRequest

__all__ = ["check_capabilities"]


async def check_capabilities(req: TextRequest, model: ServedModel, registry: ModelRegistry) -> None:
    """InvalidArgument when `req` needs something an engine serving `model` cannot do."""
    caps = model.capabilities
    forced = req.tool_choice == "required" or req.tool_choice.startswith("function:")
    if forced and caps.guided_decoding is False:
        engines = sorted(e for e in await registry.engines(model.name) if e) or ["engine"]
        raise unguided(model.name, engines, req.tool_choice)
    if forced and caps.guided_decoding is None:
        check_guided_engines(model.name, await registry.engines(model.name), req.tool_choice)
    if caps.prompt_logprobs is False and req.prompt_logprobs_asked() is not None:
        raise InvalidArgument(
            f"the engine serving model {model.name!r} does not compute prompt logprobs "
            "(asked for by 'prompt_logprobs', or by 'echo' with 'logprobs'); llamacpp does",
            param="prompt_logprobs",
        )
    if caps.embeddings is False and isinstance(req, EmbeddingsRequest):
        raise InvalidArgument(
            f"the engine serving model {model.name!r} does not compute embeddings (llamacpp does)", param="model"
        )

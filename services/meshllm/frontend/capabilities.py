"""What the engines behind a model can do (ModelCard `capabilities`), and the 400s refusing what they cannot.

Each worker publishes its engine's capabilities (`LLMEngine.supports_*`) in
its card; a model's are combined over every live card: False when any
worker lacks one (a request may be routed to it), True when all have it,
None ("not said") when some card predates the field and none says False.

`check_capabilities` runs in `InferenceCore.begin`, before preprocessing and
before any engine sees the request: prompt logprobs (`prompt_logprobs`, or
completions' `echo` + `logprobs`), embeddings and a forced `tool_choice`
("required" / a named function: guided decoding) on an engine without them
are a 400. With None the frontend behaves as before the field existed: the
engine's answer tells for prompt logprobs and embeddings, the engine's name
for guided decoding (`check_guided_engines`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshllm.errors import InvalidArgument
from meshllm.frontend.output_parsers import check_guided_engines, unguided
from meshllm.protocol.openai import TextRequest
from meshllm.v1 import discovery_pb2

if TYPE_CHECKING:
    from meshllm.frontend.models import ModelRegistry, ServedModel

__all__ = ["Capabilities", "check_capabilities", "combine"]

_NAMES = ("prompt_logprobs", "embeddings", "guided_decoding")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """A model's capabilities over its live workers: True, False, or None when not said (older cards)."""

    prompt_logprobs: bool | None = None
    embeddings: bool | None = None
    guided_decoding: bool | None = None


def combine(cards: Iterable[discovery_pb2.ModelCard]) -> Capabilities:
    """The capabilities every card's worker shares (see the module docstring)."""
    said = [c.capabilities if c.HasField("capabilities") else None for c in cards]
    values: dict[str, bool | None] = {}
    for name in _NAMES:
        each = [None if c is None else bool(getattr(c, name)) for c in said]
        values[name] = False if False in each else None if (None in each or not each) else True
    return Capabilities(**values)


def _wants_embeddings(req: TextRequest) -> bool:
    from meshllm.frontend.embeddings_api import EmbeddingsRequest  # imports the core, which imports this module

    return isinstance(req, EmbeddingsRequest)


async def check_capabilities(req: TextRequest, model: ServedModel, registry: ModelRegistry) -> None:
    """InvalidArgument when `req` needs something an engine serving `model` cannot do."""
    from meshllm.frontend.preprocess import prompt_logprobs_asked  # preprocess imports models, which imports this

    caps = model.capabilities
    forced = req.tool_choice == "required" or req.tool_choice.startswith("function:")
    if forced and caps.guided_decoding is False:
        engines = sorted(e for e in await registry.engines(model.name) if e) or ["engine"]
        raise unguided(model.name, engines, req.tool_choice)
    if forced and caps.guided_decoding is None:
        check_guided_engines(model.name, await registry.engines(model.name), req.tool_choice)
    if caps.prompt_logprobs is False and prompt_logprobs_asked(req) is not None:
        raise InvalidArgument(
            f"the engine serving model {model.name!r} does not compute prompt logprobs "
            "(asked for by 'prompt_logprobs', or by 'echo' with 'logprobs'); llamacpp does",
            param="prompt_logprobs",
        )
    if caps.embeddings is False and _wants_embeddings(req):
        raise InvalidArgument(
            f"the engine serving model {model.name!r} does not compute embeddings (llamacpp does)", param="model"
        )

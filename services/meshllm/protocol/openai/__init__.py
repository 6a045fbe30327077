"""OpenAI's chat/completions schema: request parsing and validation, response shaping (pure, no I/O).

parse_chat(body) / parse_completion(body)  JSON object → TextRequest, or InvalidArgument naming the field  (request.py)
chat_chunk / completion_chunk / chat_response / completion_response / usage_body / model_list
                                           internal values → OpenAI-shaped dicts                     (objects.py)
parse_json_body, field strictness, tool_choice, structured_outputs     (extensions.py)
chat_body_of / response_object / output items: the Responses API      (responses_schema.py)
"""

from __future__ import annotations

from meshllm.protocol.openai import objects
from meshllm.protocol.openai.extensions import parse_json_body
from meshllm.protocol.openai.objects import *  # noqa: F403 - every response shaper, as objects.__all__ lists them
from meshllm.protocol.openai.request import (
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    RequestKind,
    TextRequest,
    parse_chat,
    parse_completion,
)

__all__ = [
    "MAX_N",
    "MAX_STOP_STRINGS",
    "MAX_TOP_LOGPROBS",
    "RequestKind",
    "TextRequest",
    "parse_chat",
    "parse_completion",
    "parse_json_body",
]
__all__ += objects.__all__

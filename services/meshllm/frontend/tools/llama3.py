"""Llama 3.1 / 3.2 JSON tool calls: `{"name": ..., "parameters": {...}}` opening the output, or after `<|python_tag|>`.

Published example (Meta's Llama 3.1 model card, "JSON based tool calling"):

    {"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}

Several calls are separated by ";" (as vLLM's llama3_json parser accepts).
`<|python_tag|>` is a special token, dropped from the text unless special
tokens are kept: a JSON object opening the output is a call either way.
"""

from __future__ import annotations

from meshllm.frontend.tools.marker import MarkerParser

__all__ = ["Llama3JsonParser"]


class Llama3JsonParser(MarkerParser):
    markers = ("<|python_tag|>",)
    opening = "{"

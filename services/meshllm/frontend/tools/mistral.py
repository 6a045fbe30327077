"""Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

Published example (mistral-common, Mistral 7B Instruct v0.3):

    [TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]

`[TOOL_CALLS]` is a special token, dropped from the text unless special tokens
are kept: a JSON array opening the output is read as the calls either way.
"""

from __future__ import annotations

from meshllm.frontend.tools.marker import MarkerParser

__all__ = ["MistralParser"]


class MistralParser(MarkerParser):
    markers = ("[TOOL_CALLS]",)
    opening = "["

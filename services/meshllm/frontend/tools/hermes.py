"""Hermes / Qwen 2.5+ tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.

Published example (NousResearch Hermes-Function-Calling, Qwen2.5 docs):

    <tool_call>
    {"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}
    </tool_call>
"""

from __future__ import annotations

from meshllm.frontend.tools.marker import MarkerParser

__all__ = ["HermesParser"]


class HermesParser(MarkerParser):
    markers = ("<tool_call>",)
    end_marker = "</tool_call>"

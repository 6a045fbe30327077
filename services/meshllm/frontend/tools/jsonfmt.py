"""The plain-JSON fallback: an output that is a call object or an array of them.

    {"name": "f", "arguments": {"a": 1}}
    [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "parameters": {}}]

Also the format of `tool_choice: "required"`, whose output the frontend
constrains to such an array (`meshllm.frontend.tools.forced`).
"""

from __future__ import annotations

from meshllm.frontend.tools.marker import MarkerParser

__all__ = ["JsonParser"]


class JsonParser(MarkerParser):
    opening = "{["

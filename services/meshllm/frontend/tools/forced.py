"""`tool_choice` "required" and named functions: the JSON schema that forces a call, and the parsers of the output.

As vLLM does it: a named function constrains the output to that function's
`parameters` schema, and the whole output is its arguments; "required"
constrains the output to a non-empty JSON array of `{"name", "parameters"}`
objects, one of the offered functions each, parsed by the plain-JSON parser.
The engine enforces the schema with guided decoding (llama.cpp grammars,
TensorRT-LLM guided decoding); the frontend refuses the request where it cannot.
"""

from __future__ import annotations

from meshllm.frontend.tools.base import CallDelta, ToolParser, call_id
from meshllm.protocol.openai.extensions import named_schema, required_schema

__all__ = ["NamedParser", "named_schema", "required_schema"]


class NamedParser(ToolParser):
    """The whole output is the arguments of `name`: the call's first delta, then the text as it comes."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        out: list[CallDelta] = []
        if not self._started:
            self._started = True
            out.append(CallDelta(0, call_id(), self._name))
        if text:
            out.append(CallDelta(0, arguments=text))
        return "", out

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self.feed("") if not self._started else ("", [])

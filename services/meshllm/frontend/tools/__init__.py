"""Tool-call parsers: a model's tool-call markup → OpenAI `tool_calls`, streamed or whole.

    parser = new_tool_parser("hermes")      # one per choice
    content, deltas = parser.feed(text)     # as the text streams
    content, deltas = parser.finish()       # at the end
    parse_all(new_tool_parser("hermes"), text)  # non-streaming: ParsedCalls

Formats (`--tool-call-parser`): hermes (also Qwen 2.5/3), llama3_json,
mistral, pythonic, json (the plain-JSON fallback). `detect_tool_parser`
picks one from a chat template's text when it is recognisable.
"""

from __future__ import annotations

from collections.abc import Callable

from meshllm.frontend.tools.base import CallDelta, ParsedCalls, ToolCall, ToolParser, finalize, merge_calls, parse_all
from meshllm.frontend.tools.forced import NamedParser, named_schema, required_schema
from meshllm.frontend.tools.hermes import HermesParser
from meshllm.frontend.tools.jsonfmt import JsonParser
from meshllm.frontend.tools.llama3 import Llama3JsonParser
from meshllm.frontend.tools.mistral import MistralParser
from meshllm.frontend.tools.pythonic import PythonicParser

__all__ = [
    "TOOL_PARSERS",
    "CallDelta",
    "NamedParser",
    "ParsedCalls",
    "ToolCall",
    "ToolParser",
    "detect_tool_parser",
    "finalize",
    "merge_calls",
    "named_schema",
    "new_tool_parser",
    "parse_all",
    "required_schema",
]

TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "json": JsonParser,
}


def new_tool_parser(name: str) -> ToolParser:
    """A fresh parser of format `name` (a key of TOOL_PARSERS)."""
    return TOOL_PARSERS[name]()


def detect_tool_parser(template: str | None) -> str | None:
    """The format a chat template's own tool instructions ask for, when recognisable."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template or "[AVAILABLE_TOOLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters": dictionary of argument name' in template:
        return "llama3_json"
    if "<|python_start|>" in template or "[func_name1(" in template:
        return "pythonic"
    return None

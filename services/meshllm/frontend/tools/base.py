"""The streaming machinery every tool-call format shares: text in, content and tool-call deltas out.

A `ToolParser` sees one choice's text piece by piece (`feed`), then `finish`.
Each call returns the content that is safe to show now and `CallDelta`s in
OpenAI's streaming order: the first delta of call `i` carries its `id` and
`function.name`, later ones append to `function.arguments`. Splitting the
text differently never changes the concatenated result — the non-streaming
response is the same machine fed the whole text at once (`parse_all`).

`MarkerParser` (marker.py) is the common case: calls start at a marker (`<tool_call>`,
`[TOOL_CALLS]`, ...) or, for formats that are "the whole output is JSON", at
a `{` / `[` opening the output. Bytes that could still grow into a marker,
and whitespace next to a call, are held back; whitespace that only separates
content from calls is dropped. A call object's arguments stream as the
model writes them (the raw JSON text of the value) once its name is known;
objects whose arguments come before the name, or arguments given as a JSON
string, are emitted whole when the object closes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CallDelta",
    "ParsedCalls",
    "ToolCall",
    "ToolParser",
    "call_id",
    "finalize",
    "merge_calls",
    "parse_all",
]


def call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class CallDelta:
    """A piece of tool call `index`: the first carries id and name, the rest arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def openai(self) -> dict[str, Any]:
        """The `delta.tool_calls[]` item OpenAI streams."""
        fn: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            fn["name"] = self.name
        out["function"] = fn
        return out


@dataclass(slots=True)
class ToolCall:
    """A finished tool call of a non-streaming message."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ParsedCalls:
    """A whole output split into content (None when empty) and tool calls."""

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser:
    """One choice's streaming tool-call parser (see the module docstring)."""

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[CallDelta]]:
        raise NotImplementedError


def merge_calls(deltas: Sequence[CallDelta]) -> list[ToolCall]:
    """Streamed deltas → whole calls, by index."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        c = calls.get(d.index)
        if c is None:
            c = calls[d.index] = ToolCall(d.id or call_id(), d.name or "", "")
        if d.name:
            c.name = d.name
        c.arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def parse_all(parser: ToolParser, text: str) -> ParsedCalls:
    """The non-streaming result: the whole text through the streaming parser (see `finalize`)."""
    content, deltas = parser.feed(text)
    more, tail = parser.finish()
    return finalize(content + more, [*deltas, *tail], text)


def finalize(content: str, deltas: Sequence[CallDelta], text: str) -> ParsedCalls:
    """Whole calls from a parser's output; `text` is what it was fed.

    Calls whose arguments are not valid JSON (a truncated output, a model
    that strayed from its format) make the whole text content, as vLLM does.
    """
    calls = merge_calls(deltas)
    for c in calls:
        try:
            json.loads(c.arguments)
        except ValueError:
            return ParsedCalls(text or None, [])
        if not c.name:
            return ParsedCalls(text or None, [])
    return ParsedCalls(content or None, calls)

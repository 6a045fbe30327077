"""Which reasoning and tool-call parsers a request's output goes through, and the per-choice pipeline.

Choice of format, per model: the frontend's flag (`--tool-call-parser`,
`--reasoning-parser`: one NAME for every model, or `MODEL=NAME,...`; "auto"
= what follows, "none" = off), else the name the worker's ModelCard
publishes, else what the chat template shows (`detect_tool_parser`,
`detect_reasoning_parser`).

Per request: tool calls are parsed when the request offers `tools` and
`tool_choice` is not "none"; a named function or "required" use their own
parsers (the output is constrained to JSON, `meshllm.frontend.tools.forced`).
Reasoning is split unless the output is constrained (guided decoding: the
JSON has no `<think>`). Text goes reasoning parser → tool parser.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshllm.config import ConfigError
from meshllm.errors import InvalidArgument
from meshllm.frontend.text.reasoning import REASONING_PARSERS, ReasoningParser, detect_reasoning_parser
from meshllm.frontend.tools import (
    TOOL_PARSERS,
    CallDelta,
    NamedParser,
    ParsedCalls,
    ToolParser,
    detect_tool_parser,
    finalize,
    new_tool_parser,
)
from meshllm.frontend.tools.jsonfmt import JsonParser

if TYPE_CHECKING:
    from meshllm.frontend.text.chat_template import ChatTemplate
    from meshllm.protocol.openai import TextRequest
    from meshllm.v1.discovery_pb2 import ModelCard

__all__ = ["GUIDED_ENGINES", "OutputParser", "Parsed", "ParserChoice", "check_guided_engines", "parse_parser_flag", "unguided"]

#: Engines that enforce guided decoding (the constraint `tool_choice` "required" / named needs), by name: the
#: check for workers whose ModelCard predates `capabilities` (frontend/openai/capabilities.py decides for the others).
#: Instances that name no engine (static mode) are given the benefit of the doubt.
GUIDED_ENGINES = frozenset({"llamacpp", "trtllm"})


def check_guided_engines(model: str, engines: set[str], tool_choice: str) -> None:
    """InvalidArgument when a worker of `model` runs an engine that cannot force a tool call."""
    cannot = sorted(e for e in engines if e and e not in GUIDED_ENGINES)
    if cannot:
        raise unguided(model, cannot, tool_choice)


def unguided(model: str, engines: list[str], tool_choice: str) -> InvalidArgument:
    """The 400 for a forced `tool_choice` on `engines` (names) that do not enforce guided decoding."""
    what = "'required'" if tool_choice == "required" else "a named function"
    return InvalidArgument(
        f"'tool_choice': {what} needs guided decoding, which the {', '.join(engines)} engine serving {model!r} "
        f"does not enforce (engines that do: {', '.join(sorted(GUIDED_ENGINES))}); use 'auto'",
        param="tool_choice",
    )


def parse_parser_flag(value: str, known: tuple[str, ...] | Mapping[str, object], flag: str) -> dict[str, str]:
    """'NAME' or 'MODEL=NAME,...' → {model or "*": name}; a one-line ConfigError for an unknown name."""
    names = (*known, "auto", "none")
    out: dict[str, str] = {}
    for item in (p.strip() for p in value.split(",")):
        if not item:
            continue
        model, _, name = item.rpartition("=")
        if name not in names:
            raise ConfigError(f"{flag} {name!r}: choose from {', '.join(names)} (or MODEL=NAME,...)")
        out[model or "*"] = name
    return out


@dataclass(frozen=True, slots=True)
class ParserChoice:
    """The frontend's parser flags, resolved per model (see the module docstring)."""

    tool: dict[str, str] = field(default_factory=dict)
    reasoning: dict[str, str] = field(default_factory=dict)
    _detected: dict[str, str | None] = field(default_factory=dict)  # reasoning parser by template source

    def factory(
        self, req: TextRequest, model: str, card: ModelCard, template: ChatTemplate | None
    ) -> Callable[[], OutputParser | None] | None:
        """What builds each choice's OutputParser for `req` (None: the text passes through)."""
        if req.kind != "chat":
            return None
        source = template.source if template is not None else None
        tool_format = self.tool_parser(model, card.tool_call_parser, source) if req.tools else None
        reasoning = None
        if "guided" not in req.sampling:  # constrained output (JSON, a regex) has no <think> block

            def detect() -> str | None:
                if source is None or template is None:
                    return None
                if source not in self._detected:
                    render = lambda: template.render([{"role": "user", "content": "x"}])  # noqa: E731
                    self._detected[source] = detected_reasoning(source, render)
                return self._detected[source]

            reasoning = self.reasoning_parser(model, card.reasoning_parser, detect)
        if reasoning is None and req.tool_choice == "none":
            return None
        if reasoning is None and req.tool_choice == "auto" and tool_format is None:
            return None
        return lambda: OutputParser.build(
            reasoning=reasoning, tool_format=tool_format, tool_choice=req.tool_choice, parallel=req.parallel_tool_calls
        )

    def tool_parser(self, model: str, card_value: str, template: str | None) -> str | None:
        name = self.tool.get(model, self.tool.get("*", "auto"))
        if name == "auto":
            name = card_value if card_value in TOOL_PARSERS else (detect_tool_parser(template) or "none")
        return None if name == "none" else name

    def reasoning_parser(self, model: str, card_value: str, detect: Callable[[], str | None]) -> str | None:
        name = self.reasoning.get(model, self.reasoning.get("*", "auto"))
        if name == "auto":
            name = card_value if card_value in REASONING_PARSERS else (detect() or "none")
        return None if name == "none" else name


def detected_reasoning(template_source: str | None, render: Callable[[], str]) -> str | None:
    """`detect_reasoning_parser` with the template's generation prompt rendered only when it mentions <think>."""
    if not template_source or "<think>" not in template_source:
        return None
    try:
        prompt = render()
    except Exception:  # a template that needs more than one user message: fall back to the plain check
        prompt = None
    return detect_reasoning_parser(template_source, prompt)


@dataclass(slots=True)
class Parsed:
    """One step of a choice's parsed output."""

    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class OutputParser:
    """One choice's text → content, reasoning and tool-call deltas (streaming-safe)."""

    __slots__ = ("_calls", "_reasoning", "_single", "_tool_text", "_tools", "called")

    def __init__(self, reasoning: str | None, tools: ToolParser | None, *, parallel: bool = True) -> None:
        self._reasoning = ReasoningParser(reasoning) if reasoning else None
        self._tools = tools
        self._single = not parallel
        self._tool_text: list[str] = []  # what the tool parser saw: the content when its calls are invalid
        self._calls: list[CallDelta] = []
        self.called = False

    @classmethod
    def build(
        cls, *, reasoning: str | None, tool_format: str | None, tool_choice: str, parallel: bool = True
    ) -> OutputParser | None:
        """The parser of one choice, or None when the text passes through untouched."""
        tools: ToolParser | None = None
        if tool_choice == "required":
            tools = JsonParser()
        elif tool_choice.startswith("function:"):
            tools = NamedParser(tool_choice.removeprefix("function:"))
        elif tool_choice == "auto" and tool_format is not None:
            tools = new_tool_parser(tool_format)
        if tools is None and reasoning is None:
            return None
        return cls(reasoning, tools, parallel=parallel)

    @property
    def reasons(self) -> bool:
        """A reasoning parser is on: the message carries `reasoning_content` (null when there was none)."""
        return self._reasoning is not None

    def feed(self, text: str) -> Parsed:
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._tool_step(reasoning, content, finish=False)

    def finish(self) -> Parsed:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._tool_step(reasoning, content, finish=True)

    def _tool_step(self, reasoning: str, content: str, *, finish: bool) -> Parsed:
        if self._tools is None:
            return Parsed(content, reasoning)
        if content:
            self._tool_text.append(content)
        out, calls = self._tools.feed(content) if content else ("", [])
        if finish:
            more, tail = self._tools.finish()
            out, calls = out + more, [*calls, *tail]
        if self._single:
            calls = [c for c in calls if c.index == 0]
        if calls:
            self.called = True
            self._calls.extend(calls)
        return Parsed(out, reasoning, calls)

    def whole(self, content: str) -> ParsedCalls:
        """The non-streaming message: `content` is the concatenated content of every step."""
        if self._tools is None:
            return ParsedCalls(content or None, [])
        return finalize(content, self._calls, "".join(self._tool_text))

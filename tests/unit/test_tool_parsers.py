"""Tool-call parsers on each format's published examples; streaming split at every boundary equals the whole."""

from __future__ import annotations

import json

import pytest

from meshllm.frontend.tools import (
    TOOL_PARSERS,
    CallDelta,
    NamedParser,
    detect_tool_parser,
    merge_calls,
    new_tool_parser,
    parse_all,
    required_schema,
)

HERMES = '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n</tool_call>'
HERMES_TWO = (
    "Let me check both.\n<tool_call>\n"
    '{"name": "get_current_temperature", "arguments": {"location": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_temperature_date", "arguments": {"location": "Paris", "date": "2024-10-01"}}\n'
    "</tool_call>"
)
LLAMA3 = '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}'
LLAMA3_TAG = '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": "é"}}'
MISTRAL = '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]'
PYTHONIC = "[get_weather(city='San Francisco', metric='celsius'), get_weather(city='Seattle', metric='celsius')]"

# (format, output, expected content, expected [(name, arguments as JSON value)])
CASES = [
    ("hermes", HERMES, None, [("get_current_temperature", {"location": "San Francisco, CA, USA"})]),
    (
        "hermes",
        HERMES_TWO,
        "Let me check both.",
        [
            ("get_current_temperature", {"location": "Paris", "unit": "celsius"}),
            ("get_temperature_date", {"location": "Paris", "date": "2024-10-01"}),
        ],
    ),
    ("hermes", "The answer is 4 <tool_ < 5.", "The answer is 4 <tool_ < 5.", []),
    (
        "hermes",
        '<tool_call>{"arguments": {"a": [1, {"b": "}"}]}, "name": "late"}</tool_call> ok',
        "ok",
        [("late", {"a": [1, {"b": "}"}]})],
    ),
    ("hermes", '<tool_call>{"name": "s", "arguments": "{\\"q\\": 1}"}</tool_call>', None, [("s", {"q": 1})]),
    ("llama3_json", LLAMA3, None, [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
    ("llama3_json", LLAMA3_TAG, None, [("f", {"x": 1}), ("g", {"y": "é"})]),
    ("llama3_json", "Paris is sunny {not json}", "Paris is sunny {not json}", []),
    ("mistral", MISTRAL, None, [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
    (
        "mistral",
        '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": null}}]',
        None,
        [("a", {}), ("b", {"k": None})],
    ),
    (
        "pythonic",
        PYTHONIC,
        None,
        [
            ("get_weather", {"city": "San Francisco", "metric": "celsius"}),
            ("get_weather", {"city": "Seattle", "metric": "celsius"}),
        ],
    ),
    ("pythonic", "<|python_start|>[f(a=1, b=[True, None])]<|python_end|>", None, [("f", {"a": 1, "b": [True, None]})]),
    ("pythonic", "[1, 2] is a list", "[1, 2] is a list", []),
    ("json", '  {"name": "f", "arguments": {"a": "x"}}', None, [("f", {"a": "x"})]),
    ("json", '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', None, [("f", {"a": 1}), ("g", {})]),
    ("json", '{"answer": 42}', '{"answer": 42}', []),
    ("json", "plain text, no call", "plain text, no call", []),
]


def _stream(fmt: str, pieces: list[str]) -> tuple[str, list[CallDelta]]:
    parser = new_tool_parser(fmt)
    content, deltas = [], []
    for p in pieces:
        c, d = parser.feed(p)
        content.append(c)
        deltas.extend(d)
    c, d = parser.finish()
    return "".join(content) + c, [*deltas, *d]


def _calls(deltas: list[CallDelta]) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in merge_calls(deltas)]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_whole_output(fmt: str, text: str, content: str | None, calls: list[tuple[str, object]]) -> None:
    parsed = parse_all(new_tool_parser(fmt), text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert all(c.id.startswith("call_") for c in parsed.calls)
    assert len({c.id for c in parsed.calls}) == len(parsed.calls)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_every_split_equals_whole(fmt: str, text: str, content: str | None, calls: list[tuple[str, object]]) -> None:
    whole_content, whole_deltas = _stream(fmt, [text])
    for cut in range(len(text) + 1):
        got_content, deltas = _stream(fmt, [text[:cut], text[cut:]])
        assert got_content == whole_content, cut
        assert [(c.name, c.arguments) for c in merge_calls(deltas)] == [
            (c.name, c.arguments) for c in merge_calls(whole_deltas)
        ], cut
    one_by_one_content, deltas = _stream(fmt, list(text))
    assert one_by_one_content == whole_content
    assert _calls(deltas) == calls


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "json"])
def test_first_delta_names_the_call_then_arguments_grow(fmt: str) -> None:
    text = {"hermes": HERMES, "llama3_json": LLAMA3, "mistral": MISTRAL, "json": LLAMA3}[fmt]
    _, deltas = _stream(fmt, list(text))
    first = deltas[0]
    assert first.id is not None and first.id.startswith("call_") and first.name and first.arguments == ""
    rest = deltas[1:]
    assert len(rest) > 5, "arguments stream piece by piece"
    assert all(d.id is None and d.name is None for d in rest)
    assert first.openai()["type"] == "function" and "type" not in rest[0].openai()


def test_marker_prefix_is_held_back_only_while_it_can_grow() -> None:
    parser = new_tool_parser("hermes")
    assert parser.feed("Hi <tool") == ("Hi", [])  # "<tool" (and the space before it) may start a call
    assert parser.feed("box>") == (" <toolbox>", [])


def test_truncated_call_is_content_in_the_whole_response() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": '
    parsed = parse_all(new_tool_parser("hermes"), text)
    assert parsed.calls == [] and parsed.content == text


def test_named_choice_streams_the_output_as_arguments() -> None:
    parser = NamedParser("get_weather")
    _, d1 = parser.feed('{"city": ')
    _, d2 = parser.feed('"Paris"}')
    calls = merge_calls([*d1, *d2, *parser.finish()[1]])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert d1[0].name == "get_weather" and d1[0].arguments == ""


def test_required_schema_lists_each_function() -> None:
    tools = [
        {
            "type": "function",
            "function": {"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        },
        {"type": "function", "function": {"name": "b"}},
    ]
    schema = json.loads(required_schema(tools))
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]]
    assert names == [["a"], ["b"]]


def test_detect_from_template() -> None:
    assert detect_tool_parser("{% if tools %}<tool_call>{{ tools }}</tool_call>{% endif %}") == "hermes"
    assert detect_tool_parser("{% if tools %}[AVAILABLE_TOOLS]{% endif %}") == "mistral"
    assert detect_tool_parser("{{ messages }}") is None
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "mistral", "pythonic", "json"}

"""Request extensions: 64-bit JSON integers, field strictness, tool_choice, structured_outputs, schema checks, parser flags."""

from __future__ import annotations

import json
from typing import Any

import pytest

from meshllm.config import ConfigError
from meshllm.errors import InvalidArgument
from meshllm.frontend.config import FrontendConfig
from meshllm.frontend.text.output_parsers import OutputParser, ParserChoice, check_guided_engines, parse_parser_flag
from meshllm.protocol.openai import parse_chat, parse_completion, parse_json_body
from meshllm.protocol.openai.extensions import check_schema

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"seed": 18446744073709551616}', "seed"),
        (b'{"seed": -9223372036854775809}', "seed"),
        (b'{"a": [1, {"b": 100000000000000000000000}]}', "a[1].b"),
        (b"123456789012345678901234567890", None),
    ],
)
def test_integers_beyond_64_bits_are_refused_with_their_place(raw: bytes, param: str | None) -> None:
    with pytest.raises(InvalidArgument, match="does not fit in 64 bits") as exc:
        parse_json_body(raw)
    assert exc.value.param == param


def test_64_bit_edges_and_long_digit_strings_pass() -> None:
    assert parse_json_body(b'{"a": 18446744073709551615, "b": -9223372036854775808}') == {
        "a": 18446744073709551615,
        "b": -9223372036854775808,
    }
    assert parse_json_body(b'{"s": "12345678901234567890123", "f": 1.5e300}') == {"s": "12345678901234567890123", "f": 1.5e300}
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        parse_json_body(b"{")


def test_ignored_fields_are_listed_and_strict_refuses_unknown_ones() -> None:
    assert parse_chat(chat(user="u", zeta=1, alpha=2)).ignored == ("alpha", "user", "zeta")
    assert parse_completion({"model": "m", "prompt": "p", "suffix": "s"}).ignored == ("suffix",)
    assert parse_chat(chat(user="u"), strict=True).ignored == ("user",)
    with pytest.raises(InvalidArgument, match=r"^Unrecognized request argument supplied: zeta$") as exc:
        parse_chat(chat(zeta=1), strict=True)
    assert exc.value.param == "zeta"
    with pytest.raises(InvalidArgument, match="supplied: messages"):
        parse_completion({"model": "m", "prompt": "p", "messages": []}, strict=True)


def test_tool_choice_values() -> None:
    assert parse_chat(chat()).tool_choice == "none"
    assert parse_chat(chat(tools=TOOLS)).tool_choice == "auto"
    assert parse_chat(chat(tools=TOOLS, tool_choice="none")).tool_choice == "none"
    req = parse_chat(chat(tools=TOOLS, tool_choice="required"))
    schema = json.loads(req.sampling["guided"]["json_schema"])
    assert req.tool_choice == "required" and schema["minItems"] == 1
    req = parse_chat(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}}))
    assert req.tool_choice == "function:f" and json.loads(req.sampling["guided"]["json_schema"]) == {"type": "object"}
    for bad, needle in [
        ({"tool_choice": "required"}, "needs 'tools'"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "expected 'none'"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "cannot be combined"),
    ]:
        with pytest.raises(InvalidArgument, match=needle):
            parse_chat(chat(**bad))


def test_structured_outputs_map_to_guided() -> None:
    assert parse_chat(chat(structured_outputs={"regex": "[ab]+"})).sampling["guided"] == {"regex": "[ab]+"}
    assert parse_chat(chat(structured_outputs={"json": {"type": "object"}})).sampling["guided"] == {
        "json_schema": '{"type":"object"}'
    }
    assert parse_chat(chat(structured_outputs={"json_object": True})).sampling["guided"] == {"json_object": True}
    with pytest.raises(InvalidArgument, match="at most one output constraint"):
        parse_chat(chat(structured_outputs={"regex": "a"}, guided_regex="b"))


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ("[1", "not valid JSON"),
        ("5", "must be an object or a boolean at schema"),
        ('{"type": ["string", "strin"]}', "'type' must be one of"),
        ('{"properties": []}', "'properties' must be an object of schemas at schema"),
        ('{"items": [{"type": "x"}]}', "at schema.items[0]"),
        ('{"anyOf": [true, {"enum": 1}]}', "'enum' must be an array at schema.anyOf[1]"),
        ('{"$defs": {"a": {"$ref": 1}}}', "'$ref' must be a string at schema.$defs.a"),
        ('{"properties": {"a": {"$ref": "http://x/y"}}}', "only local references ('#/...') are supported"),
        ('{"properties": {"a": {"$ref": "#/$defs/b"}}}', "'#/$defs/b' at schema.properties.a points at nothing"),
    ],
)
def test_malformed_schemas(schema: str, needle: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        check_schema(schema, "guided_json")
    assert needle in exc.value.message and exc.value.param == "guided_json"


def test_sane_schema_passes() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": ["string", "null"]}, "b": {"items": {"$ref": "#/$defs/n"}}},
        "$defs": {"n": {"type": "integer"}},
    }
    assert check_schema(json.dumps(schema), "x") == json.dumps(schema)


def test_continuous_usage_needs_include_usage() -> None:
    req = parse_chat(chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert req.continuous_usage
    with pytest.raises(InvalidArgument, match="needs 'include_usage'"):
        parse_chat(chat(stream=True, stream_options={"continuous_usage_stats": True}))


def test_parser_flags() -> None:
    assert parse_parser_flag("hermes", ("hermes",), "--x") == {"*": "hermes"}
    assert parse_parser_flag("a=hermes, org/b=none", ("hermes",), "--x") == {"a": "hermes", "org/b": "none"}
    with pytest.raises(ConfigError, match="--tool-call-parser 'nope': choose from"):
        FrontendConfig(tool_call_parser="nope")
    choice = FrontendConfig(tool_call_parser="m=mistral", reasoning_parser="deepseek_r1").parsers
    assert choice.tool_parser("m", "", None) == "mistral"
    assert choice.tool_parser("other", "llama3_json", None) == "llama3_json"  # auto: the card's
    assert choice.tool_parser("other", "", "{% if tools %}<tool_call>{% endif %}") == "hermes"  # auto: the template
    assert choice.reasoning_parser("any", "", lambda: None) == "deepseek_r1"
    assert ParserChoice().reasoning_parser("any", "qwen3", lambda: None) == "qwen3"


def test_output_parser_for_each_tool_choice() -> None:
    assert OutputParser.build(reasoning=None, tool_format=None, tool_choice="auto") is None
    named = OutputParser.build(reasoning=None, tool_format=None, tool_choice="function:f")
    assert named is not None
    step = named.feed('{"a": 1}')
    assert step.calls[0].name == "f" and named.whole("").calls[0].arguments == '{"a": 1}'


def test_guided_engines() -> None:
    check_guided_engines("m", {"llamacpp", ""}, "required")
    with pytest.raises(InvalidArgument, match="the mocker engine serving 'm' does not enforce"):
        check_guided_engines("m", {"llamacpp", "mocker"}, "required")

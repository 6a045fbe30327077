"""meshllm.protocol.openai: OpenAI bodies → TextRequest, bad values → InvalidArgument naming the field, response shapes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from meshllm.errors import InvalidArgument
from meshllm.protocol.openai import (
    ChoiceResult,
    LogprobEntry,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    finish_reason_openai,
    model_list,
    parse_chat,
    parse_completion,
    usage_body,
    usage_chunk,
)

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hi"}


def test_chat_fields_map_to_engine_options() -> None:
    """Locks: every sampling/stop field of the issue lands in SamplingSettings / StopSettings."""
    req = parse_chat(
        {
            **CHAT,
            "max_completion_tokens": 40,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": 0.05,
            "seed": -1,
            "n": 3,
            "stop": "END",
            "stop_token_ids": [7, 7, 9],
            "frequency_penalty": 0.5,
            "presence_penalty": -0.5,
            "repetition_penalty": 1.1,
            "logprobs": True,
            "top_logprobs": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "min_tokens": 5,
            "unknown_field": {"ignored": True},
        }
    )
    assert req.kind == "chat" and req.model == "m" and req.n == 3 and req.stream and req.include_usage
    assert req.max_tokens == 40 and req.stop == ("END",) and req.logprobs == 3
    assert req.sampling == {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "seed": (1 << 64) - 1,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.1,
    }
    assert req.stop_conditions == {"min_tokens": 5, "stop_token_ids": [7, 9], "ignore_eos": True}


def test_chat_content_parts_join_and_tool_messages_pass_through() -> None:
    req = parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ],
        }
    )
    assert req.messages[0] == {"role": "system", "content": "be brief"}
    assert req.messages[1]["tool_calls"] == [{"id": "c1", "type": "function"}]
    assert req.messages[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("abc", ("abc",)), (["a", "b"], ("a", "b")), ([1, 2, 3], ((1, 2, 3),)), ([[1], [2, 3]], ((1,), (2, 3)))],
)
def test_completion_prompt_forms(prompt: Any, expected: tuple[Any, ...]) -> None:
    assert parse_completion({"model": "m", "prompt": prompt}).prompts == expected


def test_response_format_becomes_guided_decoding() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_chat({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert orjson.loads(req.sampling["guided"]["json_schema"]) == schema
    assert parse_chat({**CHAT, "response_format": {"type": "json_object"}}).sampling["guided"] == {"json_object": True}
    assert "guided" not in parse_chat({**CHAT, "response_format": {"type": "text"}}).sampling
    assert parse_chat({**CHAT, "guided_choice": ["yes", "no"]}).sampling["guided"] == {"choice": ["yes", "no"]}


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("chat", {"messages": [{"role": "user", "content": "x"}]}, "model"),
    ("chat", {**CHAT, "model": ""}, "model"),
    ("chat", {**CHAT, "model": 5}, "model"),
    ("chat", {"model": "m", "messages": []}, "messages"),
    ("chat", {"model": "m", "messages": "hi"}, "messages"),
    ("chat", {"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("chat", {"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        "chat",
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0].type",
    ),
    ("chat", {"model": "m", "messages": ["hi"]}, "messages[0]"),
    ("chat", {**CHAT, "max_tokens": -1}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": "10"}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": True}, "max_tokens"),
    ("chat", {**CHAT, "max_completion_tokens": 1.5}, "max_completion_tokens"),
    ("chat", {**CHAT, "temperature": 5}, "temperature"),
    ("chat", {**CHAT, "temperature": -0.1}, "temperature"),
    ("chat", {**CHAT, "temperature": "hot"}, "temperature"),
    ("chat", {**CHAT, "top_p": 0}, "top_p"),
    ("chat", {**CHAT, "top_p": 1.5}, "top_p"),
    ("chat", {**CHAT, "top_k": -2}, "top_k"),
    ("chat", {**CHAT, "min_p": 2}, "min_p"),
    ("chat", {**CHAT, "frequency_penalty": 3}, "frequency_penalty"),
    ("chat", {**CHAT, "presence_penalty": -2.5}, "presence_penalty"),
    ("chat", {**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {**CHAT, "n": 0}, "n"),
    ("chat", {**CHAT, "n": 1000}, "n"),
    ("chat", {**CHAT, "stop": 5}, "stop"),
    ("chat", {**CHAT, "stop": [""]}, "stop"),
    ("chat", {**CHAT, "stop": ["a"] * 17}, "stop"),
    ("chat", {**CHAT, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("chat", {**CHAT, "logprobs": "yes"}, "logprobs"),
    ("chat", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat", {**CHAT, "stream": "yes"}, "stream"),
    ("chat", {**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("chat", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ("chat", {**CHAT, "min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ("chat", {**CHAT, "seed": "x"}, "seed"),
    ("chat", {**CHAT, "tools": "none"}, "tools"),
    ("chat", {**CHAT, "logit_bias": []}, "logit_bias"),
    ("chat", {**CHAT, "logit_bias": {"hello": 1}}, "logit_bias"),
    ("chat", {**CHAT, "logit_bias": {"-1": 1}}, "logit_bias"),
    ("chat", {**CHAT, "logit_bias": {"5": "up"}}, "logit_bias"),
    ("chat", {**CHAT, "logit_bias": {"5": 101}}, "logit_bias"),
    ("chat", {**CHAT, "logit_bias": {"5": float("nan")}}, "logit_bias"),
    ("chat", {**CHAT, "logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias"),
    ("completion", {**COMPLETION, "logit_bias": {"5": True}}, "logit_bias"),
    ("completion", {"model": "m"}, "prompt"),
    ("completion", {"model": "m", "prompt": []}, "prompt"),
    ("completion", {"model": "m", "prompt": [1, "a"]}, "prompt"),
    ("completion", {"model": "m", "prompt": [1, -5]}, "prompt"),
    ("completion", {**COMPLETION, "logprobs": 50}, "logprobs"),
    ("completion", {**COMPLETION, "echo": 1}, "echo"),
    ("completion", {"model": "m", "prompt": ["a"] * 65, "n": 2}, "n"),
]


@pytest.mark.parametrize(("kind", "body", "param"), BAD, ids=[f"{k}-{p}-{i}" for i, (k, _, p) in enumerate(BAD)])
def test_bad_values_name_their_field(kind: str, body: dict[str, Any], param: str) -> None:
    """Locks: each invalid value is an InvalidArgument whose param (and message) names the field."""
    parse = parse_chat if kind == "chat" else parse_completion
    with pytest.raises(InvalidArgument) as info:
        parse(body)
    assert info.value.param == param
    assert param in info.value.message


def test_logit_bias_maps_token_id_strings_to_numbers_for_the_engine() -> None:
    """Locks: OpenAI's {"id": bias} (ids as JSON keys) becomes sampling.logit_bias {int: float}; empty is absent."""
    req = parse_chat({**CHAT, "logit_bias": {"42": 100, " 7 ": -100, "9": 0.5}})
    assert req.sampling["logit_bias"] == {42: 100.0, 7: -100.0, 9: 0.5}
    assert "logit_bias" not in parse_completion({**COMPLETION, "logit_bias": {}}).sampling


@pytest.mark.parametrize("body", [[], "x", 5, None])
def test_a_body_that_is_not_an_object_is_rejected(body: Any) -> None:
    with pytest.raises(InvalidArgument):
        parse_chat(body)
    with pytest.raises(InvalidArgument):
        parse_completion(body)


def test_finish_reasons_map_to_openai() -> None:
    assert [finish_reason_openai(r) for r in ("eos", "stop", "length", "content_filter")] == [
        "stop",
        "stop",
        "length",
        "content_filter",
    ]
    assert finish_reason_openai(None) is None


def test_response_shapes_match_openai() -> None:
    """Locks: object names, choice fields, usage with prompt_tokens_details.cached_tokens, logprob layouts."""
    usage = usage_body(10, 5, 4)
    assert usage == {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    lp = [LogprobEntry("hé", -0.5, [("hé", -0.5), ("x", -2.0)])]
    chunk = chat_chunk("id", 1, "m", 0, content="hé", role=True, logprobs=lp, include_usage=True)
    assert chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": "hé"}
    entry = chunk["choices"][0]["logprobs"]["content"][0]
    assert entry["bytes"] == list("hé".encode()) and entry["top_logprobs"][1] == {
        "token": "x",
        "logprob": -2.0,
        "bytes": [120],
    }
    c = completion_chunk("id", 1, "m", 1, "ab", finish_reason="length", logprobs=lp, text_offset=3)
    assert c["object"] == "text_completion" and c["choices"][0]["logprobs"]["text_offset"] == [3]
    assert usage_chunk("id", 1, "m", "chat", usage)["choices"] == []
    full = chat_response("id", 1, "m", [ChoiceResult(0, "hi", "stop")], usage)
    assert full["object"] == "chat.completion" and full["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    comp = completion_response("id", 1, "m", [ChoiceResult(0, "hi", "length", lp)], usage)
    assert comp["choices"][0]["logprobs"]["tokens"] == ["hé"]
    assert model_list([("m", 7, 4096)])["data"][0] == {
        "id": "m",
        "object": "model",
        "created": 7,
        "owned_by": "meshllm",
        "max_model_len": 4096,
    }

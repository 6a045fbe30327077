"""Tool calls, reasoning, strictness and the vLLM extensions over HTTP, with a scripted (echo) engine.

One frontend (hermes tool parser, qwen3 reasoning parser) + one echo worker,
and a second frontend with --strict-params; memory planes, real gRPC and HTTP.
The echo engine answers with the text after "ECHO:" in the prompt, one byte
per token, so every marker and JSON value arrives split across many chunks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from frontend_support import Mesh, chat, content_of, request, start_mesh

pytestmark = pytest.mark.asyncio(loop_scope="module")

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TWO_CALLS = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    m = await start_mesh(workers=1, tool_call_parser="hermes", reasoning_parser="qwen3")
    yield m
    await m.aclose()


def streamed_calls(events: list[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(every tool_calls delta item in order, the calls they add up to)."""
    items: list[dict[str, Any]] = []
    calls: dict[int, dict[str, Any]] = {}
    for e in events:
        if not isinstance(e, dict):
            continue
        for item in e["choices"][0]["delta"].get("tool_calls") or ():
            items.append(item)
            call = calls.setdefault(item["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = item.get("id") or call["id"]
            call["name"] = item["function"].get("name") or call["name"]
            call["arguments"] += item["function"].get("arguments", "")
    return items, [calls[i] for i in sorted(calls)]


async def test_tool_calls_in_the_message(mesh: Mesh) -> None:
    """Locks: message.tool_calls with call_ ids, content null, finish_reason tool_calls, parallel calls kept."""
    r = await request(mesh.url, "/v1/chat/completions", chat(f"ECHO:{TWO_CALLS}", tools=TOOLS))
    assert r.status == 200, r.body
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] is None
    calls = msg["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert "x-meshllm-ignored-params" not in r.headers


async def test_streamed_tool_calls_add_up_to_the_message(mesh: Mesh) -> None:
    """Locks: text before the call streams as content; id+name first, arguments growing; finish tool_calls."""
    text = "Checking." + TWO_CALLS
    whole = (await request(mesh.url, "/v1/chat/completions", chat(f"ECHO:{text}", tools=TOOLS))).json()
    r = await request(mesh.url, "/v1/chat/completions", chat(f"ECHO:{text}", tools=TOOLS, stream=True))
    events = r.events()
    assert events[-1] == "[DONE]"
    items, calls = streamed_calls(events)
    assert content_of(events) == "Checking." == whole["choices"][0]["message"]["content"]
    assert items[0]["id"].startswith("call_") and items[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert all("name" not in i["function"] and "id" not in i for i in items[1:] if i["index"] == 0)
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["choices"][0]["message"]["tool_calls"]]
    assert [(c["name"], c["arguments"]) for c in calls] == expected
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes[-1] == "tool_calls" and all(f is None for f in finishes[:-1])


async def test_tool_choice_none_and_no_tools_leave_the_text_alone(mesh: Mesh) -> None:
    for extra in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        r = await request(mesh.url, "/v1/chat/completions", chat(f"ECHO:{CALL}", **extra))
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == CALL and "tool_calls" not in choice["message"]
        assert choice["finish_reason"] == "stop"


async def test_parallel_tool_calls_false_keeps_the_first(mesh: Mesh) -> None:
    r = await request(mesh.url, "/v1/chat/completions", chat(f"ECHO:{TWO_CALLS}", tools=TOOLS, parallel_tool_calls=False))
    assert [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
async def test_forced_tool_choice_is_refused_where_the_engine_cannot_enforce_it(mesh: Mesh, choice: Any) -> None:
    r = await request(mesh.url, "/v1/chat/completions", chat("ECHO:x", tools=TOOLS, tool_choice=choice))
    err = r.json()["error"]
    assert r.status == 400 and err["param"] == "tool_choice" and "guided decoding" in err["message"]
    assert "echo" in err["message"] and "llamacpp" in err["message"]


async def test_tool_choice_naming_an_unknown_function_is_a_400(mesh: Mesh) -> None:
    body = chat("ECHO:x", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    r = await request(mesh.url, "/v1/chat/completions", body)
    assert r.status == 400 and "'nope' is not among 'tools'" in r.json()["error"]["message"]


async def test_reasoning_content_split_at_the_tags(mesh: Mesh) -> None:
    """Locks: <think> text → reasoning_content (message and deltas), the tags never reach the client."""
    text = "<think>The user wants 2+2.</think>\n\nIt is 4."
    msg = (await request(mesh.url, "/v1/chat/completions", chat(f"ECHO:{text}"))).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "The user wants 2+2." and msg["content"] == "It is 4."
    events = (await request(mesh.url, "/v1/chat/completions", chat(f"ECHO:{text}", stream=True))).events()
    reasoning = "".join(e["choices"][0]["delta"].get("reasoning_content", "") for e in events[:-1])
    assert reasoning == "The user wants 2+2." and content_of(events) == "It is 4."
    plain = (await request(mesh.url, "/v1/chat/completions", chat("ECHO:no thinking"))).json()["choices"][0]["message"]
    assert plain["reasoning_content"] is None and plain["content"] == "no thinking"


async def test_reasoning_then_tool_call(mesh: Mesh) -> None:
    text = f"<think>need weather</think>{CALL}"
    msg = (await request(mesh.url, "/v1/chat/completions", chat(f"ECHO:{text}", tools=TOOLS))).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "need weather" and msg["tool_calls"][0]["function"]["name"] == "get_weather"


async def test_ignored_fields_are_named_in_a_header(mesh: Mesh) -> None:
    r = await request(mesh.url, "/v1/chat/completions", chat("ECHO:hi", user="u1", frobnicate=1))
    assert r.status == 200 and r.headers["x-meshllm-ignored-params"] == "frobnicate,user"
    r = await request(mesh.url, "/v1/completions", {"model": "echo", "prompt": "ECHO:hi", "stream": True, "best_of": 1})
    assert r.status == 200 and r.headers["x-meshllm-ignored-params"] == "best_of"


async def test_strict_params_refuse_unknown_fields_like_openai() -> None:
    m = await start_mesh(workers=1, strict_params=True)
    try:
        r = await request(m.url, "/v1/chat/completions", chat("ECHO:hi", frobnicate=1))
        assert r.status == 400
        assert r.json()["error"] == {
            "message": "Unrecognized request argument supplied: frobnicate",
            "type": "invalid_request_error",
            "param": "frobnicate",
            "code": "InvalidArgument",
        }
        ok = await request(m.url, "/v1/chat/completions", chat("ECHO:hi", user="known-but-ignored"))
        assert ok.status == 200 and ok.headers["x-meshllm-ignored-params"] == "user"
    finally:
        await m.aclose()


async def test_integers_beyond_64_bits_are_a_400(mesh: Mesh) -> None:
    for seed in (b"-9223372036854775809", b"18446744073709551616"):
        body = b'{"model": "echo", "messages": [{"role": "user", "content": "ECHO:x"}], "seed": ' + seed + b"}"
        r = await request(mesh.url, "/v1/chat/completions", body)
        assert r.status == 400 and "does not fit in 64 bits" in r.json()["error"]["message"]
    digits = b'{"model": "echo", "messages": [{"role": "user", "content": "ECHO:12345678901234567890123"}]}'
    assert (await request(mesh.url, "/v1/chat/completions", digits)).status == 200  # long digits in a string are fine


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("guided_json", "{not json", "the schema is not valid JSON"),
        ("guided_json", {"type": "objekt"}, "'type' must be one of"),
        ("guided_json", {"properties": {"a": 5}}, "a schema must be an object or a boolean at schema.properties.a"),
        ("structured_outputs", {"json": {"required": "a"}}, "'required' must be an array"),
        ("structured_outputs", {"regex": "a", "choice": ["b"]}, "exactly one of"),
    ],
)
async def test_malformed_schemas_get_a_readable_400(mesh: Mesh, field: str, value: Any, needle: str) -> None:
    r = await request(mesh.url, "/v1/chat/completions", chat("ECHO:x", **{field: value}))
    err = r.json()["error"]
    assert r.status == 400 and needle in err["message"] and err["param"].startswith(field)
    assert "Traceback" not in err["message"] and "Error(" not in err["message"]


async def test_structured_outputs_reach_the_engine_as_guided(mesh: Mesh) -> None:
    engine = mesh.engines[0]
    await request(mesh.url, "/v1/chat/completions", chat("ECHO:a", structured_outputs={"choice": ["a", "b"]}))
    assert engine.requests[-1]["sampling"]["guided"] == {"choice": ["a", "b"]}


async def test_continuous_usage_stats_put_usage_in_every_chunk(mesh: Mesh) -> None:
    opts = {"include_usage": True, "continuous_usage_stats": True}
    events = (await request(mesh.url, "/v1/chat/completions", chat("ECHO:abc", stream=True, stream_options=opts))).events()
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks and all(e["usage"] is not None for e in chunks)
    assert [e["usage"]["completion_tokens"] for e in chunks] == sorted(e["usage"]["completion_tokens"] for e in chunks)
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] >= 3


async def test_chat_echo_and_continue_final_message(mesh: Mesh) -> None:
    engine = mesh.engines[0]
    messages = [{"role": "user", "content": "ECHO: world"}, {"role": "assistant", "content": "Hello"}]
    body = {"model": "echo", "messages": messages, "echo": True, "continue_final_message": True, "add_generation_prompt": False}
    r = await request(mesh.url, "/v1/chat/completions", body)
    assert r.status == 200, r.body
    # the prompt stops inside the assistant's message (the echo engine then answers " world")
    assert r.json()["choices"][0]["message"]["content"] == "Hello world"
    prompt = bytes(t - 3 for t in engine.requests[-1]["token_ids"]).decode()
    assert prompt.endswith("<|im_start|>assistant\nHello")
    events = (await request(mesh.url, "/v1/chat/completions", {**body, "stream": True})).events()
    assert content_of(events) == "Hello world" and events[0]["choices"][0]["delta"]["content"].startswith("Hello")
    bad = await request(mesh.url, "/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert bad.status == 400 and bad.json()["error"]["param"] == "continue_final_message"


async def test_model_retrieve(mesh: Mesh) -> None:
    r = await request(mesh.url, "/v1/models/echo", None, method="GET")
    assert r.status == 200 and r.json()["id"] == "echo" and r.json()["object"] == "model"
    missing = await request(mesh.url, "/v1/models/org/missing", None, method="GET")
    assert missing.status == 404
    assert missing.json()["error"]["message"] == "The model 'org/missing' does not exist"
    assert missing.json()["error"]["param"] == "model"


async def test_tokenize_and_detokenize(mesh: Mesh) -> None:
    r = await request(mesh.url, "/v1/tokenize", {"model": "echo", "prompt": "hé", "return_token_strs": True})
    body = r.json()
    assert r.status == 200 and body["count"] == len(body["tokens"]) == 4 and body["max_model_len"] == 512
    assert body["token_strs"][0] == "<s>"
    chat_tokens = (
        await request(mesh.url, "/v1/tokenize", {"model": "echo", "messages": [{"role": "user", "content": "x"}]})
    ).json()
    back = await request(mesh.url, "/v1/detokenize", {"model": "echo", "tokens": chat_tokens["tokens"]})
    assert back.json()["prompt"] == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    bad = await request(mesh.url, "/v1/detokenize", {"model": "echo", "tokens": [10**6]})
    assert bad.status == 400 and bad.json()["error"]["param"] == "tokens"


async def test_openai_sdk_reads_tool_calls_and_models_retrieve(mesh: Mesh) -> None:
    """Locks: the official SDK parses message.tool_calls, streamed tool_call deltas, and models.retrieve."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        messages: Any = [{"role": "user", "content": f"ECHO:{TWO_CALLS}"}]
        r = await client.chat.completions.create(model="echo", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
        calls = r.choices[0].message.tool_calls or []
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
            ("get_weather", {"city": "Paris", "unit": "celsius"}),
            ("get_time", {"tz": "Europe/Paris"}),
        ]
        stream = await client.chat.completions.create(model="echo", messages=messages, tools=TOOLS, stream=True)  # type: ignore[arg-type]
        args: dict[int, str] = {}
        names: dict[int, str] = {}
        async for chunk in stream:  # type: ignore[union-attr]
            for tc in chunk.choices[0].delta.tool_calls or ():
                if tc.function and tc.function.name:
                    names[tc.index] = tc.function.name
                args[tc.index] = args.get(tc.index, "") + ((tc.function.arguments if tc.function else None) or "")
        assert names == {0: "get_weather", 1: "get_time"}
        assert [args[i] for i in (0, 1)] == [c.function.arguments for c in calls]  # type: ignore[union-attr]
        model = await client.models.retrieve("echo")
        assert model.id == "echo" and model.owned_by == "meshllm"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("missing")

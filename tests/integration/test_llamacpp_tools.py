"""Tool calls with `meshllm run --engine llamacpp --tool-call-parser hermes` (SmolLM2-135M) and the unmodified `openai` SDK.

SmolLM2 writes a Hermes `<tool_call>` itself when shown two examples, which
the frontend parses into `tool_calls` (whole and streamed); `tool_choice`
"required" and a named function are forced through llama.cpp grammars built
from the tools' JSON schemas, so even this small model returns valid calls.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from mesh_run import MeshRun
from openai import AsyncOpenAI
from test_llamacpp_support import require_model

require_model()
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}
TOOLS: Any = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
SYSTEM = (
    "You are a function calling AI model. Here are the available tools: <tools>"
    + json.dumps(WEATHER)
    + "</tools>\nFor each function call return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def shot(city: str) -> list[dict[str, str]]:
    call = json.dumps({"name": "get_weather", "arguments": {"city": city}})
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
    ]


FEW_SHOT: Any = [{"role": "system", "content": SYSTEM}, *shot("Rome"), *shot("Berlin")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client() -> AsyncIterator[AsyncOpenAI]:
    args = ("--engine", "llamacpp", "--workers", "1", "--tool-call-parser", "hermes", "--", "--n-ctx", "1024", "--n-seq-max", "2")
    with MeshRun.start(*args) as mesh:
        async with AsyncOpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            yield c


async def model_of(client: AsyncOpenAI) -> str:
    return (await client.models.list()).data[0].id


async def test_smollm2_own_tool_call_is_parsed_whole_and_streamed(client: AsyncOpenAI) -> None:
    model = await model_of(client)
    messages = [*FEW_SHOT, {"role": "user", "content": "What is the weather in Paris?"}]
    r = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls: Any = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    stream = await client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=60, stream=True
    )
    name, args, finish, content = None, "", None, ""
    async for chunk in stream:
        c = chunk.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or ():
            assert tc.index == 0 and tc.function is not None
            name = tc.function.name or name
            args += tc.function.arguments or ""
        finish = c.finish_reason or finish
    assert (name, args, finish, content) == ("get_weather", calls[0].function.arguments, "tool_calls", "")


@pytest.mark.parametrize(
    ("tool_choice", "name", "question"),
    [
        ("required", None, "What is the time in Paris?"),
        ({"type": "function", "function": {"name": "get_weather"}}, "get_weather", "What is the weather in Paris?"),
    ],
    ids=["required", "named"],
)
async def test_forced_tool_choice_goes_through_a_grammar(
    client: AsyncOpenAI, tool_choice: Any, name: str | None, question: str
) -> None:
    """No examples, no instructions: the grammar alone makes SmolLM2 return a call matching the schema.

    (llama-cpp-python's schema-to-grammar converter lets a string hold raw control characters, which
    json.loads refuses: on such an output the frontend answers the text as content. The questions here
    are ones SmolLM2 answers with clean strings under greedy decoding.)
    """
    model = await model_of(client)
    messages: Any = [{"role": "user", "content": question}]
    r = await client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=80
    )
    calls: Any = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    for call in calls:
        assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
        args = json.loads(call.function.arguments)
        key = "city" if call.function.name == "get_weather" else "tz"
        assert isinstance(args, dict) and isinstance(args[key], str)
    if name is not None:
        assert [c.function.name for c in calls] == [name]

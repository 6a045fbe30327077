"""`POST /v1/responses` through the official `openai` SDK against a real frontend over HTTP.

One frontend (hermes tool-call parser, qwen3 reasoning parser) and
one echo worker whose chat template renders `tools`, on memory planes with
real gRPC and HTTP on loopback. The echo engine answers the text after the
last "ECHO:" of the prompt, so each test scripts the model's output —
including `<think>` reasoning and `<tool_call>` markup — and reads the
prompt the engine got.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio
from frontend_support import PLANE, EchoEngine, Mesh, _text_of, start_mesh

from meshllm.engine.base import EngineConfig
from meshllm.engine.worker_config import WorkerConfig
from meshllm.frontend.text.builtin_tokenizer import EOS_ID
from meshllm.worker.runtime import Worker

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}({{ c.function.arguments }}){% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS: Any = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
SCRIPTED = f"ECHO:<think>It is about weather.</think>Let me check. {CALL}"
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"],  # one or more (collapsed below)
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


class ToolsEcho(EchoEngine):
    """The echo engine with a chat template that shows tools and tool calls."""

    async def start(self, worker_id: str) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            tokenizer_source="builtin:mocker",
            context_length=2048,
            eos_token_ids=(EOS_ID,),
            chat_template=TEMPLATE,
        )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    m = await start_mesh(workers=0, tool_call_parser="hermes", reasoning_parser="qwen3")
    engine = ToolsEcho("echo")
    worker = await Worker.start(
        engine, WorkerConfig(engine="echo", plane=PLANE, grace_period_s=0.0), memory_store=m.store, memory_broker=m.broker
    )
    m.workers.append(worker)
    m.engines.append(engine)
    assert m.frontend.registry is not None
    await m.frontend.registry.wait_for("echo", timeout_s=30)
    yield m
    await m.aclose()


@pytest_asyncio.fixture(loop_scope="module")
async def client(mesh: Mesh) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=20) as c:
        yield c


def prompt_of(mesh: Mesh) -> str:
    return _text_of(mesh.engines[0].requests[-1]["token_ids"])


def collapsed(types: list[str]) -> list[str]:
    """Event types with runs of the same delta event counted once."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


async def test_a_string_input_answers_a_completed_response_with_usage(client: openai.AsyncOpenAI, mesh: Mesh) -> None:
    r = await client.responses.create(model="echo", input="ECHO:Hello, world!", instructions="Be brief.")
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed" and r.error is None
    assert r.output_text == "Hello, world!" and r.instructions == "Be brief." and r.model == "echo"
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"  # type: ignore[union-attr]
    prompt = prompt_of(mesh)
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nECHO:Hello, world!")
    assert r.usage is not None and r.usage.input_tokens == len(mesh.engines[0].requests[-1]["token_ids"])
    assert (
        r.usage.output_tokens == len("Hello, world!") + 1 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    )


async def test_max_output_tokens_makes_an_incomplete_response(client: openai.AsyncOpenAI) -> None:
    r = await client.responses.create(model="echo", input="ECHO:abcdefgh", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "abc" and r.max_output_tokens == 3 and r.usage is not None and r.usage.output_tokens == 3


async def test_streaming_follows_openais_event_sequence(client: openai.AsyncOpenAI) -> None:
    """Locks: created, in_progress, item/part added, text deltas, text/part/item done, completed; numbered from 0."""
    stream = await client.responses.create(
        model="echo", input=[{"role": "user", "content": [{"type": "input_text", "text": "ECHO:Grüße 😀"}]}], stream=True
    )
    events = [e async for e in stream]
    assert collapsed([e.type for e in events]) == TEXT_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == done.text == final.output_text == "Grüße 😀"  # type: ignore[union-attr]
    assert events[0].response.status == "in_progress" and final.status == "completed"  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens > 0


async def test_function_tools_reach_the_template_and_calls_come_back_as_items(client: openai.AsyncOpenAI, mesh: Mesh) -> None:
    """Locks: reasoning, message and function_call items from the chat path's parsers, in output order."""
    r = await client.responses.create(model="echo", input=SCRIPTED, tools=TOOLS)
    assert "TOOLS: get_weather" in prompt_of(mesh)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = r.output
    assert reasoning.content[0].text == "It is about weather."  # type: ignore[union-attr, index]
    assert message.content[0].text == "Let me check."  # type: ignore[union-attr]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert call.call_id.startswith("call_") and r.tools[0].name == "get_weather"  # type: ignore[union-attr]

    events = [e async for e in await client.responses.create(model="echo", input=SCRIPTED, tools=TOOLS, stream=True)]
    types = collapsed([e.type for e in events])
    assert types[types.index("response.content_part.done") + 2 :] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    assert json.loads(args) == {"city": "Paris"} and events[-1].response.output[2].arguments == args  # type: ignore[union-attr]


async def test_previous_response_id_continues_the_conversation(client: openai.AsyncOpenAI, mesh: Mesh) -> None:
    first = await client.responses.create(model="echo", input=SCRIPTED, tools=TOOLS, instructions="FIRST-INSTRUCTIONS")
    call = first.output[2]
    second = await client.responses.create(
        model="echo",
        previous_response_id=first.id,
        tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "ECHO:sunny, 21 C"}],  # type: ignore[union-attr]
    )
    prompt = prompt_of(mesh)
    assert "FIRST-INSTRUCTIONS" not in prompt  # instructions are not carried over (as OpenAI)
    assert f"<|im_start|>user\n{SCRIPTED}<|im_end|>" in prompt
    assert 'CALL get_weather({"city": "Paris"})' in prompt and "<|im_start|>tool\nECHO:sunny, 21 C" in prompt
    assert second.output_text == "sunny, 21 C" and second.previous_response_id == first.id
    third = await client.responses.create(model="echo", input="ECHO:again", previous_response_id=second.id, store=False)
    assert "sunny, 21 C<|im_end|>" in prompt_of(mesh)  # the second's output is in the history
    with pytest.raises(openai.NotFoundError) as err:  # store: false keeps nothing
        await client.responses.create(model="echo", input="ECHO:x", previous_response_id=third.id)
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": 9}, "temperature"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ],
)
async def test_bad_requests_name_the_field(mesh: Mesh, extra: dict[str, Any], param: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=20) as client:
        with pytest.raises(openai.APIStatusError) as err:
            await client.post("/responses", body={"model": "echo", **extra}, cast_to=object)
    assert err.value.status_code == (404 if param == "previous_response_id" else 400)
    assert err.value.body["param"] == param, err.value.body  # type: ignore[index]

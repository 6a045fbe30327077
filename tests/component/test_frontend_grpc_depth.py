"""The Inference gRPC API's tools, reasoning and prompt logprobs, and capability refusals before any engine work.

A frontend (hermes tool parser, qwen3 reasoning parser) + one echo worker over
memory planes, real gRPC; a second mesh whose engine declares no
capabilities (no prompt logprobs, embeddings or guided decoding) shows the
frontend refusing such requests with a 400 / INVALID_ARGUMENT while the
engine sees nothing. The echo engine answers with the text after "ECHO:",
one byte per token, so markers and JSON arrive split across many chunks.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from frontend_support import PLANE, EchoEngine, Mesh, request, start_mesh

from meshllm.engine.worker_config import WorkerConfig
from meshllm.v1 import generate_pb2, inference_pb2, inference_pb2_grpc
from meshllm.worker.runtime import Worker

pytestmark = pytest.mark.asyncio(loop_scope="module")

EXAMPLE = Path(__file__).resolve().parents[2] / "clients" / "python" / "grpc_example.py"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TWO_CALLS = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
WEATHER = inference_pb2.Tool(
    name="get_weather",
    description="Weather in a city.",
    parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}),
)
TIME = inference_pb2.Tool(name="get_time", parameters='{"type": "object"}')
MODE = inference_pb2.ToolChoice


class NoCapsEngine(EchoEngine):
    """The echo engine declaring no capabilities (as the mocker does)."""

    supports_prompt_logprobs = False


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    m = await start_mesh(workers=1, tool_call_parser="hermes", reasoning_parser="qwen3")
    yield m
    await m.aclose()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def bare() -> AsyncIterator[Mesh]:
    m = await start_mesh(workers=0)
    engine = NoCapsEngine()
    cfg = WorkerConfig(engine="nocaps", plane=PLANE, grace_period_s=0.0)
    m.workers.append(await Worker.start(engine, cfg, memory_store=m.store, memory_broker=m.broker))
    m.engines.append(engine)
    assert m.frontend.registry is not None
    await m.frontend.registry.wait_for("echo", timeout_s=30)
    yield m
    await m.aclose()


def stub_of(m: Mesh) -> tuple[grpc.aio.Channel, inference_pb2_grpc.InferenceStub]:
    address = m.frontend.grpc_address
    assert address is not None
    channel = grpc.aio.insecure_channel(address)
    return channel, inference_pb2_grpc.InferenceStub(channel)


async def chat(m: Mesh, content: str, **fields: Any) -> list[inference_pb2.TextChunk]:
    channel, stub = stub_of(m)
    async with channel:
        req = inference_pb2.ChatRequest(
            model="echo", messages=[inference_pb2.ChatMessage(role="user", content=content)], **fields
        )
        return [c async for c in stub.ChatCompletion(req, timeout=15)]


def calls_of(chunks: list[inference_pb2.TextChunk]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each call, its pieces put together in order."""
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for piece in c.tool_calls:
            call = calls.setdefault(piece.index, ["", "", ""])
            assert not (call[0] and piece.id), "only a call's first piece carries its id"
            call[0], call[1], call[2] = call[0] or piece.id, call[1] or piece.name, call[2] + piece.arguments
    return [(c[0], c[1], c[2]) for _, c in sorted(calls.items())]


async def test_tool_calls_stream_as_pieces_and_finish_as_tool_calls(mesh: Mesh) -> None:
    chunks = await chat(mesh, f"ECHO:Checking.{TWO_CALLS}", tools=[WEATHER, TIME])
    calls = calls_of(chunks)
    assert [(name, json.loads(args)) for _, name, args in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"tz": "Europe/Paris"}),
    ]
    assert all(call_id.startswith("call_") for call_id, _, _ in calls)
    assert "".join(c.text for c in chunks) == "Checking."  # the markup never shows as text
    first = [next(p for c in chunks for p in c.tool_calls if p.index == i) for i in (0, 1)]
    assert [(p.name, bool(p.id)) for p in first] == [("get_weather", True), ("get_time", True)]  # id + name come first
    last = chunks[-1]
    assert last.finish_reason == generate_pb2.FINISH_REASON_STOP and last.tool_calls_finished
    assert not any(c.tool_calls_finished for c in chunks[:-1])


async def test_tool_choice_none_and_parallel_false_follow_the_http_semantics(mesh: Mesh) -> None:
    none = await chat(mesh, f"ECHO:{CALL}", tools=[WEATHER], tool_choice=MODE(mode=MODE.MODE_NONE))
    assert "".join(c.text for c in none) == CALL and not calls_of(none) and not none[-1].tool_calls_finished
    single = await chat(mesh, f"ECHO:{TWO_CALLS}", tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert [name for _, name, _ in calls_of(single)] == ["get_weather"]


async def test_an_assistant_message_with_tool_calls_and_a_tool_answer_are_accepted(mesh: Mesh) -> None:
    channel, stub = stub_of(mesh)
    call = inference_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    messages = [
        inference_pb2.ChatMessage(role="user", content="weather?"),
        inference_pb2.ChatMessage(role="assistant", tool_calls=[call]),
        inference_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
        inference_pb2.ChatMessage(role="user", content="ECHO:ok"),
    ]
    async with channel:
        chunks = [
            c
            async for c in stub.ChatCompletion(
                inference_pb2.ChatRequest(model="echo", messages=messages, tools=[WEATHER]), timeout=15
            )
        ]
    assert "".join(c.text for c in chunks) == "ok"


async def test_reasoning_is_split_from_the_text_at_the_tags(mesh: Mesh) -> None:
    chunks = await chat(mesh, "ECHO:<think>cold front</think>\nTake a coat.")
    assert "".join(c.reasoning for c in chunks) == "cold front"
    assert "".join(c.text for c in chunks) == "Take a coat."
    first_text = next(i for i, c in enumerate(chunks) if c.text)
    assert all(not c.reasoning for c in chunks[first_text + 1 :])  # no reasoning after the text began


async def test_prompt_logprobs_and_token_logprobs_on_a_completion(mesh: Mesh) -> None:
    channel, stub = stub_of(mesh)
    params = inference_pb2.TextParams(prompt_logprobs=1, logprobs=1)
    async with channel:
        req = inference_pb2.CompletionRequest(model="echo", prompt="ECHO:ab", params=params)
        chunks = [c async for c in stub.Completion(req, timeout=15)]
    plp = chunks[0].prompt_logprobs
    assert len(plp) == 1 + len("ECHO:ab") and not plp[0].HasField("logprob")  # BOS: nothing predicts it
    assert [e.token for e in plp[1:]] == list("ECHO:ab") and all(e.logprob == -1.5 for e in plp[1:])
    assert all(len(e.top) == 1 and e.top[0].token == e.token for e in plp[1:])  # trimmed to the 1 asked for
    assert all(not c.prompt_logprobs for c in chunks[1:])
    tokens = [e for c in chunks for e in c.logprobs]
    assert [e.token for e in tokens][:2] == ["a", "b"] and all(e.logprob == -0.25 for e in tokens[:2])


async def test_bad_tools_are_invalid_argument_with_the_field_named(mesh: Mesh) -> None:
    broken = inference_pb2.Tool(name="f", parameters="{not json")
    for fields, needle in (
        ({"tools": [broken]}, "tools[0].parameters"),
        ({"tools": [WEATHER], "tool_choice": MODE(function="nope")}, "'nope' is not among 'tools'"),
        ({"tool_choice": MODE(mode=MODE.MODE_REQUIRED)}, "needs 'tools'"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await chat(mesh, "ECHO:x", **fields)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in (info.value.details() or "")


async def test_the_grpc_example_prints_the_tool_call_it_streamed(mesh: Mesh) -> None:
    prompt = 'ECHO:<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    args = ["--inference", str(mesh.frontend.grpc_address), "--router", "", "--model", "echo", "--weather-tool"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLE), *args, "--prompt", prompt, "--max-tokens", "200", "--timeout", "15",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert any(line.startswith('tool_call: get_weather {"city": "Paris"} id=call_') for line in lines), lines
    assert any(line.startswith("finish_reason: FINISH_REASON_STOP (tool_calls)") for line in lines), lines


# ---------------------------------------------------------------- capabilities


async def test_the_worker_publishes_its_engines_capabilities(mesh: Mesh, bare: Mesh) -> None:
    assert mesh.frontend.registry is not None and bare.frontend.registry is not None
    card = mesh.frontend.registry.lookup("echo").card
    assert card.HasField("capabilities") and card.capabilities.prompt_logprobs and not card.capabilities.embeddings
    caps = bare.frontend.registry.lookup("echo").capabilities
    assert (caps.prompt_logprobs, caps.embeddings, caps.guided_decoding) == (False, False, False)


async def test_prompt_logprobs_on_an_engine_without_them_is_refused_before_the_engine_sees_it(bare: Mesh) -> None:
    engine = bare.engines[0]
    seen = len(engine.requests)
    for body in (
        {"model": "echo", "prompt": "ECHO:ab", "prompt_logprobs": 1},
        {"model": "echo", "prompt": "ECHO:ab", "echo": True, "logprobs": 0, "stream": True},
        {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0},
    ):
        r = await request(bare.url, "/v1/chat/completions" if "messages" in body else "/v1/completions", body)
        err = r.json()["error"]
        assert r.status == 400 and err["param"] == "prompt_logprobs" and "does not compute prompt logprobs" in err["message"]
    channel, stub = stub_of(bare)
    async with channel:
        req = inference_pb2.CompletionRequest(model="echo", prompt="x", params=inference_pb2.TextParams(prompt_logprobs=0))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [c async for c in stub.Completion(req, timeout=15)]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(engine.requests) == seen  # refused up front: no prefill happened


async def test_embeddings_and_forced_tool_choice_are_refused_before_the_engine_sees_them(bare: Mesh) -> None:
    engine = bare.engines[0]
    seen = len(engine.requests)
    r = await request(bare.url, "/v1/embeddings", {"model": "echo", "input": ["a", "b"]})
    assert r.status == 400 and "does not compute embeddings" in r.json()["error"]["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": "echo", "messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": "required"}
    r = await request(bare.url, "/v1/chat/completions", body)
    err = r.json()["error"]
    assert r.status == 400 and err["param"] == "tool_choice" and "nocaps engine" in err["message"]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await chat(bare, "x", tools=[WEATHER], tool_choice=MODE(function="get_weather"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "guided decoding" in (info.value.details() or "")
    assert len(engine.requests) == seen
    # what the engine can do still works
    assert (await request(bare.url, "/v1/completions", {"model": "echo", "prompt": "ECHO:ok"})).json()["choices"][0][
        "text"
    ] == "ok"

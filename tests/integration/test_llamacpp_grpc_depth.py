"""The Inference gRPC API on `meshllm run --engine llamacpp` (SmolLM2-135M): forced tool calls and prompt logprobs.

The same requests over HTTP and gRPC go through the same core, so the
prompt logprobs gRPC returns equal the HTTP API's for the same prompt, and a
named `tool_choice` is forced through a llama.cpp grammar over gRPC as it is
over HTTP.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio
from mesh_run import MeshRun
from openai import AsyncOpenAI
from test_llamacpp_support import require_model

from meshllm.v1 import generate_pb2, inference_pb2, inference_pb2_grpc

require_model()
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

WEATHER = inference_pb2.Tool(
    name="get_weather",
    description="Get the current weather in a city",
    parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
)
PROMPT = "The capital of France is Paris. The capital of Italy is"


@dataclass
class Run:
    http: str
    stub: inference_pb2_grpc.InferenceStub
    model: str


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run() -> AsyncIterator[Run]:
    args = ("--engine", "llamacpp", "--workers", "1", "--tool-call-parser", "hermes", "--", "--n-ctx", "1024", "--n-seq-max", "2")
    with MeshRun.start(*args) as mesh:
        async with grpc.aio.insecure_channel(mesh.inference_address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            models = await stub.ListModels(inference_pb2.ListModelsRequest(), timeout=30)
            yield Run(f"{mesh.http_url}/v1", stub, models.models[0].id)


async def test_a_named_tool_choice_is_forced_through_a_grammar_over_grpc(run: Run) -> None:
    req = inference_pb2.ChatRequest(
        model=run.model,
        messages=[inference_pb2.ChatMessage(role="user", content="What is the weather in Paris?")],
        tools=[WEATHER],
        tool_choice=inference_pb2.ToolChoice(function="get_weather"),
        params=inference_pb2.TextParams(temperature=0, max_tokens=80),
    )
    chunks = [c async for c in run.stub.ChatCompletion(req, timeout=120)]
    pieces = [p for c in chunks for p in c.tool_calls]
    assert pieces and pieces[0].name == "get_weather" and pieces[0].id.startswith("call_")
    args = json.loads("".join(p.arguments for p in pieces))
    assert isinstance(args, dict) and isinstance(args["city"], str)
    assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_STOP and chunks[-1].tool_calls_finished


async def test_prompt_logprobs_over_grpc_equal_the_http_apis(run: Run) -> None:
    params = inference_pb2.TextParams(prompt_logprobs=1, max_tokens=1, temperature=0)
    req = inference_pb2.CompletionRequest(model=run.model, prompt=PROMPT, params=params)
    chunks = [c async for c in run.stub.Completion(req, timeout=120)]
    plp = chunks[0].prompt_logprobs
    assert len(plp) > 5 and not plp[0].HasField("logprob") and all(e.HasField("logprob") and e.logprob <= 0 for e in plp[1:])
    async with AsyncOpenAI(base_url=run.http, api_key="unused", max_retries=0, timeout=120) as client:
        r = await client.completions.create(model=run.model, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert [e.token for e in plp] == lp.tokens[: len(plp)]
    http_values = lp.token_logprobs[: len(plp)]
    assert http_values[0] is None
    # the same engine evaluating the same prompt whole (no prefix-cache reuse): equal up to float noise
    for grpc_entry, http_value in zip(plp[1:], http_values[1:], strict=True):
        assert math.isclose(grpc_entry.logprob, http_value, abs_tol=1e-4), (grpc_entry, http_value)

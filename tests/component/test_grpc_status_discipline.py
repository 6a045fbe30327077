"""Status discipline over real gRPC and HTTP: a worker, a router server and a frontend in-process (memory planes).

Locks: bytes that do not parse answer INVALID_ARGUMENT on unary, server-
streaming and bidi (GenerateSession) methods, with no traceback logged; an
unknown enum value is INVALID_ARGUMENT; the token-level API refuses what
the HTTP API refuses (NaN temperature, negative top_k, token ids outside the
engine's vocabulary, a prompt longer than the context — Route included);
a 20,000-character model name is NOT_FOUND with a truncated message (not
RESOURCE_EXHAUSTED); HTTP top_k >= 2^31 is a 400 and chat_template_kwargs may
carry add_generation_prompt and tools; grpc's health Watch still streams.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshllm.errors import MAX_MESSAGE_CHARS
from meshllm.testing.minimesh import CONTEXT_LENGTH, MODEL, VOCAB_SIZE, MiniMesh, start_mini_mesh
from meshllm.v1 import generate_pb2, inference_pb2, router_pb2, session_pb2

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh() -> AsyncIterator[MiniMesh]:
    m = await start_mini_mesh()
    yield m
    await m.aclose()


async def unary_stream(address: str, method: str, payload: bytes) -> tuple[grpc.StatusCode, str, list[bytes]]:
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.unary_stream(method, request_serializer=None, response_deserializer=None)(payload, timeout=10)
        out: list[bytes] = []
        try:
            async for msg in call:
                out.append(msg)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or "", out
        return grpc.StatusCode.OK, "", out


async def unary(address: str, method: str, payload: bytes) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            await ch.unary_unary(method, request_serializer=None, response_deserializer=None)(payload, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""


def generate(token_ids: list[int], **sampling: Any) -> bytes:
    m = generate_pb2.GenerateRequest(request_id="r", model=MODEL, token_ids=token_ids)
    m.stop.max_tokens = 4
    for k, v in sampling.items():
        setattr(m.sampling, k, v)
    return m.SerializeToString()


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.exc_info]


@pytest.mark.parametrize("server", ["worker", "router"])
async def test_garbage_bytes_are_invalid_argument_without_a_traceback(
    mesh: MiniMesh, server: str, caplog: pytest.LogCaptureFixture
) -> None:
    address = mesh.worker_address if server == "worker" else mesh.router_address
    service = server.title()
    with caplog.at_level(logging.DEBUG):
        for _ in range(3):
            code, details, _ = await unary_stream(address, f"/meshllm.v1.{service}/Generate", b"\xff\xff\xff")
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "not valid protobuf" in details
        code, details = await unary(address, "/grpc.health.v1.Health/Check", b"\x0a\xff")
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        async with grpc.aio.insecure_channel(address) as ch:
            call = ch.stream_stream(
                f"/meshllm.v1.{service}/GenerateSession", request_serializer=None, response_deserializer=None
            )(timeout=10)
            await call.write(b"\xff\xff")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert no_tracebacks(caplog) == []


async def test_unknown_enum_value_is_invalid_argument(mesh: MiniMesh) -> None:
    m = generate_pb2.GenerateRequest(request_id="e", model=MODEL, token_ids=[1, 2])
    m.disagg.request_type = 99  # type: ignore[assignment]
    for address, service in ((mesh.worker_address, "Worker"), (mesh.router_address, "Router")):
        code, details, _ = await unary_stream(address, f"/meshllm.v1.{service}/Generate", m.SerializeToString())
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown value 99" in details
    route = router_pb2.RouteRequest(model=MODEL, token_ids=[1, 2], role=99)  # type: ignore[arg-type]
    code, details = await unary(mesh.router_address, "/meshllm.v1.Router/Route", route.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'role'" in details


@pytest.mark.parametrize(
    ("tokens", "sampling", "expect"),
    [
        ([1, 2], {"temperature": math.nan}, "'sampling.temperature': nan is outside [0, 2]"),
        ([1, 2], {"top_p": math.inf}, "'sampling.top_p': inf is outside (0, 1]"),
        ([1, 2], {"top_k": -5}, "'sampling.top_k': -5 is less than the minimum of -1"),
        ([1, VOCAB_SIZE], {}, f"token id {VOCAB_SIZE} is outside the vocabulary (size {VOCAB_SIZE})"),
        ([1] * CONTEXT_LENGTH, {}, f"maximum context length is {CONTEXT_LENGTH} tokens"),
    ],
)
async def test_the_token_level_api_refuses_what_http_refuses(
    mesh: MiniMesh, tokens: list[int], sampling: dict[str, Any], expect: str
) -> None:
    payload = generate(tokens, **sampling)
    for address, service in ((mesh.worker_address, "Worker"), (mesh.router_address, "Router")):
        code, details, _ = await unary_stream(address, f"/meshllm.v1.{service}/Generate", payload)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and expect in details, (service, details)
    # the same through a session: the stream ends with an InvalidArgument error item
    async with grpc.aio.insecure_channel(mesh.worker_address) as ch:
        call = ch.stream_stream(
            "/meshllm.v1.Worker/GenerateSession",
            request_serializer=session_pb2.SessionUp.SerializeToString,
            response_deserializer=session_pb2.SessionDown.FromString,
        )(timeout=10)
        up = session_pb2.SessionUp()
        up.open.add(stream_id=7, request=generate_pb2.GenerateRequest.FromString(payload))
        await call.write(up)
        down = await call.read()
        assert down.items[0].stream_id == 7 and down.items[0].error.code in ("InvalidArgument", "ContextLengthExceeded")
        assert expect in down.items[0].error.message
        await call.done_writing()


async def test_route_refuses_a_prompt_generate_refuses(mesh: MiniMesh) -> None:
    route = router_pb2.RouteRequest(model=MODEL, token_ids=range(1_000_000))
    code, details = await unary(mesh.router_address, "/meshllm.v1.Router/Route", route.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "maximum context length" in details
    ok = router_pb2.RouteRequest(model=MODEL, token_ids=range(1, 100))
    assert (await unary(mesh.router_address, "/meshllm.v1.Router/Route", ok.SerializeToString()))[0] == grpc.StatusCode.OK


async def test_a_huge_model_name_is_not_found_with_a_truncated_message(mesh: MiniMesh) -> None:
    name = "m" * 20_000
    chat = inference_pb2.ChatRequest(model=name)
    chat.messages.add(role="user", content="hi")
    code, details, _ = await unary_stream(mesh.frontend_grpc, "/meshllm.v1.Inference/ChatCompletion", chat.SerializeToString())
    assert code == grpc.StatusCode.NOT_FOUND and len(details) <= MAX_MESSAGE_CHARS and "characters cut" in details
    req = generate_pb2.GenerateRequest(request_id="n", model=name, token_ids=[1])
    code, details, _ = await unary_stream(mesh.router_address, "/meshllm.v1.Router/Generate", req.SerializeToString())
    assert code == grpc.StatusCode.NOT_FOUND and len(details) <= MAX_MESSAGE_CHARS


async def test_inference_grpc_shares_the_http_limits(mesh: MiniMesh) -> None:
    chat = inference_pb2.ChatRequest(model=MODEL, params=inference_pb2.TextParams(top_k=-7, max_tokens=4))
    chat.messages.add(role="user", content="hi")
    code, details, _ = await unary_stream(mesh.frontend_grpc, "/meshllm.v1.Inference/ChatCompletion", chat.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "'top_k': -7 is less than the minimum of -1"
    chat.params.top_k, chat.params.max_tokens = 40, 2**32 - 1
    code, details, _ = await unary_stream(mesh.frontend_grpc, "/meshllm.v1.Inference/ChatCompletion", chat.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'max_tokens'" in details
    code, details, _ = await unary_stream(mesh.frontend_grpc, "/meshllm.v1.Inference/Completion", b"\xff")
    assert code == grpc.StatusCode.INVALID_ARGUMENT


async def post(mesh: MiniMesh, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    host, port = mesh.frontend.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    writer.write(head.encode() + b"Connection: close\r\n\r\n" + data)
    raw = await reader.read()
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


async def test_http_overflowing_integers_and_template_kwargs_are_not_500s(mesh: MiniMesh) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    status, body = await post(mesh, "/v1/chat/completions", {**chat, "top_k": 2**31})
    assert status == 400 and body["error"]["param"] == "top_k"
    status, body = await post(mesh, "/v1/completions", {"model": MODEL, "prompt": "a", "seed": 2**64})
    assert status == 400 and body["error"]["param"] == "seed"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for kwargs in ({"add_generation_prompt": False}, {"tools": tools}, {"add_generation_prompt": True, "tools": tools}):
        status, body = await post(mesh, "/v1/chat/completions", {**chat, "chat_template_kwargs": kwargs})
        assert status == 200, body
    status, body = await post(mesh, "/v1/chat/completions", {**chat, "chat_template_kwargs": {"messages": []}})
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs.messages"


async def test_health_watch_streams_through_the_error_mapping(mesh: MiniMesh) -> None:
    async with grpc.aio.insecure_channel(mesh.worker_address) as ch:
        call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        first = await call.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        call.cancel()

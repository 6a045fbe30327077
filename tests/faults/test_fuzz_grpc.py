"""Fuzz: 500+ malformed gRPC messages to the worker, router and frontend Inference methods over real gRPC.

A mocker worker, a router server and a frontend run in-process on memory
planes with real gRPC on loopback (tests/faults/fuzz_support.py). Each
example is either random bytes sent to one method (unary, server-streaming
or the bidi GenerateSession) or a structurally valid message with
out-of-range values: NaN / infinite / negative sampling values, top_k over
int32, token ids outside the vocabulary, prompts longer than the context,
unknown enum values (disagg.request_type, Route's role), huge strings.

Locks: no call ends UNKNOWN or INTERNAL and no session stream ends with an
"Unknown" error item (malformed or out-of-range input is INVALID_ARGUMENT,
or another specific status); no traceback is logged twice for the same
error; afterwards every server is healthy and serves a normal request.
Worker.Drain is left out: a valid one drains the worker, as it should.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshllm.plane.request.transport import ERROR_TRAILER
from meshllm.testing.minimesh import CONTEXT_LENGTH, MODEL, MiniMesh
from meshllm.v1 import generate_pb2, inference_pb2, router_pb2, session_pb2, worker_pb2

sys.path.insert(0, str(Path(__file__).parent))
from fuzz_support import Loop, TracebackLog, fuzz_settings

pytestmark = pytest.mark.timeout(120)

EXAMPLES = 600
BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}

# (server, method, kind): kind is "unary", "stream" (server-streaming) or "bidi"
METHODS = [
    ("worker", "/meshllm.v1.Worker/Generate", "stream"),
    ("worker", "/meshllm.v1.Worker/GenerateSession", "bidi"),
    ("worker", "/meshllm.v1.Worker/Abort", "unary"),
    ("worker", "/meshllm.v1.Worker/GetInfo", "unary"),
    ("worker", "/meshllm.v1.Worker/GetKvSnapshot", "unary"),
    ("worker", "/meshllm.v1.Worker/PullKv", "stream"),
    ("worker", "/meshllm.v1.Worker/ClearKvBlocks", "unary"),
    ("worker", "/meshllm.v1.Worker/GetModelFiles", "stream"),
    ("router", "/meshllm.v1.Router/Generate", "stream"),
    ("router", "/meshllm.v1.Router/GenerateSession", "bidi"),
    ("router", "/meshllm.v1.Router/Route", "unary"),
    ("router", "/meshllm.v1.Router/ListWorkers", "unary"),
    ("frontend", "/meshllm.v1.Inference/ChatCompletion", "stream"),
    ("frontend", "/meshllm.v1.Inference/Completion", "stream"),
    ("frontend", "/meshllm.v1.Inference/ListModels", "unary"),
    ("frontend", "/grpc.health.v1.Health/Check", "unary"),
]

FLOAT = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -0.0, 0.0, 0.5, 1.0, 2.0, 2.5, 1e30])
INT32 = st.sampled_from([-(2**31), -2, -1, 0, 1, 40, 2**31 - 1]) | st.integers(-(2**31), 2**31 - 1)
UINT32 = st.sampled_from([0, 1, 20, 21, CONTEXT_LENGTH, 2**31 - 1, 2**31, 2**32 - 1]) | st.integers(0, 2**32 - 1)
UINT64 = st.sampled_from([0, 1, 2**63, 2**64 - 1])
TOKENS = st.lists(st.sampled_from([0, 1, 5, 31999, 32000, 2**31, 2**32 - 1]) | st.integers(0, 40000), max_size=12)
TEXT = st.text(max_size=20) | st.sampled_from(["", MODEL, "x" * 20_000])
LONG_PROMPT = list(range(1_000_000))


@st.composite
def generate_requests(draw: st.DrawFn) -> generate_pb2.GenerateRequest:
    m = generate_pb2.GenerateRequest(request_id=draw(TEXT), model=draw(st.sampled_from([MODEL, MODEL, "", "nope"]) | TEXT))
    m.token_ids.extend(LONG_PROMPT if draw(st.integers(0, 40)) == 0 else draw(TOKENS))
    s = m.sampling
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if draw(st.booleans()):
            setattr(s, name, draw(FLOAT))
    if draw(st.booleans()):
        s.top_k = draw(INT32)
    if draw(st.booleans()):
        s.seed = draw(UINT64)
    if draw(st.integers(0, 5)) == 0:
        s.guided.regex = draw(TEXT)
    m.stop.max_tokens = draw(st.sampled_from([1, 4, 16]) | UINT32)
    if draw(st.booleans()):
        m.stop.min_tokens = draw(UINT32)
    m.stop.stop_token_ids.extend(draw(TOKENS))
    m.stop.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        m.output.logprobs = draw(UINT32)
    m.eos_token_ids.extend(draw(TOKENS))
    if draw(st.integers(0, 3)) == 0:
        m.disagg.request_type = draw(st.sampled_from([1, 2, 3, 99, -1]))  # type: ignore[assignment]
        m.disagg.kv_handle = draw(st.binary(max_size=40))
        m.disagg.first_token_ids.extend(draw(TOKENS))
    if draw(st.integers(0, 3)) == 0:
        m.routing.backend_instance_id = draw(TEXT)
        m.routing.dp_rank = draw(UINT32)
        m.routing.priority = draw(INT32)
    return m


@st.composite
def text_params(draw: st.DrawFn) -> inference_pb2.TextParams:
    p = inference_pb2.TextParams(max_tokens=draw(st.sampled_from([1, 8]) | UINT32))
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if draw(st.booleans()):
            setattr(p, name, draw(FLOAT))
    if draw(st.booleans()):
        p.top_k = draw(INT32)
    if draw(st.booleans()):
        p.seed = draw(UINT64)
    if draw(st.booleans()):
        p.logprobs = draw(UINT32)
    p.min_tokens = draw(st.sampled_from([0, 0, 3]) | UINT32)
    p.stop_token_ids.extend(draw(TOKENS))
    p.stop.extend(draw(st.lists(TEXT, max_size=3)))
    return p


class Payload(bytes):
    """Serialized message bytes with a short repr (a 1,000,000-token prompt would make hypothesis' report huge)."""

    def __repr__(self) -> str:
        return f"Payload({bytes(self[:120])!r}... {len(self)} bytes)" if len(self) > 120 else f"Payload({bytes(self)!r})"


@st.composite
def messages(draw: st.DrawFn) -> tuple[str, str, str, bytes]:
    """(server, method, kind, payload): random bytes, or a valid message with out-of-range values."""
    server, method, kind, payload = draw(_messages())
    return server, method, kind, Payload(payload)


@st.composite
def _messages(draw: st.DrawFn) -> tuple[str, str, str, bytes]:
    server, method, kind = draw(st.sampled_from(METHODS))
    if draw(st.integers(0, 2)) == 0:
        return server, method, kind, draw(st.binary(min_size=1, max_size=64))
    name = method.rsplit("/", 1)[1]
    payload: bytes
    if name == "Generate":
        payload = draw(generate_requests()).SerializeToString()
    elif name == "GenerateSession":
        up = session_pb2.SessionUp(cancel=draw(st.lists(UINT64, max_size=2)))
        sid = draw(st.sampled_from([1, 2**64 - 1]))
        for _ in range(draw(st.integers(1, 2))):  # the same stream id twice is refused too
            up.open.add(stream_id=sid, request=draw(generate_requests()), timeout_s=draw(FLOAT))
        payload = up.SerializeToString()
    elif name == "Route":
        r = router_pb2.RouteRequest(model=draw(st.sampled_from([MODEL, "nope", ""]) | TEXT), role=draw(INT32))  # type: ignore[arg-type]
        r.token_ids.extend(LONG_PROMPT if draw(st.integers(0, 20)) == 0 else draw(TOKENS))
        payload = r.SerializeToString()
    elif name == "ChatCompletion":
        c = inference_pb2.ChatRequest(model=draw(st.sampled_from([MODEL, "nope"]) | TEXT), params=draw(text_params()))
        for _ in range(draw(st.integers(0, 2))):
            c.messages.add(role=draw(st.sampled_from(["user", "system", "bogus"])), content=draw(TEXT))
        payload = c.SerializeToString()
    elif name == "Completion":
        payload = inference_pb2.CompletionRequest(
            model=draw(st.sampled_from([MODEL, "nope"]) | TEXT), prompt=draw(TEXT), params=draw(text_params())
        ).SerializeToString()
    elif name in ("Abort", "PullKv", "GetModelFiles"):
        payload = worker_pb2.PullKvRequest(
            kv_handle=draw(st.binary(max_size=40)), request_id=draw(TEXT), layout=draw(TEXT)
        ).SerializeToString()  # field 1 is bytes/string in each of these three
    else:
        payload = draw(st.binary(max_size=16))
    return server, method, kind, payload


def _trailer(call_or_exc: grpc.aio.AioRpcError) -> str | None:
    for key, value in call_or_exc.trailing_metadata() or ():
        if key == ERROR_TRAILER:
            return value if isinstance(value, str) else value.decode()
    return None


async def _stream(channel: grpc.aio.Channel, method: str, payload: bytes) -> tuple[grpc.StatusCode, list[str]]:
    call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)(payload, timeout=10)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code(), [t for t in (_trailer(exc),) if t]
    return await call.code(), []


async def _unary(channel: grpc.aio.Channel, method: str, payload: bytes) -> tuple[grpc.StatusCode, list[str]]:
    try:
        await channel.unary_unary(method, request_serializer=None, response_deserializer=None)(payload, timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), [t for t in (_trailer(exc),) if t]
    return grpc.StatusCode.OK, []


async def _bidi(channel: grpc.aio.Channel, method: str, payload: bytes) -> tuple[grpc.StatusCode, list[str]]:
    """One SessionUp (or garbage) on a session; read until every opened stream ended, then close our side."""
    call = channel.stream_stream(method, request_serializer=None, response_deserializer=None)(timeout=10)
    errors: list[str] = []
    try:
        await call.write(payload)
        try:
            up = session_pb2.SessionUp.FromString(payload)
            pending = {op.stream_id for op in up.open}
        except Exception:
            pending = set()
        while pending:
            raw = await call.read()
            if raw is grpc.aio.EOF:
                break
            for item in session_pb2.SessionDown.FromString(raw).items:
                if item.HasField("error"):
                    errors.append(item.error.code)
                    pending.discard(item.stream_id)
                elif item.chunk.finish_reason:
                    pending.discard(item.stream_id)
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code(), [*errors, *(t for t in (_trailer(exc),) if t)]
    return await call.code(), errors


async def send(
    mesh: MiniMesh, channels: dict[str, grpc.aio.Channel], msg: tuple[str, str, str, bytes]
) -> tuple[grpc.StatusCode, list[str]]:
    server, method, kind, payload = msg[0], msg[1], msg[2], bytes(msg[3])
    address = {"worker": mesh.worker_address, "router": mesh.router_address, "frontend": mesh.frontend_grpc}[server]
    if address not in channels:
        channels[address] = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
    ch = channels[address]
    return await {"unary": _unary, "stream": _stream, "bidi": _bidi}[kind](ch, method, payload)


@pytest.fixture(scope="module")
def channels(loop: Loop) -> Iterator[dict[str, grpc.aio.Channel]]:
    chans: dict[str, grpc.aio.Channel] = {}
    yield chans

    async def close() -> None:
        await asyncio.gather(*(c.close() for c in chans.values()))

    loop.run(close())


CODES: dict[str, int] = {}


@fuzz_settings(EXAMPLES)
@given(msg=messages())
def test_no_message_gets_unknown_or_internal(
    loop: Loop,
    fuzz_mesh: MiniMesh,
    channels: dict[str, grpc.aio.Channel],
    tracebacks: TracebackLog,
    msg: tuple[str, str, str, bytes],
) -> None:
    code, errors = loop.run(send(fuzz_mesh, channels, msg))
    CODES[code.name] = CODES.get(code.name, 0) + 1
    assert code not in BAD_CODES, f"{msg[1]} {msg[3][:200]!r} -> {code.name} {errors}"
    assert "Unknown" not in errors, f"{msg[1]} {msg[3][:200]!r} -> {code.name} {errors}"


def test_servers_are_healthy_afterwards_and_logged_each_traceback_at_most_once(
    loop: Loop, fuzz_mesh: MiniMesh, channels: dict[str, grpc.aio.Channel], tracebacks: TracebackLog
) -> None:
    assert sum(CODES.values()) >= EXAMPLES, CODES  # the fuzz above ran in this module
    assert CODES.get("INVALID_ARGUMENT", 0) > 150 and CODES.get("OK", 0) > 30, CODES
    ok = generate_pb2.GenerateRequest(request_id="after", model=MODEL, token_ids=[5, 6, 7])
    ok.stop.max_tokens = 4
    for server in ("worker", "router"):
        code, errors = loop.run(
            send(fuzz_mesh, channels, (server, f"/meshllm.v1.{server.title()}/Generate", "stream", ok.SerializeToString()))
        )
        assert code == grpc.StatusCode.OK, (server, code, errors)
    chat = inference_pb2.ChatRequest(model=MODEL, params=inference_pb2.TextParams(max_tokens=4))
    chat.messages.add(role="user", content="hello")
    code, errors = loop.run(
        send(fuzz_mesh, channels, ("frontend", "/meshllm.v1.Inference/ChatCompletion", "stream", chat.SerializeToString()))
    )
    assert code == grpc.StatusCode.OK, errors
    for server in ("worker", "router", "frontend"):
        code, _ = loop.run(send(fuzz_mesh, channels, (server, "/grpc.health.v1.Health/Check", "unary", b"")))
        assert code == grpc.StatusCode.OK
    assert tracebacks.repeated() == []

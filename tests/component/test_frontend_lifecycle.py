"""The frontend in-process: disconnect → cancel, overload → 429, models following discovery, the Inference gRPC API."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
import orjson
import pytest
import pytest_asyncio
from frontend_support import Mesh, request, start_mesh, wait_until

from meshllm.bench.http import Connection, Endpoint
from meshllm.v1 import generate_pb2, inference_pb2, inference_pb2_grpc


@pytest_asyncio.fixture
async def mesh() -> AsyncIterator[Mesh]:
    m = await start_mesh(workers=1, max_inflight=2)
    yield m
    await m.aclose()


def forever(stream: bool = True) -> bytes:
    return orjson.dumps({"model": "echo", "messages": [{"role": "user", "content": "FOREVER"}], "stream": stream})


async def test_a_client_disconnect_mid_stream_cancels_the_engine_request_within_one_second(mesh: Mesh) -> None:
    """Locks: closing the HTTP connection cancels handler → router → worker call; the engine sees the stop < 1 s later."""
    conn = Connection(Endpoint.parse(mesh.url))
    resp = await conn.post("/chat/completions", forever())
    assert resp.status == 200
    events = resp.events()
    for _ in range(3):
        await anext(events)
    engine = mesh.engines[0]
    assert len(engine.started) == 1 and not engine.stops
    await events.aclose()
    await conn.close()
    closed_at = time.monotonic()
    await wait_until(lambda: bool(engine.stops), timeout_s=10)
    ((_rid, seen_at),) = engine.stops.items()
    assert seen_at - closed_at < 1.0, f"the engine saw the cancel {seen_at - closed_at:.3f}s after the disconnect"
    await wait_until(lambda: mesh.frontend.core is not None and mesh.frontend.core.inflight == 0)
    assert not mesh.workers[0].servicer.inflight  # type: ignore[union-attr]


async def test_non_streaming_disconnect_cancels_too(mesh: Mesh) -> None:
    conn = Connection(Endpoint.parse(mesh.url))
    engine = mesh.engines[0]
    await conn._connect()
    assert conn._writer is not None
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    conn._writer.write(head + b"Content-Length: %d\r\n\r\n" % len(forever(False)) + forever(False))
    await wait_until(lambda: bool(engine.started))
    await conn.close()
    await wait_until(lambda: bool(engine.stops), timeout_s=10)


async def test_overload_answers_429_with_retry_after_and_recovers(mesh: Mesh) -> None:
    """Locks: --max-inflight bounds admission; the refusal is an OpenAI error with Retry-After; capacity comes back."""
    conns = [Connection(Endpoint.parse(mesh.url)) for _ in range(2)]
    streams = []
    for c in conns:
        resp = await c.post("/chat/completions", forever())
        events = resp.events()
        await anext(events)
        streams.append(events)
    r = await request(mesh.url, "/v1/chat/completions", forever(False))
    assert r.status == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    for s, c in zip(streams, conns, strict=True):
        await s.aclose()
        await c.close()
    await wait_until(lambda: mesh.frontend.core is not None and mesh.frontend.core.inflight == 0)
    ok = await request(mesh.url, "/v1/completions", {"model": "echo", "prompt": "ECHO:ok"})
    assert ok.status == 200


async def test_models_follow_model_cards_as_workers_come_and_go(mesh: Mesh) -> None:
    """Locks: /v1/models and ListModels list a model while a worker publishes its card, and drop it after."""
    registry = mesh.frontend.registry
    assert registry is not None
    extra = await mesh.add_worker("echo2")
    await registry.wait_for("echo2", timeout_s=10)
    models = (await request(mesh.url, "/v1/models", None, method="GET")).json()
    assert sorted(m["id"] for m in models["data"]) == ["echo", "echo2"]
    await extra.aclose()
    await wait_until(lambda: [m.name for m in registry.list()] == ["echo"])
    models = (await request(mesh.url, "/v1/models", None, method="GET")).json()
    assert [m["id"] for m in models["data"]] == ["echo"]


async def test_inference_grpc_api_streams_text_with_the_http_semantics(mesh: Mesh) -> None:
    """Locks: ChatCompletion / Completion stream TextChunks ending with finish reason + usage; errors are statuses."""
    address = mesh.frontend.grpc_address
    assert address is not None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        listed = await stub.ListModels(inference_pb2.ListModelsRequest())
        assert [(m.id, m.context_length, m.instances) for m in listed.models] == [("echo", 512, 1)]
        chunks = [
            c
            async for c in stub.ChatCompletion(
                inference_pb2.ChatRequest(
                    model="echo",
                    messages=[inference_pb2.ChatMessage(role="user", content="ECHO:héllo STOP no")],
                    params=inference_pb2.TextParams(stop=["STOP"], temperature=0.5),
                )
            )
        ]
        assert "".join(c.text for c in chunks) == "héllo "
        assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_STOP and chunks[-1].usage.prompt_tokens > 0
        assert len({c.request_id for c in chunks}) == 1 and chunks[0].request_id
        chunks = [c async for c in stub.Completion(inference_pb2.CompletionRequest(model="echo", prompt="ECHO:abc"))]
        assert "".join(c.text for c in chunks) == "abc" and chunks[-1].usage.completion_tokens == 4
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Completion(inference_pb2.CompletionRequest(model="nope", prompt="x")):
                pass
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as info:
            params = inference_pb2.TextParams(temperature=5)
            async for _ in stub.Completion(inference_pb2.CompletionRequest(model="echo", prompt="x", params=params)):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in (info.value.details() or "")


async def test_shutdown_refuses_new_requests_and_is_idempotent() -> None:
    m = await start_mesh(workers=1)
    core = m.frontend.core
    assert core is not None
    await m.frontend.aclose()
    await m.frontend.aclose()
    assert not core.admitting
    await m.aclose()

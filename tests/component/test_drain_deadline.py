"""At a drain deadline open streams end with an error the client sees, not a cut (issue 14).

Frontend: an SSE stream gets an OpenAI-shaped error event and `[DONE]`; an
Inference gRPC stream ends with UNAVAILABLE and a message. Worker: a request
stopped at its drain deadline ends with EngineShutdown (UNAVAILABLE), not a
"cancelled" terminal that reads as a normal end, so a router can migrate it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import orjson
from frontend_support import PLANE, EchoEngine, start_mesh

from meshllm import errors
from meshllm.bench.http import Connection, Endpoint
from meshllm.engine.base import TokenChunk
from meshllm.engine.worker_config import WorkerConfig
from meshllm.frontend.text.builtin_tokenizer import BYTE_OFFSET
from meshllm.plane.request.channels import ChannelCache
from meshllm.v1 import inference_pb2, inference_pb2_grpc
from meshllm.worker.client import WorkerClient
from meshllm.worker.runtime import Worker

FOREVER = orjson.dumps({"model": "echo", "messages": [{"role": "user", "content": "FOREVER"}], "stream": True})


async def test_frontend_drain_deadline_ends_open_streams_with_an_error_event_and_a_status() -> None:
    mesh = await start_mesh(workers=1)
    fe = mesh.frontend
    fe.drain_timeout_s = 0.5
    conn = Connection(Endpoint.parse(mesh.url))
    assert fe.grpc_address is not None
    channel = grpc.aio.insecure_channel(fe.grpc_address)
    try:
        resp = await conn.post("/chat/completions", FOREVER)
        assert resp.status == 200
        events = resp.events()
        for _ in range(3):
            await anext(events)
        call = inference_pb2_grpc.InferenceStub(channel).ChatCompletion(
            inference_pb2.ChatRequest(model="echo", messages=[inference_pb2.ChatMessage(role="user", content="FOREVER")])
        )
        await call.read()  # the gRPC stream is under way too
        t0 = time.monotonic()
        closing = asyncio.ensure_future(fe.aclose())
        async with asyncio.timeout(15):
            rest = [e async for e in events]
            with contextlib.suppress(grpc.aio.AioRpcError):
                while await call.read() is not grpc.aio.EOF:
                    pass  # text until the deadline
            status = await call.code()
        assert rest[-1] == b"[DONE]", rest[-3:]
        error = orjson.loads(rest[-2])["error"]
        assert "drain deadline" in error["message"] and error["type"] == "service_unavailable_error", error
        assert all(b'"error"' not in e for e in rest[:-2])  # streamed text until the deadline, one error at its end
        assert status == grpc.StatusCode.UNAVAILABLE and "drain deadline" in (await call.details() or "")
        assert 0.4 < time.monotonic() - t0 < 10
        async with asyncio.timeout(15):
            await closing
        assert "drain" in fe.shutdown.completed
    finally:
        await channel.close()
        await conn.close()
        await mesh.aclose()


async def test_a_worker_ends_requests_stopped_at_its_drain_deadline_with_engine_shutdown() -> None:
    config = WorkerConfig(engine="echo", plane=PLANE, grace_period_s=0.0, drain_timeout_s=0.3)
    worker = await Worker.start(EchoEngine(), config)
    try:
        async with ChannelCache() as channels:
            stream: AsyncIterator[TokenChunk] = WorkerClient(channels, worker.address).generate(
                {"request_id": "long", "token_ids": [ord(c) + BYTE_OFFSET for c in "FOREVER"]}
            )
            first = await anext(stream)
            assert first.get("token_ids")
            closing = asyncio.ensure_future(worker.aclose())
            got: list[TokenChunk] = []
            async with asyncio.timeout(15):
                try:
                    async for chunk in stream:
                        got.append(chunk)
                    raise AssertionError(f"the stream ended normally: {got[-1:]}")
                except errors.EngineShutdown as exc:
                    assert "drain deadline" in exc.message
                await closing
        assert all("finish_reason" not in c for c in got)
    finally:
        await worker.aclose()

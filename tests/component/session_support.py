"""Shared by the Generate session tests: a scripted session servicer on a real server, and stream helpers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from meshllm.config import ServerConfig
from meshllm.engine.base import terminal
from meshllm.plane.session import SessionClient, SessionHandler, SessionServer
from meshllm.plane.transport import CallInfo, ChannelCache, GrpcServer, ServiceBinding, start_server
from meshllm.protocol.convert import chunk_to_proto, request_from_proto
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.v1 import generate_pb2, session_pb2, worker_pb2_grpc
from meshllm.worker.client import WorkerClient

METHOD = "/meshllm.v1.Worker/Generate"
WAIT_S = 10.0  # upper bound on any single awaited event (a failure, never a pace)


class SessionWorker(worker_pb2_grpc.WorkerServicer):
    """A Worker whose GenerateSession is a SessionServer over a handler the test sets."""

    def __init__(self, handler: SessionHandler, *, min_interval_s: float = 0.0) -> None:
        self.handler = handler
        self.sessions = SessionServer(lambda req, call: self.handler(req, call), METHOD, min_interval_s=min_interval_s)
        self.calls = 0  # GenerateSession calls served

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateChunk]:
        """The same handler as one unary call (what a session stream must be equivalent to)."""
        async for chunk in self.handler(request_from_proto(request), CallInfo.from_context(context)):
            yield chunk_to_proto(chunk)

    async def GenerateSession(
        self, request_iterator: AsyncIterator[session_pb2.SessionUp], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[session_pb2.SessionDown]:
        self.calls += 1
        async for down in self.sessions.serve(request_iterator, context):
            yield down


async def serve(servicer: SessionWorker, *, port: int = 0) -> GrpcServer:
    binding = ServiceBinding("meshllm.v1.Worker", servicer, worker_pb2_grpc.add_WorkerServicer_to_server, servicer.sessions.close)
    return await start_server(ServerConfig(host="127.0.0.1", port=port), [binding])


def unary(channels: ChannelCache, address: str, request: TokenRequest) -> AsyncIterator[TokenChunk]:
    return WorkerClient(channels, address).generate_call(request)


def session_client(channels: ChannelCache, address: str) -> SessionClient:
    return channels.shared(
        address,
        "test-session",
        lambda ch: SessionClient(worker_pb2_grpc.WorkerStub(ch).GenerateSession, f"worker {address}", METHOD),
    )


def req(rid: str, **annotations: str) -> TokenRequest:
    return {"request_id": rid, "token_ids": [1], "annotations": dict(annotations)}


def done(n: int) -> TokenChunk:
    return terminal("length", {"prompt_tokens": 1, "completion_tokens": n, "cached_tokens": 0})


async def collect(stream: AsyncIterator[TokenChunk]) -> list[TokenChunk]:
    return [c async for c in stream]


async def close(stream: AsyncIterator[TokenChunk]) -> None:
    """Drop a stream the way a consumer that stops reading does."""
    assert isinstance(stream, AsyncGenerator)
    await stream.aclose()


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.get("token_ids", ())]


def assert_one_terminal_last(chunks: list[TokenChunk]) -> None:
    assert [("finish_reason" in c) for c in chunks].count(True) == 1
    assert "finish_reason" in chunks[-1]


async def counted(n: int, base: int = 0) -> AsyncIterator[TokenChunk]:
    for i in range(n):
        await asyncio.sleep(0)  # an engine step: lets other streams and the writer run
        yield {"token_ids": [base + i]}
    yield done(n)

"""Shared by the Generate session tests: a scripted session servicer on a real server, and stream helpers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from meshllm.config import ServerConfig
from meshllm.engine.base import terminal
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.server import GrpcServer, ServiceBinding, start_server
from meshllm.plane.request.session import SessionClient, SessionHandler, SessionServer
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.convert import chunk_to_proto, request_from_proto
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.v1 import generate_pb2, session_pb2, worker_pb2_grpc
from meshllm.worker.client import WorkerClient

METHOD = "/meshllm.v1.Worker/Generate"
WAIT_S = 10.0  # upper bound on any single awaited event (a failure, never a pace)


# How the tests' sessions travel: "grpc" (GenerateSession calls) or "tcp" (plane/request/tcp_session.py). Test modules that
# hold for both carriers parametrize it with the `carrier` fixture below.
CARRIER = ["grpc"]


@pytest.fixture(params=["grpc", "tcp"])
def carrier(request: pytest.FixtureRequest) -> Iterator[str]:
    CARRIER[0] = request.param
    try:
        yield request.param
    finally:
        CARRIER[0] = "grpc"


class _Counted(SessionServer):
    """A SessionServer that counts the sessions it serves, whichever carrier brings them."""

    calls = 0

    def serve(self, request_iterator: Any, context: Any, **carrier: Any) -> AsyncIterator[session_pb2.SessionDown]:
        self.calls += 1
        return super().serve(request_iterator, context, **carrier)


class SessionWorker(worker_pb2_grpc.WorkerServicer):
    """A Worker whose GenerateSession is a SessionServer over a handler the test sets."""

    def __init__(self, handler: SessionHandler, *, min_interval_s: float = 0.0) -> None:
        self.handler = handler
        self.sessions = _Counted(lambda req, call: self.handler(req, call), METHOD, min_interval_s=min_interval_s)

    @property
    def calls(self) -> int:
        """Sessions served (GenerateSession calls, or TCP session connections)."""
        return self.sessions.calls

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateChunk]:
        """The same handler as one unary call (what a session stream must be equivalent to)."""
        async for chunk in self.handler(request_from_proto(request), CallInfo.from_context(context)):
            yield chunk_to_proto(chunk)

    async def GenerateSession(
        self, request_iterator: AsyncIterator[session_pb2.SessionUp], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[session_pb2.SessionDown]:
        async for down in self.sessions.serve(request_iterator, context):
            yield down


async def serve(servicer: SessionWorker, *, port: int = 0) -> GrpcServer:
    """A real gRPC server of `servicer`; under the "tcp" carrier it serves its sessions on a TCP port too."""
    tcp = CARRIER[0] == "tcp"
    binding = ServiceBinding(
        "meshllm.v1.Worker", servicer, worker_pb2_grpc.add_WorkerServicer_to_server, servicer.sessions.close,
        sessions=servicer.sessions if tcp else None,
    )  # fmt: skip
    server = await start_server(ServerConfig(host="127.0.0.1", port=port, session_port=0 if tcp else None), [binding])
    if tcp:
        _SESSION_ADDRESSES[server.address] = f"127.0.0.1:{server.session_port}"
    return server


_SESSION_ADDRESSES: dict[str, str] = {}  # a test server's gRPC address → its TCP session address


def unary(channels: ChannelCache, address: str, request: TokenRequest) -> AsyncIterator[TokenChunk]:
    return WorkerClient(channels, address).generate_call(request)


def session_client(channels: ChannelCache, address: str) -> SessionClient:
    """The sessions of `channels` to the test server at `address`, on the carrier of the test."""
    if CARRIER[0] == "tcp":

        def open_call() -> Any:  # each new session where the server serves now (a restarted one: a new port)
            channels.route_sessions(address, _SESSION_ADDRESSES[address])
            make = channels.session_call(address, "Worker")
            assert make is not None
            return make()

        return channels.shared(address, "test-session", lambda ch: SessionClient(open_call, f"worker {address}", METHOD))
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

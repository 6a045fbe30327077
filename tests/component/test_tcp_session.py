"""Generate sessions on TCP (meshllm.plane.request.tcp_session): who may open one, and what a bad peer gets.

The session rules themselves (streams, cancels, errors, merging, server stop, liveness) run on both carriers in
test_session.py, test_session_lifecycle.py and test_session_liveness.py. Here: the mesh token and mutual TLS as the
gRPC server applies them, the caller scope a stream runs under, and connections that break the protocol.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from session_support import METHOD, WAIT_S, SessionWorker, collect, counted, req, tokens_of

from meshllm import errors
from meshllm.certs import DevPki
from meshllm.config import ServerConfig
from meshllm.plane.auth import MeshSecurity, session_scope
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.server import GrpcServer, ServiceBinding, start_server
from meshllm.plane.request.session import SessionClient
from meshllm.plane.request.tcp_frames import HEADER, HELLO, UP
from meshllm.plane.request.tcp_session import TcpCall
from meshllm.plane.request.transport import CallInfo
from meshllm.plane.tls import TlsConfig
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.v1 import worker_pb2_grpc

TOKEN = "a-mesh-token-of-32-characters-xx"


def scoped_worker(seen: list[str]) -> SessionWorker:
    async def handler(request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        seen.append(session_scope.get() or "")
        async for chunk in counted(3):
            yield chunk

    return SessionWorker(handler)


async def serve_tcp(servicer: SessionWorker, security: MeshSecurity | None = None) -> GrpcServer:
    binding = ServiceBinding(
        "meshllm.v1.Worker", servicer, worker_pb2_grpc.add_WorkerServicer_to_server, servicer.sessions.close,
        sessions=servicer.sessions,
    )  # fmt: skip
    return await start_server(ServerConfig(host="127.0.0.1", port=0, session_port=0), [binding], security=security)


def client(channels: ChannelCache, srv: GrpcServer) -> SessionClient:
    channels.route_sessions(srv.address, f"127.0.0.1:{srv.session_port}")
    make = channels.session_call(srv.address, "Worker")
    assert make is not None
    return SessionClient(make, f"worker {srv.address}", METHOD)


# ---------------------------------------------------------------- the mesh token


async def test_the_mesh_token_is_required_and_a_session_with_it_runs_under_the_token_scope() -> None:
    seen: list[str] = []
    servicer = scoped_worker(seen)
    async with await serve_tcp(servicer, MeshSecurity(token=TOKEN)) as srv:
        async with ChannelCache() as plain:
            with pytest.raises(errors.FailedPrecondition, match="mesh token"):
                await asyncio.wait_for(collect(client(plain, srv).generate(req("no-token"))), WAIT_S)
        async with ChannelCache(security=MeshSecurity(token=TOKEN.replace("x", "y"))) as wrong:
            with pytest.raises(errors.FailedPrecondition, match="mesh token"):
                await asyncio.wait_for(collect(client(wrong, srv).generate(req("wrong-token"))), WAIT_S)
        assert seen == []  # neither reached the handler
        async with ChannelCache(security=MeshSecurity(token=TOKEN)) as mesh:
            chunks = await asyncio.wait_for(collect(client(mesh, srv).generate(req("ok"))), WAIT_S)
        assert tokens_of(chunks) == [0, 1, 2]
        assert len(seen) == 1 and seen[0].startswith("token/") and len(seen[0]) > len("token/")


# ---------------------------------------------------------------- mutual TLS


async def test_mutual_tls_admits_mesh_certificates_only_and_scopes_streams_by_certificate(tmp_path: Path) -> None:
    ca = DevPki.create(tmp_path / "mesh")
    worker, frontend = ca.issue("worker"), ca.issue("frontend")
    stranger = DevPki.create(tmp_path / "other").issue("frontend")
    seen: list[str] = []
    servicer = scoped_worker(seen)
    server_sec = MeshSecurity(tls=TlsConfig(cert=worker.cert, key=worker.key, ca=worker.ca))
    async with await serve_tcp(servicer, server_sec) as srv:
        good = MeshSecurity(tls=TlsConfig(cert=frontend.cert, key=frontend.key, ca=frontend.ca))
        async with ChannelCache(security=good) as channels:
            chunks = await asyncio.wait_for(collect(client(channels, srv).generate(req("mtls"))), WAIT_S)
        assert tokens_of(chunks) == [0, 1, 2]
        assert len(seen) == 1 and seen[0].startswith("cert:") and "frontend" in seen[0], seen

        # Refused before any stream: failures the router treats as a peer it cannot reach (Unavailable).
        async with ChannelCache() as plaintext:
            with pytest.raises(errors.Unavailable):
                await asyncio.wait_for(collect(client(plaintext, srv).generate(req("plain"))), WAIT_S)
        foreign = MeshSecurity(tls=TlsConfig(cert=stranger.cert, key=stranger.key, ca=frontend.ca))
        async with ChannelCache(security=foreign) as channels:
            with pytest.raises(errors.Unavailable):
                await asyncio.wait_for(collect(client(channels, srv).generate(req("foreign"))), WAIT_S)
        assert len(seen) == 1


# ---------------------------------------------------------------- peers that break the protocol


async def raw_exchange(port: int, data: bytes) -> bytes:
    """Send `data` on a fresh connection and read until the server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()


@pytest.mark.parametrize(
    "data",
    [
        HEADER.pack(UP, 0),  # a session message before the hello
        HEADER.pack(HELLO, 9) + b"not json!",
        HEADER.pack(HELLO, 24) + b'{"service": "Elsewhere"}',
        HEADER.pack(99, 0),  # no such frame kind
        struct.pack("<BI", HELLO, 2**31),  # a frame over the size limit
    ],
    ids=["up-first", "bad-hello", "unknown-service", "unknown-kind", "oversized"],
)
async def test_a_connection_that_breaks_the_protocol_is_closed_and_the_server_keeps_serving(data: bytes) -> None:
    seen: list[str] = []
    async with await serve_tcp(scoped_worker(seen)) as srv:
        assert srv.session_port is not None
        await raw_exchange(srv.session_port, data)  # returns: the server closed the connection
        async with ChannelCache() as channels:
            chunks = await asyncio.wait_for(collect(client(channels, srv).generate(req("after"))), WAIT_S)
        assert tokens_of(chunks) == [0, 1, 2] and len(seen) == 1


async def test_a_hello_naming_a_service_not_served_there_fails_the_stream_with_invalid_argument() -> None:
    async with await serve_tcp(scoped_worker([])) as srv:
        assert srv.session_port is not None
        call = TcpCall(f"127.0.0.1:{srv.session_port}", "Router", caller="test")
        session = SessionClient(lambda: call, "router", "/meshllm.v1.Router/Generate")
        try:
            with pytest.raises(errors.InvalidArgument, match="no service 'Router'"):
                await asyncio.wait_for(collect(session.generate(req("r"))), WAIT_S)
        finally:
            await session.aclose()


async def test_nothing_listening_on_the_session_port_fails_fast_as_cannot_connect() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        session = SessionClient(lambda: TcpCall(f"127.0.0.1:{port}", "Worker", caller="test"), "worker", METHOD)
        try:
            with pytest.raises(errors.CannotConnect) as info:
                await asyncio.wait_for(collect(session.generate(req("r"))), WAIT_S)
            assert info.value.from_transport
        finally:
            await session.aclose()

"""Which way a Generate stream goes to a peer: straight to it in this process, or over the process's session to it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.local import LocalPeers
from meshllm.plane.request.session_client import SessionClient
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.v1 import session_pb2

__all__ = ["generate_to", "session_key"]


def session_key(service: str) -> str:
    """The `ChannelCache.shared` key of a process's session to a `service` ("Worker", "Router")."""
    return f"{service.lower()}-session"


def generate_to(
    channels: ChannelCache,
    address: str,
    service: str,
    request: TokenRequest,
    call: CallInfo | None = None,
) -> AsyncIterator[TokenChunk]:
    """One Generate stream to `meshllm.v1.<service>` at `address`.

    A peer living in this very process (`channels.local`, meshllm run) is
    called directly (plane/request/local.py); any other goes over the process's one
    GenerateSession call to it. `call.relay` becomes `SessionClient.generate`'s
    relay: a session stream hands it the non-terminal chunks; a local one has
    none to save (no reader task stands between) and yields every chunk.
    """
    info = call or CallInfo()
    local: LocalPeers | None = channels.local
    peer = local.get(address) if local is not None else None
    if peer is not None:
        return peer.generate(request, info.relaying(None))  # its chunks pass through plane/request/local.py's pacing

    def make(channel: grpc.aio.Channel) -> SessionClient:
        grpc_call = channel.stream_stream(
            f"/meshllm.v1.{service}/GenerateSession",
            request_serializer=session_pb2.SessionUp.SerializeToString,
            response_deserializer=session_pb2.SessionDown.FromString,
        )

        def open_call() -> Any:
            # Each new session (the first, or the next after a break) goes where the peer serves them now.
            tcp = channels.session_call(address, service)
            return tcp() if tcp is not None else grpc_call()

        peer, method = f"{service.lower()} {address}", f"/meshllm.v1.{service}/Generate"
        return SessionClient(open_call, peer, method, liveness=channels.liveness)

    session = channels.shared(address, session_key(service), make)
    return session.generate(request, traceparent=info.traceparent, deadline=info.deadline, relay=info.relay)

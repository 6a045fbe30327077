"""Which way a Generate stream goes to a peer: straight to it in this process, or over the process's session to it;
and `PeerClient`, the Generate calls the router and worker clients share."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar

import grpc

from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.local import LocalPeers
from meshllm.plane.request.session_client import SessionClient
from meshllm.plane.request.transport import CallInfo, unary_generate
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.v1 import session_pb2

__all__ = ["PeerClient", "generate_to", "session_key"]


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


class PeerClient:
    """Client of one address serving `service` ("Router", "Worker") over a shared ChannelCache: its Generate streams;
    a subclass adds the service's other calls on `_stub` (a `stub_class` on the address's channel)."""

    service: ClassVar[str]
    stub_class: ClassVar[type[Any]]  # the generated `<Service>Stub`

    def __init__(self, channels: ChannelCache, address: str) -> None:
        self.address = address
        self._channels = channels
        self._stub = self.stub_class(channels.get(address))

    def generate(self, request: TokenRequest, *, call: CallInfo | None = None) -> AsyncIterator[TokenChunk]:
        """Stream chunks, then one terminal: in process or over the process's session to this peer (`generate_to`;
        a session stream may hand its non-terminal chunks to `call.relay`)."""
        return generate_to(self._channels, self.address, self.service, request, call)

    def generate_call(self, request: TokenRequest, *, call: CallInfo | None = None) -> AsyncIterator[TokenChunk]:
        """The same stream as one unary Generate call of its own (what non-meshllm clients use)."""
        return unary_generate(self._stub.Generate, request, call, f"{self.service.lower()} {self.address}")

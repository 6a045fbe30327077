"""Typed async client of the Router service: what frontends and tests import.

`RouterClient.generate` has the same signature as `RouterCore.generate`, so a
frontend can use either (remote router or embedded core). Chunks and
requests are the internal TypedDicts; errors are `meshllm.errors` classes
(the class the router raised). Dropping a `generate` iterator cancels the
gRPC call, and with it the worker call behind the router.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from meshllm.plane.session import SessionClient
from meshllm.plane.transport import CallInfo, ChannelCache, generate_stream, translate_errors
from meshllm.protocol.convert import request_to_proto
from meshllm.protocol.types import GenerateChunk, GenerateRequest, RoutingHints
from meshllm.v1 import router_pb2, router_pb2_grpc

__all__ = ["RouterClient"]

SESSION = "router-session"


def _session_of(address: str) -> Callable[[grpc.aio.Channel], SessionClient]:
    return lambda channel: SessionClient(
        router_pb2_grpc.RouterStub(channel).GenerateSession, f"router {address}", "/meshllm.v1.Router/Generate"
    )


class RouterClient:
    """Client of one router address over a shared ChannelCache."""

    def __init__(self, channels: ChannelCache, address: str) -> None:
        self.address = address
        self._channels = channels
        self._stub = router_pb2_grpc.RouterStub(channels.get(address))

    def generate(self, request: GenerateRequest, *, call: CallInfo | None = None) -> AsyncIterator[GenerateChunk]:
        """Stream chunks, then one terminal, over the process's one session to this router (plane/session.py)."""
        session = self._channels.shared(self.address, SESSION, _session_of(self.address))
        info = call or CallInfo()
        return session.generate(request, traceparent=info.traceparent, deadline=info.deadline)

    async def generate_call(self, request: GenerateRequest, *, call: CallInfo | None = None) -> AsyncIterator[GenerateChunk]:
        """The same stream as one unary Generate call of its own (what non-meshllm clients use)."""
        info = call or CallInfo()
        rpc = self._stub.Generate(request_to_proto(request), metadata=info.metadata(), timeout=info.timeout())
        async for chunk in generate_stream(rpc, f"router {self.address}"):
            yield chunk

    async def route(
        self, model: str, token_ids: Sequence[int], hints: RoutingHints | None = None, role: int | None = None
    ) -> router_pb2.RouteDecision:
        """Which worker would serve this prompt, and why (nothing is sent)."""
        req = router_pb2.RouteRequest(model=model, token_ids=token_ids, role=role or 0)  # type: ignore[arg-type]
        if hints:
            req.routing.CopyFrom(request_to_proto({"request_id": "", "token_ids": [], "routing": hints}).routing)
        return await translate_errors(self._stub.Route(req))

    async def list_workers(self, model: str | None = None) -> router_pb2.ListWorkersResponse:
        return await translate_errors(self._stub.ListWorkers(router_pb2.ListWorkersRequest(model=model or "")))

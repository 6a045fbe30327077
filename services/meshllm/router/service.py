"""The Router gRPC servicer: `meshllm.v1.Router` over a `RouterCore`.

Requests are converted once, here, at the edge (`meshllm.protocol.convert`);
errors raised by the core cross the wire through the transport's one error
mapping (status + `meshllm-error` trailer). A gRPC cancel cancels the
handler, which closes the core's stream, which cancels the worker call.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import cast

import grpc

from meshllm.plane.session import DEFAULT_INTERVAL_S, SessionServer
from meshllm.plane.transport import CallInfo, ServiceBinding
from meshllm.protocol.convert import chunk_to_proto, request_from_proto
from meshllm.protocol.types import GenerateChunk, RoutingHints
from meshllm.router.core import RouterCore
from meshllm.v1 import generate_pb2, router_pb2, router_pb2_grpc, session_pb2

__all__ = ["RouterServicer", "hints_from_proto", "router_binding"]


def hints_from_proto(m: generate_pb2.RoutingHints) -> RoutingHints:
    """RoutingHints proto → internal (through the request converter, so there is one mapping)."""
    return request_from_proto(generate_pb2.GenerateRequest(routing=m)).get("routing", {})


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Serves one RouterCore."""

    def __init__(self, core: RouterCore, *, stream_interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.core = core
        self.sessions = SessionServer(
            lambda req, call: core.generate(req, call=call), "/meshllm.v1.Router/Generate", min_interval_s=stream_interval_s
        )

    async def GenerateSession(
        self, request_iterator: AsyncIterator[session_pb2.SessionUp], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[session_pb2.SessionDown]:
        async for down in self.sessions.serve(request_iterator, context):
            yield down

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateChunk]:
        stream = cast(
            AsyncGenerator[GenerateChunk, None],
            self.core.generate(request_from_proto(request), call=CallInfo.from_context(context)),
        )
        try:
            async for chunk in stream:
                yield chunk_to_proto(chunk)
        finally:
            await stream.aclose()  # a cancel reaches the worker call now, not at garbage collection

    async def Route(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext) -> router_pb2.RouteDecision:
        hints = hints_from_proto(request.routing) if request.HasField("routing") else None
        return await self.core.route(request.model, list(request.token_ids), hints, request.role or None)

    async def ListWorkers(
        self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListWorkersResponse:
        return self.core.list_workers(request.model or None)


def router_binding(core: RouterCore, *, stream_interval_s: float = DEFAULT_INTERVAL_S) -> ServiceBinding:
    """The Router service over `core`, ready for `start_server` (its sessions end before the server stops)."""
    servicer = RouterServicer(core, stream_interval_s=stream_interval_s)
    return ServiceBinding("meshllm.v1.Router", servicer, router_pb2_grpc.add_RouterServicer_to_server, servicer.sessions.close)

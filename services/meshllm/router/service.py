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

from meshllm.errors import InvalidArgument
from meshllm.plane.request.server import ServiceBinding
from meshllm.plane.request.session import DEFAULT_INTERVAL_S, SessionServer
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.convert import chunk_to_proto, hints_from_proto, request_from_proto
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.protocol.validate import Limits, validate_generate, validate_prompt
from meshllm.router.core import RouterCore
from meshllm.v1 import discovery_pb2, generate_pb2, router_pb2, router_pb2_grpc, session_pb2

__all__ = ["RouterServicer", "router_binding"]

_ROLES = frozenset(discovery_pb2.WorkerRole.values())


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Serves one RouterCore."""

    def __init__(self, core: RouterCore, *, stream_interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.core = core
        self.sessions = SessionServer(self.generate, "/meshllm.v1.Router/Generate", min_interval_s=stream_interval_s, relays=True)

    def _limits(self, model: str) -> Limits:
        card = self.core.pool.card(model)
        return Limits(context_length=card.context_length) if card is not None else Limits()

    def generate(self, request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        """One validated request through the core; a GenerateSession stream's worker chunks go to `call.relay`.

        Validates at the call (both callers turn the error into the stream's) and returns the core's
        stream itself: no extra generator layer per chunk.
        """
        validate_generate(request, self._limits(self.core.resolve_model(request.get("model", ""))))
        return self.core.generate(request, call=call)

    async def GenerateSession(
        self, request_iterator: AsyncIterator[session_pb2.SessionUp], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[session_pb2.SessionDown]:
        async for down in self.sessions.serve(request_iterator, context):
            yield down

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateChunk]:
        stream = cast(
            AsyncGenerator[TokenChunk, None],
            self.generate(request_from_proto(request), CallInfo.from_context(context)),
        )
        try:
            async for chunk in stream:
                yield chunk_to_proto(chunk)
        finally:
            await stream.aclose()  # a cancel reaches the worker call now, not at garbage collection

    async def Route(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext) -> router_pb2.RouteDecision:
        hints = hints_from_proto(request.routing) if request.HasField("routing") else None
        if request.role not in _ROLES:
            raise InvalidArgument(f"'role': unknown value {request.role}", param="role")
        model = self.core.resolve_model(request.model)
        validate_prompt(request.token_ids, self._limits(model))  # what Generate would refuse is not scored
        return await self.core.route(model, list(request.token_ids), hints, request.role or None)

    async def ListWorkers(
        self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListWorkersResponse:
        return self.core.list_workers(request.model or None)


def router_binding(core: RouterCore, *, stream_interval_s: float = DEFAULT_INTERVAL_S) -> ServiceBinding:
    """The Router service over `core`, ready for `start_server` (its sessions end before the server stops)."""
    servicer = RouterServicer(core, stream_interval_s=stream_interval_s)
    return ServiceBinding(
        "meshllm.v1.Router",
        servicer,
        router_pb2_grpc.add_RouterServicer_to_server,
        servicer.sessions.close,
        sessions=servicer.sessions,  # served on TCP too when the server config has a session port
    )

"""Typed async client of the Router service: what frontends and tests import.

`RouterClient.generate` has the same signature as `RouterCore.generate`, so a
frontend can use either (remote router or embedded core). Chunks and
requests are the internal TypedDicts; errors are `meshllm.errors` classes
(the class the router raised). Dropping a `generate` iterator cancels the
stream, and with it the worker stream behind the router.

`reachable()` and `wait_reachable()` tell a router that answered (an error
of its own, e.g. no live worker) from one that cannot be reached (down,
restarting): the frontend's replica failover (`meshllm.frontend.upstream`)
waits for the latter only.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from meshllm.plane.request.peers import PeerClient, session_key
from meshllm.plane.request.transport import translate_errors
from meshllm.protocol.convert import hints_into_proto, wire_range
from meshllm.protocol.types import RouteHints
from meshllm.v1 import router_pb2, router_pb2_grpc

__all__ = ["RouterClient"]

SESSION = session_key("Router")


class RouterClient(PeerClient):
    """Client of one router address over a shared ChannelCache."""

    service = "Router"
    stub_class = router_pb2_grpc.RouterStub

    def reachable(self) -> bool:
        """Whether a connection to this router is up now (always true for a router in this process)."""
        if self._channels.local is not None and self._channels.local.get(self.address) is not None:
            return True
        return self._channels.get(self.address).get_state() is grpc.ChannelConnectivity.READY

    async def wait_reachable(self) -> None:
        """Return once a connection to this router is up (connecting as needed); callers bound it with a timeout."""
        if self.reachable():
            return
        await self._channels.get(self.address).channel_ready()

    async def route(
        self, model: str, token_ids: Sequence[int], hints: RouteHints | None = None, role: int | None = None
    ) -> router_pb2.RouteDecision:
        """Which worker would serve this prompt, and why (nothing is sent)."""
        req = router_pb2.RouteRequest(model=model, token_ids=token_ids, role=role or 0)  # type: ignore[arg-type]
        if hints:
            with wire_range():
                hints_into_proto(req.routing, hints)
        return await translate_errors(self._stub.Route(req))

    async def list_workers(self, model: str | None = None) -> router_pb2.ListWorkersResponse:
        return await translate_errors(self._stub.ListWorkers(router_pb2.ListWorkersRequest(model=model or "")))

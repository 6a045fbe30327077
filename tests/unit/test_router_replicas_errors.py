"""`RouterReplicas` tells a replica that is gone from one that answered with an error of its own.

A call can fail with gRPC's bare UNAVAILABLE ("Stream removed ... Connection
reset by peer") while its channel still reports itself connected: the replica
is going away. No meshllm server sent that status (it has no meshllm error
trailer), so the request waits for a replica, bounded by `wait_s`, instead of
failing at once with the transport's raw message. An `Unavailable` a router
sent itself (no live worker) still fails at once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from meshllm.errors import MeshError, Unavailable
from meshllm.frontend.upstream import RouterReplicas
from meshllm.plane.request.transport import ERROR_TRAILER, CallInfo, mesh_error
from meshllm.protocol.types import TokenChunk, TokenRequest


def rpc_error(details: str, trailer: str | None) -> AioRpcError:
    trailing = Metadata((ERROR_TRAILER, trailer)) if trailer else Metadata()
    return AioRpcError(grpc.StatusCode.UNAVAILABLE, Metadata(), trailing, details=details)


def test_a_status_without_the_meshllm_trailer_is_marked_as_from_the_transport() -> None:
    bare = mesh_error(rpc_error("Stream removed (sendmsg: Connection reset by peer)", None))
    own = mesh_error(rpc_error("no live worker serves model m", "Unavailable"))
    assert isinstance(bare, Unavailable) and bare.from_transport
    assert isinstance(own, Unavailable) and not own.from_transport
    assert own.message == "no live worker serves model m"


class Refusing:
    """A replica whose channel is up and whose every call fails with `error`."""

    address = "127.0.0.1:1"

    def __init__(self, error: MeshError) -> None:
        self.error = error
        self.calls = 0

    async def generate(self, request: TokenRequest, *, call: CallInfo | None = None) -> AsyncIterator[TokenChunk]:
        self.calls += 1
        raise self.error
        yield  # an async generator

    def reachable(self) -> bool:
        return True

    async def wait_reachable(self) -> None:
        return None


REQUEST: TokenRequest = {"request_id": "r1", "model": "m", "token_ids": [1, 2, 3], "max_tokens": 4}


async def first_error(replicas: RouterReplicas) -> tuple[MeshError, float]:
    t0 = time.monotonic()
    with pytest.raises(MeshError) as err:
        async for _ in replicas.generate(REQUEST):
            pass
    return err.value, time.monotonic() - t0


async def test_a_reset_connection_is_waited_out_then_fails_with_the_bound_in_the_message() -> None:
    reset = Unavailable("Stream removed (sendmsg: Connection reset by peer (104))")
    reset.from_transport = True
    replica = Refusing(reset)
    err, took = await first_error(RouterReplicas([replica], wait_s=0.3))
    assert isinstance(err, Unavailable)
    assert err.message.startswith("no router replica could be reached within 0.3 s (127.0.0.1:1)"), err.message
    assert took >= 0.3 and replica.calls >= 2  # it tried again while waiting


async def test_an_unavailable_the_router_sent_itself_fails_at_once() -> None:
    replica = Refusing(Unavailable("no live worker serves model m"))
    err, took = await first_error(RouterReplicas([replica], wait_s=5.0))
    assert isinstance(err, Unavailable) and err.message == "no live worker serves model m"
    assert replica.calls == 1 and took < 1.0

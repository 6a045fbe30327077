"""`meshllm.plane.request.transport.HandlerInterceptor`: the base of the server interceptors (error mapping, mesh token)."""

from __future__ import annotations

from typing import Any

import grpc

from meshllm.plane.auth import TOKEN_HEADER, MeshAuth
from meshllm.plane.request.transport import HandlerInterceptor


class _Details:
    def __init__(self, method: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.method = method
        self.invocation_metadata = metadata


class _Swap(HandlerInterceptor):
    def __init__(self) -> None:
        self.seen: list[tuple[Any, str]] = []

    def intercept(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        self.seen.append((handler, details.method))
        return ("wrapped", handler)


async def test_the_found_handler_goes_through_intercept_and_a_missing_one_stays_none() -> None:
    """Locks: `intercept` sees each call's handler and serves what it returns; an unknown method is left to grpc."""
    found = object()
    swap = _Swap()

    async def known(details: Any) -> Any:
        return found

    async def unknown(details: Any) -> Any:
        return None

    assert await swap.intercept_service(known, _Details("/svc/A")) == ("wrapped", found)
    assert await swap.intercept_service(unknown, _Details("/svc/B")) is None
    assert swap.seen == [(found, "/svc/A")]


async def test_mesh_auth_keeps_the_handler_of_a_call_with_the_token_and_denies_one_without() -> None:
    """Locks: MeshAuth on the base: the token (or a service outside the mesh's) keeps the handler, else it is replaced."""
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    auth = MeshAuth("s3cret", services=("/meshllm.v1.Worker/",))

    async def continuation(details: Any) -> Any:
        return handler

    with_token = _Details("/meshllm.v1.Worker/Generate", ((TOKEN_HEADER, "s3cret"),))
    outside = _Details("/grpc.health.v1.Health/Check")
    without = _Details("/meshllm.v1.Worker/Generate")
    assert await auth.intercept_service(continuation, outside) is handler
    denied = await auth.intercept_service(continuation, without)
    assert denied is not handler and denied.unary_unary is not handler.unary_unary
    assert await auth.intercept_service(continuation, with_token) is handler

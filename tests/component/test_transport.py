"""A real grpc.aio server built by meshllm.plane.request.transport: reflection, health, errors, metadata."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from meshllm import errors
from meshllm.config import ServerConfig
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.server import GrpcServer, ServiceBinding, start_server
from meshllm.plane.request.transport import CallInfo, translate_errors, translate_stream
from meshllm.v1 import generate_pb2, worker_pb2, worker_pb2_grpc


class _Worker(worker_pb2_grpc.WorkerServicer):
    """Raises what the request asks for, to exercise the error mapping."""

    def __init__(self) -> None:
        self.seen: list[CallInfo] = []

    async def GetInfo(self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        self.seen.append(CallInfo.from_context(context))
        return worker_pb2.WorkerInfo(engine_name="t")

    async def Abort(self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> worker_pb2.AbortResponse:
        if request.request_id == "typed":
            raise errors.EngineShutdown("engine is going away")
        if request.request_id == "invalid":
            raise errors.ContextLengthExceeded("prompt too long", param="messages")
        raise ZeroDivisionError("boom")

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateChunk]:
        yield generate_pb2.GenerateChunk(token_ids=[1])
        raise errors.Disconnected("peer went away")


@pytest.fixture
async def server() -> AsyncIterator[tuple[GrpcServer, _Worker]]:
    servicer = _Worker()
    binding = ServiceBinding("meshllm.v1.Worker", servicer, worker_pb2_grpc.add_WorkerServicer_to_server)
    async with await start_server(ServerConfig(port=0), [binding]) as srv:
        yield srv, servicer


async def test_reflection_lists_meshllm_and_health_services(server: tuple[GrpcServer, _Worker]) -> None:
    """Locks: every server answers grpcurl's `list` through reflection, health included."""
    srv, _ = server
    async with grpc.aio.insecure_channel(srv.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = set()
        async for resp in call:
            names |= {s.name for s in resp.list_services_response.service}
    assert {
        "meshllm.v1.Worker",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    } <= names


async def test_health_answers_serving_then_not_serving(server: tuple[GrpcServer, _Worker]) -> None:
    """Locks: health reflects set_serving for the whole server and for each service."""
    srv, _ = server
    async with grpc.aio.insecure_channel(srv.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for svc in ("", "meshllm.v1.Worker"):
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=svc))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        await srv.set_serving(False)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service="meshllm.v1.Worker"))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_typed_errors_cross_the_wire_as_the_same_class(server: tuple[GrpcServer, _Worker]) -> None:
    """Locks: a MeshError raised by a handler is raised again, same class and message, by the client."""
    srv, _ = server
    async with ChannelCache() as channels:
        stub = worker_pb2_grpc.WorkerStub(channels.get(srv.address))
        with pytest.raises(errors.EngineShutdown, match="engine is going away"):
            await translate_errors(stub.Abort(worker_pb2.AbortRequest(request_id="typed")))
        with pytest.raises(errors.ContextLengthExceeded):
            await translate_errors(stub.Abort(worker_pb2.AbortRequest(request_id="invalid")))
        with pytest.raises(errors.Unknown, match="ZeroDivisionError: boom"):
            await translate_errors(stub.Abort(worker_pb2.AbortRequest(request_id="other")))
        got = []
        with pytest.raises(errors.Disconnected):
            async for chunk in translate_stream(stub.Generate(generate_pb2.GenerateRequest())):
                got.extend(chunk.token_ids)
        assert got == [1]


async def test_status_codes_follow_the_error_table(server: tuple[GrpcServer, _Worker]) -> None:
    """Locks: the raw gRPC status is the one ERROR_TABLE names (what grpcurl and other languages see)."""
    srv, _ = server
    async with grpc.aio.insecure_channel(srv.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Abort(worker_pb2.AbortRequest(request_id="invalid"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "prompt too long"


async def test_traceparent_and_deadline_propagate(server: tuple[GrpcServer, _Worker]) -> None:
    """Locks: CallInfo carries traceparent in metadata and the deadline as a timeout."""
    srv, servicer = server
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    async with ChannelCache() as channels:
        stub = worker_pb2_grpc.WorkerStub(channels.get(srv.address))
        info = CallInfo(traceparent=tp)
        await stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=info.metadata(), timeout=30)
    seen = servicer.seen[-1]
    assert seen.traceparent == tp
    assert seen.deadline is not None
    left = seen.timeout()
    assert left is not None and 0 < left <= 31  # gRPC rounds deadlines up slightly


async def test_unreachable_address_is_unavailable() -> None:
    """Locks: a call to nowhere becomes Unavailable, not a raw grpc error."""
    async with ChannelCache() as channels:
        stub = worker_pb2_grpc.WorkerStub(channels.get("127.0.0.1:1"))
        with pytest.raises(errors.Unavailable):
            await translate_errors(stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5))


def test_every_error_class_is_in_the_table() -> None:
    """Locks: one table maps every exception of the tree (no class without a wire mapping)."""
    classes = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.MeshError)}
    assert classes - {errors.MeshError} <= set(errors.ERROR_TABLE)
    body = errors.openai_error_body(errors.InvalidArgument("temperature must be <= 2", param="temperature"))
    assert body == {
        "error": {
            "message": "temperature must be <= 2",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "InvalidArgument",
        }
    }

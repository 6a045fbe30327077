"""gRPC server reflection, `grpc.reflection.v1` and `grpc.reflection.v1alpha`, with methods resolvable.

grpcurl (and other reflection clients) ask for the file that defines a
symbol. grpcio-reflection's servicer asks the descriptor pool's
`FindFileContainingSymbol`, which in the upb protobuf runtime finds
services, messages, fields and enums but not methods, so
`grpcurl describe meshllm.v1.Router.Route` answered NOT_FOUND ("Symbol not
found"). `_Servicer` falls back to `FindMethodByName` for those.

grpcio-reflection ships only the v1alpha service; v1 is the same protocol
under another package name (its messages are wire-identical), so the same
servicer answers both. v1's file descriptor is added to the default pool,
derived from v1alpha's, so that a client can describe v1 too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer
from grpc_reflection.v1alpha._base import _file_descriptor_response, _not_found_error

__all__ = ["V1", "V1ALPHA", "enable_reflection"]

V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
V1 = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


class _Servicer(ReflectionServicer):  # type: ignore[misc]
    """grpcio-reflection's servicer, resolving method symbols too."""

    def _file_containing_symbol(self, request: Any, fully_qualified_name: str) -> Any:
        pool = self._pool
        try:
            file = pool.FindFileContainingSymbol(fully_qualified_name)
        except KeyError:
            try:
                file = pool.FindMethodByName(fully_qualified_name).containing_service.file
            except KeyError:
                return _not_found_error(request)
        return _file_descriptor_response(file, request)


def _add_v1_descriptor(pool: Any) -> None:
    """Register grpc/reflection/v1/reflection.proto in `pool` (v1alpha's file under v1's package) once."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = proto.package, "grpc.reflection.v1"
    proto.name, proto.package = _V1_FILE, new
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(f".{old}."):
                field.type_name = f".{new}." + field.type_name.removeprefix(f".{old}.")
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(f".{old}.", f".{new}.")
            method.output_type = method.output_type.replace(f".{old}.", f".{new}.")
    pool.AddSerializedFile(proto.SerializeToString())


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha on `server`, listing `service_names` and both reflection services."""
    pool = descriptor_pool.Default()
    _add_v1_descriptor(pool)
    servicer = _Servicer([*service_names, V1, V1ALPHA], pool=pool)
    v1alpha_grpc.add_ServerReflectionServicer_to_server(servicer, server)

    async def info(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for response in servicer.ServerReflectionInfo(requests, context):
            yield response

    handler = grpc.stream_stream_rpc_method_handler(
        info,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1, {"ServerReflectionInfo": handler}),))

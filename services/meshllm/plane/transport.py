"""gRPC helpers: the server builder, the channel cache, error mapping, call metadata.

Every meshllm server is built by `start_server`, which always registers
server reflection and the standard `grpc.health.v1` service, and installs the
one server-side error-mapping layer: a `MeshError` raised by a handler becomes
its gRPC status (from `meshllm.errors.ERROR_TABLE`) plus a `meshllm-error`
trailer naming its class; any other exception becomes `Unknown` with its
message. Clients turn an `AioRpcError` back into the same class with
`mesh_error`. W3C `traceparent` and the caller's deadline travel hop by hop
through `CallInfo`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from meshllm.config import ServerConfig
from meshllm.errors import (
    Cancelled,
    MeshError,
    ResponseTimeout,
    StreamIncomplete,
    Unknown,
    error_from_status,
    spec_of,
)
from meshllm.lifecycle import AsyncCloseable
from meshllm.protocol.convert import chunk_from_proto, request_to_proto
from meshllm.protocol.types import GenerateChunk, GenerateRequest
from meshllm.tracing import otel_active

if TYPE_CHECKING:
    from meshllm.plane.local import LocalPeers

__all__ = [
    "DEFAULT_STREAM_INTERVAL_S",
    "ERROR_TRAILER",
    "TRACEPARENT",
    "CallInfo",
    "ChannelCache",
    "GenerateHandler",
    "GrpcServer",
    "ServiceBinding",
    "abort_with",
    "channel_options",
    "generate_stream",
    "mesh_error",
    "start_server",
    "translate_errors",
    "translate_stream",
    "unary_generate",
]

log = logging.getLogger(__name__)

ERROR_TRAILER = "meshllm-error"
TRACEPARENT = "traceparent"
T = TypeVar("T")
S = TypeVar("S", bound=AsyncCloseable)


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Channel and server options shared by both sides."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


# ---------------------------------------------------------------- errors


async def abort_with(context: grpc.aio.ServicerContext, err: MeshError) -> None:
    """End the RPC with the status of `err` and the trailer naming its class."""
    await context.abort(spec_of(err).grpc_status, err.message, trailing_metadata=((ERROR_TRAILER, err.code),))


def mesh_error(exc: grpc.aio.AioRpcError) -> MeshError:
    """The MeshError a failed call stands for (same class as the server raised)."""
    code = None
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_TRAILER:
            code = value if isinstance(value, str) else value.decode()
    return error_from_status(exc.code(), exc.details() or exc.code().name, code)


async def translate_errors(call: Awaitable[T]) -> T:
    """Await a unary call, raising MeshError instead of AioRpcError."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise mesh_error(exc) from None


async def generate_stream(rpc: Any, peer: str) -> AsyncIterator[GenerateChunk]:
    """The chunks of a Generate call (Worker or Router), as internal dicts.

    The terminal chunk is delivered once the call has completed, so every call
    is read to its end (its status is known, its trace span ends) and nothing
    can follow the terminal. A call abandoned before its terminal is cancelled,
    which cancels the request upstream hop by hop.
    """
    terminal: GenerateChunk | None = None
    try:
        async for msg in rpc:
            if terminal is not None:
                continue  # the contract allows nothing after the terminal; ignore a broken peer
            chunk = chunk_from_proto(msg)
            if "finish_reason" in chunk:
                terminal = chunk
            else:
                yield chunk
    except grpc.aio.AioRpcError as exc:
        raise mesh_error(exc) from None
    finally:
        if terminal is None:
            rpc.cancel()
    if terminal is None:
        raise StreamIncomplete(f"{peer} ended the stream without a terminal chunk")
    yield terminal


async def unary_generate(method: Any, request: GenerateRequest, call: CallInfo | None, peer: str) -> AsyncIterator[GenerateChunk]:
    """One Generate stream as a unary-stream call of its own (`method` = a stub's `Generate`)."""
    info = call or CallInfo()
    rpc = method(request_to_proto(request), metadata=info.metadata(), timeout=info.timeout())
    async for chunk in generate_stream(rpc, peer):
        yield chunk


async def translate_stream(call: AsyncIterator[T]) -> AsyncIterator[T]:
    """Iterate a server stream, raising MeshError instead of AioRpcError."""
    try:
        async for item in call:
            yield item
    except grpc.aio.AioRpcError as exc:
        raise mesh_error(exc) from None


def _to_mesh(exc: BaseException, method: str) -> MeshError:
    if isinstance(exc, MeshError):
        return exc
    log.exception("unexpected error in %s", method, exc_info=exc)
    return Unknown(f"{type(exc).__name__}: {exc}")


class _ErrorMapping(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Turns exceptions escaping a handler into statuses (the one server-side mapping)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, method))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream, method))
        return handler


def _wrap_unary(fn: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            result = fn(request, context)
            return await result if asyncio.iscoroutine(result) else result
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, _to_mesh(exc, method))

    return unary


def _wrap_stream(fn: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, _to_mesh(exc, method))

    return stream


# ---------------------------------------------------------------- metadata


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What travels with a call hop by hop: the trace parent and the deadline.

    `deadline` is a `time.monotonic()` instant (None = no deadline).
    """

    traceparent: str | None = None
    deadline: float | None = None

    @classmethod
    def from_context(cls, context: grpc.aio.ServicerContext) -> CallInfo:
        """Read an incoming call's traceparent and remaining time."""
        tp = None
        for key, value in context.invocation_metadata() or ():
            if key == TRACEPARENT:
                tp = value if isinstance(value, str) else value.decode()
        remaining = context.time_remaining()
        return cls(tp, None if remaining is None else time.monotonic() + remaining)

    def timeout(self) -> float | None:
        """Seconds left for an outgoing call; raises ResponseTimeout when none are."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ResponseTimeout("deadline exceeded before the call was made")
        return left

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Outgoing metadata carrying the traceparent.

        When OpenTelemetry is on, its gRPC instrumentation injects the current
        span's traceparent itself, so this adds none (no duplicate headers).
        """
        if not self.traceparent or otel_active():
            return ()
        return ((TRACEPARENT, self.traceparent),)


# Least time between two messages (or in-process chunks) of one stream peer (--stream-interval-ms).
DEFAULT_STREAM_INTERVAL_S = 0.001

# What serves one Generate stream in process: a servicer's request runner, a routing core's generate.
GenerateHandler = Callable[[GenerateRequest, CallInfo], AsyncIterator[GenerateChunk]]


# ---------------------------------------------------------------- server


@dataclass(frozen=True, slots=True)
class ServiceBinding:
    """A servicer and how to add it: `register(servicer, server)` as generated code does."""

    name: str  # full service name, e.g. "meshllm.v1.Worker"
    servicer: object
    register: Callable[[Any, grpc.aio.Server], None]
    # Called when the server starts to stop, before its grace period: lets
    # long-lived calls (Generate sessions) end once their streams have.
    closing: Callable[[], None] | None = None


class GrpcServer(AsyncCloseable):
    """A started grpc.aio server with reflection and health. Close = stop(grace)."""

    def __init__(
        self, server: grpc.aio.Server, port: int, host: str, services: Sequence[str], closing: Sequence[Callable[[], None]] = ()
    ) -> None:
        self.server = server
        self.port = port
        self.host = host
        self.services = tuple(services)
        self._closing = tuple(closing)
        self.health = health.aio.HealthServicer()
        self.grace_s = 5.0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        """Set the overall and per-service health status."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.services):
            await self.health.set(name, status)

    async def _aclose(self) -> None:
        await self.set_serving(False)
        for hook in self._closing:
            hook()
        await self.server.stop(self.grace_s)


async def start_server(config: ServerConfig, services: Sequence[ServiceBinding], *, serving: bool = True) -> GrpcServer:
    """Build, bind and start a server; reflection and health are always on."""
    server = grpc.aio.server(
        interceptors=[_ErrorMapping()],
        options=[
            *channel_options(config.max_message_bytes),
            # Accept the clients' 20 s keepalive pings (the default minimum is 5 min,
            # which answers them with GOAWAY too_many_pings on idle meshes).
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    for svc in services:
        svc.register(svc.servicer, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        from meshllm.config import ConfigError

        raise ConfigError(f"cannot listen on {config.host}:{config.port}")
    gs = GrpcServer(server, port, config.host, [s.name for s in services], [s.closing for s in services if s.closing])
    health_pb2_grpc.add_HealthServicer_to_server(gs.health, server)
    names = [s.name for s in services] + [health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    await server.start()
    await gs.set_serving(serving)
    return gs


# ---------------------------------------------------------------- channels


class ChannelCache(AsyncCloseable):
    """One grpc.aio channel per address, shared by every client of a process.

    `shared` keeps one more object per address and key over that channel (the
    Generate session of `meshllm.plane.session`); it is closed with the channel.
    `local` (meshllm run) names the peers that live in this process
    (`meshllm.plane.local`): clients call those directly instead of over gRPC.
    """

    def __init__(self, *, max_message_bytes: int = 64 * 1024 * 1024, local: LocalPeers | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._shared: dict[tuple[str, str], AsyncCloseable] = {}
        self._options = channel_options(max_message_bytes)
        self.local = local

    def get(self, address: str) -> grpc.aio.Channel:
        if self.closed:
            raise Cancelled("channel cache is closed")
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.aio.insecure_channel(address, options=self._options)
            self._channels[address] = ch
        return ch

    def shared(self, address: str, key: str, make: Callable[[grpc.aio.Channel], S]) -> S:
        """The one object `make(channel)` built for (address, key), built on first use."""
        obj = self._shared.get((address, key))
        if obj is None:
            obj = self._shared[(address, key)] = make(self.get(address))
        return obj  # type: ignore[return-value]

    async def drop(self, address: str) -> None:
        """Close and forget the channel to one address (e.g. a worker that left)."""
        shared = [self._shared.pop(k) for k in [k for k in self._shared if k[0] == address]]
        await asyncio.gather(*(obj.aclose() for obj in shared), return_exceptions=True)
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close()

    async def _aclose(self) -> None:
        shared, self._shared = list(self._shared.values()), {}
        await asyncio.gather(*(obj.aclose() for obj in shared), return_exceptions=True)
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(ch.close() for ch in channels), return_exceptions=True)

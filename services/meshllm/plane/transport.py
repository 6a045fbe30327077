"""gRPC helpers: the server builder, the channel cache, error mapping, call metadata.

Every meshllm server is built by `start_server`, which binds its port
exclusively, always registers server reflection (v1 and v1alpha) and the
standard `grpc.health.v1` service, and installs the one server-side
error-mapping layer: a `MeshError` raised by a handler becomes its gRPC
status (from `meshllm.errors.ERROR_TABLE`) plus a `meshllm-error` trailer
naming its class; any other exception becomes `Unknown` with its message.
Clients turn an `AioRpcError` back into the same class with `mesh_error`.
W3C `traceparent` and the caller's deadline travel hop by hop through
`CallInfo`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from meshllm.config import DEFAULT_STREAM_INTERVAL_MS, ConfigError, ServerConfig
from meshllm.errors import (
    Cancelled,
    InvalidArgument,
    MeshError,
    ResponseTimeout,
    StreamIncomplete,
    Unimplemented,
    Unknown,
    error_from_status,
    log_unexpected,
    spec_of,
)
from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.reflection import enable_reflection
from meshllm.ports import check_free
from meshllm.protocol.convert import chunk_from_proto, request_to_proto
from meshllm.protocol.types import ChunkSink, TokenChunk, TokenRequest
from meshllm.tracing import otel_active

if TYPE_CHECKING:
    from meshllm.plane.auth import ClientSecurity, MeshSecurity
    from meshllm.plane.local import LocalPeers
    from meshllm.plane.tcp_session import TcpSessionServer

__all__ = [
    "DEFAULT_STREAM_INTERVAL_S",
    "ERROR_TRAILER",
    "KEEPALIVE_TIMEOUT_MS",
    "KEEPALIVE_TIME_MS",
    "TRACEPARENT",
    "CallInfo",
    "ChannelCache",
    "ChunkSink",
    "GenerateHandler",
    "GrpcServer",
    "ServiceBinding",
    "SessionLiveness",
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


# Keepalive: every connection is pinged every KEEPALIVE_TIME_MS, and one whose
# ping is not answered within KEEPALIVE_TIMEOUT_MS fails its calls
# (UNAVAILABLE "ping timeout"): a stopped process or a partitioned host is noticed
# within about 3 s even on a quiet connection. grpc (1.85) waits
# `grpc.http2.ping_timeout_ms` for a keepalive ping's ack whatever
# keepalive_timeout_ms says; its default of 60 s was the ~61 s stall of a
# SIGSTOPped worker's streams (issue 14), so both are set.
KEEPALIVE_TIME_MS = 2_000
KEEPALIVE_TIMEOUT_MS = 3_000


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Channel and server options shared by both sides (servers ping their clients the same way)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.max_pings_without_data", 0),  # 0 = ping however long no data flows
        ("grpc.keepalive_permit_without_calls", 1),
        # Reconnect to a restarted peer within 0.5 s (the default backoff grows to 120 s); the
        # connect timeout itself (grpc.min_reconnect_backoff_ms, 20 s) stays as it is.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 500),
    ]


# ---------------------------------------------------------------- errors


async def abort_with(context: grpc.aio.ServicerContext, err: MeshError) -> None:
    """End the RPC with the status of `err` and the trailer naming its class."""
    await context.abort(spec_of(err).grpc_status, err.message, trailing_metadata=((ERROR_TRAILER, err.code),))


def mesh_error(exc: grpc.aio.AioRpcError) -> MeshError:
    """The MeshError a failed call stands for (same class as the server raised).

    Without the meshllm error trailer the status came from gRPC itself (a reset
    connection, a peer that went away), not from a meshllm server: the error is
    marked `from_transport`.
    """
    code = None
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_TRAILER:
            code = value if isinstance(value, str) else value.decode()
    err = error_from_status(exc.code(), exc.details() or exc.code().name, code)
    err.from_transport = code is None
    return err


async def translate_errors(call: Awaitable[T]) -> T:
    """Await a unary call, raising MeshError instead of AioRpcError."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise mesh_error(exc) from None


async def generate_stream(rpc: Any, peer: str) -> AsyncIterator[TokenChunk]:
    """The chunks of a Generate call (Worker or Router), as internal dicts.

    The terminal chunk is delivered once the call has completed, so every call
    is read to its end (its status is known, its trace span ends) and nothing
    can follow the terminal. A call abandoned before its terminal is cancelled,
    which cancels the request upstream hop by hop.
    """
    terminal: TokenChunk | None = None
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


async def unary_generate(method: Any, request: TokenRequest, call: CallInfo | None, peer: str) -> AsyncIterator[TokenChunk]:
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
    if type(exc) is NotImplementedError:  # a generated servicer's default body (e.g. grpc.health.v1.Health/List)
        return Unimplemented(f"{method} is not implemented by this server")
    log_unexpected(log, f"unexpected error in {method}", exc)
    return Unknown(f"{type(exc).__name__}: {exc}")


class _Malformed:
    """What the request deserializer yields for bytes that are not a valid message."""

    __slots__ = ("error",)

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error


def _safe_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    # grpc.aio answers a deserializer's exception with UNKNOWN and logs a
    # traceback per call; a marker lets the handler wrapper answer
    # INVALID_ARGUMENT instead, with nothing logged.
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:
            return _Malformed(InvalidArgument(f"the request message is not valid protobuf ({type(exc).__name__})"))

    return parse


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A client stream, raising InvalidArgument at its first malformed message."""
    async for r in requests:
        if isinstance(r, _Malformed):
            raise r.error
        yield r


class _ErrorMapping(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Turns exceptions escaping a handler into statuses (the one server-side mapping).

    Also for every method: request bytes that do not parse end the call with
    INVALID_ARGUMENT (unary requests before the handler runs; streamed ones
    when the handler reads the bad message).

    The wrapped handler of a method is built once and kept (grpc hands back
    the same registered handler for every call of it), not once per call.
    """

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return None
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, details.method)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    @staticmethod
    def _wrap(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        handler = handler._replace(request_deserializer=_safe_deserializer(handler.request_deserializer))
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, method, streaming=False))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream, method, streaming=False))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary, method, streaming=True))
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=_wrap_stream(handler.stream_stream, method, streaming=True))
        return handler


def _request(request: Any, streaming: bool) -> Any:
    if streaming:
        return _checked(request)
    if isinstance(request, _Malformed):
        raise request.error
    return request


def _wrap_unary(fn: Callable[..., Any], method: str, *, streaming: bool) -> Callable[..., Any]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            result = fn(_request(request, streaming), context)
            return await result if asyncio.iscoroutine(result) else result
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, _to_mesh(exc, method))

    return unary


def _wrap_stream(fn: Callable[..., Any], method: str, *, streaming: bool) -> Callable[..., Any]:
    if asyncio.iscoroutinefunction(fn):  # a handler that writes with context.write (grpc's health Watch)
        return _wrap_unary(fn, method, streaming=streaming)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(_request(request, streaming), context):
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
DEFAULT_STREAM_INTERVAL_S = DEFAULT_STREAM_INTERVAL_MS / 1000.0

# What serves one Generate stream in process: a servicer's request runner, a routing core's generate.
GenerateHandler = Callable[[TokenRequest, CallInfo], AsyncIterator[TokenChunk]]


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
    # The service's SessionServer: also served on TCP when the config has a session port (plane/tcp_session.py).
    sessions: Any = None


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
        self.sessions: TcpSessionServer | None = None  # the TCP carrier of its Generate sessions, if served
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def session_port(self) -> int | None:
        """The TCP port of its Generate sessions (None: served on gRPC only)."""
        return self.sessions.port if self.sessions is not None else None

    async def set_serving(self, serving: bool) -> None:
        """Set the overall and per-service health status."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.services):
            await self.health.set(name, status)

    async def _aclose(self) -> None:
        await self.set_serving(False)
        for hook in self._closing:
            hook()
        for t in self._tasks:
            t.cancel()
        if self.sessions is None:
            await self.server.stop(self.grace_s)
            return
        self.sessions.stop_accepting()
        await asyncio.gather(self.server.stop(self.grace_s), self.sessions.wait_closed(self.grace_s))


async def start_server(
    config: ServerConfig,
    services: Sequence[ServiceBinding],
    *,
    serving: bool = True,
    port_flag: str = "--port",
    reuse_port: bool = False,
    security: MeshSecurity | None = None,
) -> GrpcServer:
    """Build, bind and start a server; reflection (v1 and v1alpha) and health are always on.

    `security` (plane/auth.py): TLS (mTLS with a CA, certificates reloaded when
    their files change) and the mesh-token check on the internal services.

    The port is bound exclusively: gRPC sets SO_REUSEPORT by default on Linux,
    which would let a second process share the port and take half of its
    traffic. `reuse_port` (the processes of `meshllm frontend --workers N`)
    shares it on purpose. A taken port raises `PortInUse` naming `port_flag`.
    """
    if not reuse_port:
        check_free(config.host, config.port, port_flag)  # before gRPC logs its own bind error
    from meshllm.plane.auth import MeshAuth

    interceptors: list[grpc.aio.ServerInterceptor] = [_ErrorMapping()]
    if security is not None and security.token is not None:
        interceptors.insert(0, MeshAuth(security.token))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            *channel_options(config.max_message_bytes),
            # Accept the clients' keepalive pings (the default minimum is 5 min, which
            # answers them with GOAWAY too_many_pings on idle meshes). This is the
            # name grpc reads; "min_recv_ping_interval_without_data_ms" is not one.
            ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.so_reuseport", 1 if reuse_port else 0),
        ],
    )
    for svc in services:
        svc.register(svc.servicer, server)
    try:
        if security is not None and security.tls is not None:
            from meshllm.plane.tls import TlsFiles, server_credentials

            port = server.add_secure_port(f"{config.host}:{config.port}", server_credentials(TlsFiles(security.tls)))
        else:
            port = server.add_insecure_port(f"{config.host}:{config.port}")
    except RuntimeError:  # grpc raises where older versions returned 0
        port = 0
    if port == 0:
        if config.port != 0:
            check_free(config.host, config.port, port_flag)  # PortInUse: taken since the first probe
        raise ConfigError(f"cannot listen on {config.host}:{config.port} ({port_flag})")
    gs = GrpcServer(server, port, config.host, [s.name for s in services], [s.closing for s in services if s.closing])
    health_pb2_grpc.add_HealthServicer_to_server(gs.health, server)
    enable_reflection([s.name for s in services] + [health.SERVICE_NAME], server)
    await server.start()
    sessions = {s.name.rsplit(".", 1)[-1]: s.sessions for s in services if s.sessions is not None}
    if config.session_port is not None and sessions:
        try:
            gs.sessions, gs._tasks = await _start_tcp_sessions(config, sessions, security)
        except BaseException:
            await server.stop(None)
            raise
    await gs.set_serving(serving)
    return gs


async def _start_tcp_sessions(
    config: ServerConfig, sessions: dict[str, Any], security: MeshSecurity | None
) -> tuple[TcpSessionServer, list[asyncio.Task[None]]]:
    """Serve `sessions` (service name → SessionServer) on TCP with the gRPC server's TLS and mesh token."""
    from meshllm.plane.tcp_session import TcpSessionServer

    assert config.session_port is not None
    ctx, tasks = None, []
    if security is not None and security.tls is not None:
        from meshllm.plane.tls import TlsFiles, keep_reloaded, ssl_server_context

        files = TlsFiles(security.tls)
        ctx = ssl_server_context(files)
        tasks.append(asyncio.create_task(keep_reloaded(ctx, files), name="session-tls-reload"))
    check_free(config.host, config.session_port, "--session-port")
    tcp = TcpSessionServer(
        sessions,
        host=config.host,
        port=config.session_port,
        token=security.token if security is not None else None,
        ssl_context=ctx,
        max_message_bytes=config.max_message_bytes,
    )
    try:
        await tcp.start()
    except OSError as exc:
        for t in tasks:
            t.cancel()
        where = f"{config.host}:{config.session_port}"
        raise ConfigError(f"cannot listen on {where} (--session-port): {exc.strerror or exc}") from None
    return tcp, tasks


# ---------------------------------------------------------------- channels


@dataclass(frozen=True, slots=True)
class SessionLiveness:
    """When a client's Generate session, or one stream on it, counts as broken (plane/session.py).

    A session server sends a heartbeat (an empty `SessionDown`) whenever its
    streams are open and it sent nothing for `HEARTBEAT_S`, so a live peer is
    never silent for long, even while every stream waits for a long prefill.
    `step_s` below is the session's observed gap between messages (an
    exponential mean: one engine step when tokens flow, a heartbeat interval
    when none do).

    - A session with open streams that receives nothing at all for
      `max(stall_timeout_s, STALL_STEPS * step_s)` is broken: every stream
      fails with `Disconnected` (which the router migrates) and the call is
      cancelled.
    - A stream that has had its first chunk and then none for
      `max(stream_stall_timeout_s, STALL_STEPS * step_s)` fails the same way
      (0 = never): the peer answers, but this stream makes no progress.
    """

    stall_timeout_s: float = 3.0
    stream_stall_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 1.0 <= self.stall_timeout_s <= 3600:  # also refuses NaN
            raise ConfigError(f"--stall-timeout must be between 1 and 3600 seconds, got {self.stall_timeout_s}")
        if not (self.stream_stall_timeout_s == 0 or 1.0 <= self.stream_stall_timeout_s <= 3600):
            raise ConfigError(
                f"--stream-stall-timeout must be 0 (off) or between 1 and 3600 seconds, got {self.stream_stall_timeout_s}"
            )


class ChannelCache(AsyncCloseable):
    """One grpc.aio channel per address, shared by every client of a process.

    `shared` keeps one more object per address and key over that channel (the
    Generate session of `meshllm.plane.session`); it is closed with the channel.
    `local` (meshllm run) names the peers that live in this process
    (`meshllm.plane.local`): clients call those directly instead of over gRPC.
    `liveness` bounds how long the process's sessions may stall.
    `security` (plane/auth.py): channels use TLS with this process's
    certificate and send the mesh token; when the certificate files change,
    channels made from then on use the new ones (channels already made keep
    their connections until they are dropped).
    `session_routes` maps a peer's gRPC address to the TCP address where it
    serves Generate sessions too (`Instance.session_address`,
    plane/tcp_session.py); a session opened to a peer listed there uses it.
    """

    def __init__(
        self,
        *,
        max_message_bytes: int = 64 * 1024 * 1024,
        local: LocalPeers | None = None,
        liveness: SessionLiveness | None = None,
        security: MeshSecurity | None = None,
    ) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._security: ClientSecurity | None = None
        if security is not None and security.enabled:
            from meshllm.plane.auth import ClientSecurity

            self._security = ClientSecurity(security)
        self._shared: dict[tuple[str, str], AsyncCloseable] = {}
        self._retired: list[grpc.aio.Channel] = []
        self._options = channel_options(max_message_bytes)
        self.local = local
        self.liveness = liveness if liveness is not None else SessionLiveness()
        self.session_routes: dict[str, str] = {}
        self._max_message_bytes = max_message_bytes
        self._caller_id = uuid.uuid4().hex

    def route_sessions(self, address: str, session_address: str) -> None:
        """Open sessions to the peer at gRPC `address` on TCP at `session_address` ("" = over gRPC)."""
        if session_address:
            self.session_routes[address] = session_address
        else:
            self.session_routes.pop(address, None)

    def session_call(self, address: str, service: str) -> Callable[[], Any] | None:
        """A maker of TCP session calls to `address`'s `service`, or None when it serves sessions on gRPC only."""
        target = self.session_routes.get(address)
        if target is None:
            return None
        from meshllm.plane.tcp_session import TcpCall

        sec = self._security
        token, caller = (sec.token, sec.caller_id) if sec is not None else (None, self._caller_id)
        ctx = sec.ssl_context() if sec is not None else None
        limit = self._max_message_bytes
        return lambda: TcpCall(target, service, caller=caller, token=token, ssl_context=ctx, max_message_bytes=limit)

    def get(self, address: str) -> grpc.aio.Channel:
        if self.closed:
            raise Cancelled("channel cache is closed")
        if self._security is not None and self._security.rotated():
            self._retired.extend(self._channels.values())  # in-flight calls finish on them; closed with the cache
            self._channels = {}
        ch = self._channels.get(address)
        if ch is None:
            if self._security is not None:
                ch = self._security.channel(address, self._options)
            else:
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
        channels, self._channels = [*self._channels.values(), *self._retired], {}
        self._retired = []
        await asyncio.gather(*(ch.close() for ch in channels), return_exceptions=True)

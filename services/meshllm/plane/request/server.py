"""Every meshllm gRPC server: `start_server`, and the one server-side error mapping.

`start_server` binds its port exclusively, always registers server reflection
(v1 and v1alpha) and the standard `grpc.health.v1` service, serves the
services' Generate sessions on a TCP port too when the config has one
(plane/request/tcp_session.py), and installs the one error-mapping layer: a
`MeshError` raised by a handler becomes its gRPC status (from
`meshllm.errors.ERROR_TABLE`) plus a `meshllm-error` trailer naming its
class; any other exception becomes `Unknown` with its message; request bytes
that do not parse are `InvalidArgument`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from meshllm.config import ConfigError, ServerConfig
from meshllm.errors import InvalidArgument, MeshError, Unimplemented, Unknown, log_unexpected, spec_of
from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.request.reflection import enable_reflection
from meshllm.plane.request.transport import ERROR_TRAILER, KEEPALIVE_TIME_MS, HandlerInterceptor, channel_options
from meshllm.ports import check_free

if TYPE_CHECKING:
    from meshllm.plane.auth import MeshSecurity
    from meshllm.plane.request.session import SessionServer
    from meshllm.plane.request.tcp_session import TcpSessionServer

__all__ = ["GrpcServer", "ServiceBinding", "abort_with", "start_server"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServiceBinding:
    """A servicer and how to add it: `register(servicer, server)` as generated code does."""

    name: str  # full service name, e.g. "meshllm.v1.Worker"
    servicer: object
    register: Callable[[Any, grpc.aio.Server], None]
    # Called when the server starts to stop, before its grace period: lets
    # long-lived calls (Generate sessions) end once their streams have.
    closing: Callable[[], None] | None = None
    # The service's SessionServer: also served on TCP when the config has a session port (plane/request/tcp_session.py).
    sessions: SessionServer | None = None


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
    server = _new_server(config, reuse_port, security)
    for svc in services:
        svc.register(svc.servicer, server)
    port = _bind(server, config, port_flag, security)
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


def _new_server(config: ServerConfig, reuse_port: bool, security: MeshSecurity | None) -> grpc.aio.Server:
    """A grpc.aio server with the error mapping (and the mesh-token check) in front of every method."""
    from meshllm.plane.auth import MeshAuth

    interceptors: list[grpc.aio.ServerInterceptor] = [_ErrorMapping()]
    if security is not None and security.token is not None:
        interceptors.insert(0, MeshAuth(security.token))
    return grpc.aio.server(
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


def _bind(server: grpc.aio.Server, config: ServerConfig, port_flag: str, security: MeshSecurity | None) -> int:
    """Bind host:port (TLS when configured); the bound port, or a one-line ConfigError (PortInUse when taken)."""
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
    return port


async def _start_tcp_sessions(
    config: ServerConfig, sessions: dict[str, SessionServer], security: MeshSecurity | None
) -> tuple[TcpSessionServer, list[asyncio.Task[None]]]:
    """Serve `sessions` (service name → SessionServer) on TCP with the gRPC server's TLS and mesh token."""
    from meshllm.plane.request.tcp_session import TcpSessionServer

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


# ---------------------------------------------------------------- errors


async def abort_with(context: grpc.aio.ServicerContext, err: MeshError) -> None:
    """End the RPC with the status of `err` and the trailer naming its class."""
    await context.abort(spec_of(err).grpc_status, err.message, trailing_metadata=((ERROR_TRAILER, err.code),))


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


class _ErrorMapping(HandlerInterceptor):
    """Turns exceptions escaping a handler into statuses (the one server-side mapping).

    Also for every method: request bytes that do not parse end the call with
    INVALID_ARGUMENT (unary requests before the handler runs; streamed ones
    when the handler reads the bad message).

    The wrapped handler of a method is built once and kept (grpc hands back
    the same registered handler for every call of it), not once per call.
    """

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
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

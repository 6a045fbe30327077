"""What a gRPC call carries and how a client reads its outcome: call metadata, client-side error mapping, options.

The request plane in three modules: this one (`CallInfo`, `mesh_error` and the
unary Generate helpers, the options both sides share), `plane/request/server.py`
(`start_server`: every meshllm server, its one server-side error mapping) and
`plane/request/channels.py` (`ChannelCache`: one process's channels and sessions to
its peers). A `MeshError` raised by a handler reaches the client as its gRPC
status plus a `meshllm-error` trailer naming its class; `mesh_error` turns the
`AioRpcError` back into the same class. W3C `traceparent` and the caller's
deadline travel hop by hop through `CallInfo`.
"""

from __future__ import annotations

import abc
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from meshllm.config import DEFAULT_STREAM_INTERVAL_MS
from meshllm.errors import MeshError, ResponseTimeout, StreamIncomplete, error_from_status
from meshllm.protocol.convert import chunk_from_proto, request_to_proto
from meshllm.protocol.types import ChunkRelay, TokenChunk, TokenRequest
from meshllm.tracing import otel_active

__all__ = [
    "DEFAULT_STREAM_INTERVAL_S",
    "ERROR_TRAILER",
    "KEEPALIVE_TIMEOUT_MS",
    "KEEPALIVE_TIME_MS",
    "TRACEPARENT",
    "CallInfo",
    "ChunkRelay",
    "GenerateHandler",
    "HandlerInterceptor",
    "channel_options",
    "generate_stream",
    "mesh_error",
    "translate_errors",
    "translate_stream",
    "unary_generate",
]

ERROR_TRAILER = "meshllm-error"
TRACEPARENT = "traceparent"
T = TypeVar("T")


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


class HandlerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """A server interceptor that serves each call with `intercept(handler, details)`: the handler grpc found for
    its method, kept or replaced (server.py's error mapping, plane/auth.py's mesh-token check). A call to a method
    the server lacks (no handler) is left to grpc."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        return None if handler is None else self.intercept(handler, details)

    @abc.abstractmethod
    def intercept(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        """The handler that serves the call: `handler` itself, or one wrapping it."""


# ---------------------------------------------------------------- errors


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


# ---------------------------------------------------------------- metadata


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What travels with a call hop by hop: the trace parent and the deadline, and where its chunks may go.

    `deadline` is a `time.monotonic()` instant (None = no deadline).

    `relay`: set by the stream's own transport when it can take non-terminal
    chunks straight from whoever makes them (a GenerateSession stream's
    outbox). A handler may then pass such chunks to `relay(chunk)` instead of
    yielding them, and they are sent as if yielded, without waking the
    stream's task; the terminal is always yielded. A handler that ignores it
    loses nothing. Not part of the call's identity, and never sent on.
    """

    traceparent: str | None = None
    deadline: float | None = None
    relay: ChunkRelay | None = field(default=None, compare=False, repr=False)

    def relaying(self, relay: ChunkRelay | None) -> CallInfo:
        """This call with another relay (None: every chunk is yielded); itself when the relay is the same."""
        return self if relay is self.relay else CallInfo(self.traceparent, self.deadline, relay)

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

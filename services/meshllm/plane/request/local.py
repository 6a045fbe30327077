"""The in-process request plane: Generate streams to a peer that lives in the same process, without gRPC.

`meshllm run` puts frontend, routing core and workers in one process; its
discovery and event planes are already in memory. Its request plane is too:
each worker it starts registers its Generate handler in the run's
`LocalPeers` under the address it also serves gRPC on, and every client of
the run's `ChannelCache` (`WorkerClient.generate`) calls that handler
directly. Over gRPC, both ends of every message would be paid by the one
process that holds the GIL. Clients in other processes, grpcurl and the
Router gRPC service of `meshllm run` still reach the same workers over gRPC.

A local stream keeps the contract of a Generate call: chunks, then exactly one
terminal, or the MeshError the handler raised (any other exception becomes
`Unknown`, as the transport's error mapping makes it); closing the iterator
closes the handler, which cancels the request in the engine. The handler runs
to its own end before the terminal is passed on, so its bookkeeping sees a
finished request. When tracing records, each stream is a CLIENT and a SERVER
span named like the RPC it stands for, so traces keep their shape. Deadlines
are the caller's own: nothing here waits on a peer that could hang.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from meshllm.errors import MeshError, StreamIncomplete, Unknown, log_unexpected
from meshllm.plane.request.transport import DEFAULT_STREAM_INTERVAL_S, CallInfo, GenerateHandler
from meshllm.protocol.chunks import coalescing
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.tracing import tracer, tracing_enabled

__all__ = ["LocalHandler", "LocalPeer", "LocalPeers", "Ticker", "local_generate"]

log = logging.getLogger(__name__)

LocalHandler = GenerateHandler


class Ticker:
    """One shared clock tick every `interval_s` (a single timer, however many streams wait on it)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._tick: asyncio.Future[None] | None = None

    def next(self) -> asyncio.Future[None]:
        """The next tick: done within one interval from now."""
        tick = self._tick
        if tick is None or tick.done():
            loop = asyncio.get_running_loop()
            tick = self._tick = loop.create_future()
            loop.call_later(self.interval_s, _resolve, tick)
        return tick


def _resolve(tick: asyncio.Future[None]) -> None:
    if not tick.done():
        tick.set_result(None)


class LocalPeers:
    """Generate handlers of the peers that live in this process, by the address they serve on.

    A consumer pulls its stream's next chunk when it is ready for it and gets
    every token made since (the engine merges while it lags): coalescing by
    backpressure. `min_interval_s` > 0 is the optional cap of the sessions
    (`--stream-interval-ms`, default 0 = none) for in-process streams: a stream's
    next chunk then comes no sooner than one interval after the previous one
    (waiting for a tick shared by all streams).
    """

    def __init__(self, *, min_interval_s: float = DEFAULT_STREAM_INTERVAL_S) -> None:
        self._handlers: dict[str, LocalPeer] = {}
        self.ticker = Ticker(min_interval_s) if min_interval_s > 0 else None

    def set_interval(self, interval_s: float) -> None:
        """Pace later streams by `interval_s` (0 = every chunk at once); `meshllm run` sets its workers' value."""
        self.ticker = Ticker(interval_s) if interval_s > 0 else None

    def register(self, address: str, handler: LocalHandler, method: str, *, service: str | None = None) -> None:
        """Serve `address` in process; `method` names its spans (e.g. "/meshllm.v1.Worker/Generate").

        `service` is the service.name of the peer's SERVER spans (the caller's
        process may hold several roles).
        """
        self._handlers[address] = LocalPeer(handler, method, self.ticker, service)

    def unregister(self, address: str) -> None:
        self._handlers.pop(address, None)

    def get(self, address: str) -> LocalPeer | None:
        return self._handlers.get(address)


@dataclass(frozen=True, slots=True)
class LocalPeer:
    """One in-process peer: its Generate handler and the method its spans are named after."""

    handler: LocalHandler
    method: str
    ticker: Ticker | None = None
    service: str | None = None

    def generate(self, request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        return local_generate(self.handler, self.method, request, call, ticker=self.ticker, service=self.service)


# size: an in-process stream's per-chunk loop, pacing and cleanup in one generator whose finally must see every exit
async def local_generate(
    handler: LocalHandler,
    method: str,
    request: TokenRequest,
    call: CallInfo,
    *,
    ticker: Ticker | None = None,
    service: str | None = None,
) -> AsyncIterator[TokenChunk]:
    """One Generate stream through an in-process handler (see the module docstring)."""
    spans = None
    if tracing_enabled():
        client = tracer().start_span(method, kind=SpanKind.CLIENT, attributes={"rpc.transport": "in-process"})
        server = tracer(service).start_span(
            method, context=trace.set_span_in_context(client), kind=SpanKind.SERVER, attributes={"rpc.transport": "in-process"}
        )
        spans = (client, server)
    try:
        async with aclosing(handler(request, call)) as stream:  # type: ignore[type-var]
            first: TokenChunk | None
            if spans is not None:
                # The handler's first step (where it starts its own spans) runs under the SERVER span.
                token = otel_context.attach(trace.set_span_in_context(spans[1]))
                try:
                    first = await anext(stream, None)
                finally:
                    otel_context.detach(token)
            else:
                first = await anext(stream, None)
            chunk = first
            loop = asyncio.get_running_loop()
            while chunk is not None:
                if "finish_reason" in chunk:
                    async for _ in stream:
                        pass  # the contract allows nothing after the terminal; let the handler end
                    yield chunk
                    return
                sent_at = loop.time()
                yield chunk
                if ticker is not None and loop.time() - sent_at < ticker.interval_s and coalescing():
                    await ticker.next()  # tokens made meanwhile merge into the next chunk
                chunk = await anext(stream, None)
        raise StreamIncomplete("the in-process stream ended without a terminal chunk")
    except MeshError:
        raise
    except Exception as exc:
        log_unexpected(log, "unexpected error in an in-process Generate stream", exc)
        raise Unknown(f"{type(exc).__name__}: {exc}") from None
    finally:
        if spans is not None:
            spans[1].end()
            spans[0].end()

"""Many Generate streams on one gRPC call: `SessionServer` and `SessionClient` (see session.proto).

Why: a gRPC message costs the same fixed work (HTTP/2 frame, grpc.aio
callback, event-loop wakeup, protobuf object) whether it carries one token or
fifty. With one call per request, every token of every request pays it twice
(worker write, client read). A session carries the tokens that one engine
step made for all of a peer's requests in one `SessionDown` message, so that
cost is paid once per step and peer instead of once per token and request.

Server side, per session: a reader task takes `SessionUp` messages (opens
start one task per stream running the handler, cancels cancel that task); the
stream tasks push chunks into one outbox; a writer task sends everything the
outbox holds as one message whenever it has something and the client has
taken the previous one (flow control: a client that sets
`SessionUp.flow_control` acknowledges each message on its loop's next turn
after taking it, and the server keeps at most `FLOW_WINDOW`
unacknowledged). While a message waits (the window, the client reads
slowly), later tokens of a stream are merged into its pending chunk
(`meshllm.protocol.chunks`), so nothing blocks the engine and memory stays
bounded by tokens, not messages: coalescing by backpressure, with no clock.
Tokens reach the client as soon as they exist when it keeps up: the writer
wakes on the first push, and a stream's first chunk never waits. A server
whose handler relays (`relays=True`: the router, a worker whose engine takes
chunks from its step loop) also gives each stream's call a relay into the
outbox (`CallInfo.relay`), so chunks made elsewhere (a router's peer sessions,
`SessionClient.generate(relay=...)`) go out without waking the stream's task.

Client side: `SessionClient` (plane/request/session_client.py, re-exported here).
`plane/request/peers.py`'s `generate_to` chooses between a peer in this process and
the session to it.

Liveness (`SessionLiveness`, docs/architecture.md "Stall detection"): a
server with open streams that has sent nothing for `HEARTBEAT_S` sends an
empty `SessionDown`, so its clients can tell a quiet peer from a frozen one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from meshllm.errors import (
    EngineShutdown,
    InvalidArgument,
    MeshError,
    ResponseTimeout,
    StreamIncomplete,
    Unknown,
    log_unexpected,
)
from meshllm.plane.request.session_client import SessionClient
from meshllm.plane.request.session_client import wake as _wake
from meshllm.plane.request.transport import DEFAULT_STREAM_INTERVAL_S, CallInfo, GenerateHandler
from meshllm.protocol.chunks import coalescing, merge_into, mergeable
from meshllm.protocol.convert import chunk_into_proto, request_from_proto
from meshllm.protocol.types import TokenChunk
from meshllm.tracing import tracer, tracing_enabled
from meshllm.v1 import session_pb2

__all__ = [
    "DEFAULT_INTERVAL_S",
    "HEARTBEAT_S",
    "SessionClient",
    "SessionHandler",
    "SessionServer",
]

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = DEFAULT_STREAM_INTERVAL_S
# Unacknowledged messages a server keeps in flight to a client that acknowledges (SessionUp.flow_control).
FLOW_WINDOW = 1
# A server's heartbeat interval: well under the least stall bound a client accepts (1 s).
HEARTBEAT_S = 0.5
SessionHandler = GenerateHandler


# ---------------------------------------------------------------- server


class SessionServer:
    """Serves `GenerateSession` calls of one service: each stream runs `handler(request, call)`.

    The handler has the contract of a Generate servicer: chunks, then one
    terminal; a MeshError it raises ends the stream as an error item. `close()`
    lets open sessions end once their streams have; new streams are refused
    with EngineShutdown (an Unavailable).
    """

    def __init__(
        self,
        handler: SessionHandler,
        method: str,
        *,
        min_interval_s: float = DEFAULT_INTERVAL_S,
        heartbeat_s: float = HEARTBEAT_S,
        relays: bool = False,
    ) -> None:
        self.handler = handler
        # True: each stream's CallInfo.relay is a relay into the outbox. What the handler passes there is sent as if
        # yielded, without the stream's task waking for it (the router forwards worker chunks so).
        self.relays = relays
        self.min_interval_s = min_interval_s
        self.heartbeat_s = heartbeat_s  # an empty SessionDown after this long without a message while streams are open
        self.method = method  # the span name of each stream when tracing records, e.g. "/meshllm.v1.Worker/Generate"
        self._sessions: set[_ServerSession] = set()
        self.closing = False

    async def serve(
        self,
        request_iterator: AsyncIterator[session_pb2.SessionUp],
        context: grpc.aio.ServicerContext | None,
        *,
        bind_acks: Callable[[Callable[[int], None] | None], None] | None = None,
    ) -> AsyncIterator[session_pb2.SessionDown]:
        """The body of a `GenerateSession` handler: yields the messages to send.

        `bind_acks` (a carrier that parses messages in its own callbacks: TCP) is given the session's
        acknowledgement taker, then None at the end: an acknowledgement alone is then handed over where it
        is read, without waking the session's reader task once per message sent.
        """
        session = _ServerSession(self)
        self._sessions.add(session)
        if bind_acks is not None:
            bind_acks(session.acknowledged)
        try:
            async for down in session.run(request_iterator):
                yield down
        finally:
            if bind_acks is not None:
                bind_acks(None)
            self._sessions.discard(session)

    def close(self) -> None:
        """Refuse new streams; each session ends when its open streams have."""
        self.closing = True
        for s in list(self._sessions):
            s.wake()

    @property
    def open_streams(self) -> int:
        return sum(len(s.tasks) for s in self._sessions)


class _ServerSession:
    def __init__(self, server: SessionServer) -> None:
        self.server = server
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.items: list[tuple[int, TokenChunk | MeshError]] = []
        self.last: dict[int, int] = {}  # stream id -> index in items of its pending chunk
        self.ended: set[int] = set()  # streams whose terminal is pushed: nothing more of them is sent
        self.started: set[int] = set()  # streams that pushed something: a later chunk may wait for the interval
        self.urgent = False  # a stream's first item is waiting: it goes without the interval or the window (TTFT)
        self.reading = True
        self.busy_since = 0.0  # loop time its first open stream started (heartbeats count from there)
        self.flow = False  # the client acknowledges what it has taken: at most FLOW_WINDOW messages in flight
        self.inflight = 0  # messages sent and not yet acknowledged (when `flow`)
        self.failed: MeshError | None = None  # a malformed or invalid message ended the reading: the call's status
        self._waiter: asyncio.Future[None] | None = None
        self._beat: asyncio.TimerHandle | None = None  # wakes the writer when a heartbeat may be due

    def wake(self) -> None:
        _wake(self._waiter)

    def acknowledged(self, n: int) -> None:
        """The client took `n` more messages (SessionUp.acked): the writer may send again."""
        self.inflight = max(0, self.inflight - n)
        _wake(self._waiter)

    def _beat_due(self) -> None:
        self._beat = None
        _wake(self._waiter)

    def push(self, sid: int, item: TokenChunk | MeshError) -> None:
        if sid in self.ended:
            return
        i = self.last.get(sid)
        if i is not None and not isinstance(item, MeshError) and mergeable(item):
            pending = self.items[i][1]
            if not isinstance(pending, MeshError) and mergeable(pending):
                merge_into(pending, item)
                return
        if sid not in self.started:
            self.started.add(sid)
            self.urgent = True
        self.last[sid] = len(self.items)
        self.items.append((sid, item))
        self.wake()

    # size: a session's serve loop: reader, writer and every stream's end in one generator whose finally sees every exit
    async def run(self, request_iterator: AsyncIterator[session_pb2.SessionUp]) -> AsyncIterator[session_pb2.SessionDown]:
        reader = asyncio.ensure_future(self._read(request_iterator))
        loop = asyncio.get_running_loop()
        interval, heartbeat = self.server.min_interval_s, self.server.heartbeat_s
        sent_at = -1.0
        try:
            while True:
                if not self.items or (self.flow and self.inflight >= FLOW_WINDOW and not self.urgent):
                    if not self.items and self._ended():
                        if self.failed is not None:
                            raise self.failed
                        return
                    if self.tasks and heartbeat > 0:
                        # Streams are open but quiet (a long prefill), or the client has yet to take the last
                        # message: tell it this peer is alive.
                        quiet = loop.time() - max(sent_at, self.busy_since)
                        if quiet >= heartbeat:
                            sent_at = loop.time()
                            yield session_pb2.SessionDown()
                            continue
                        if self._beat is None:
                            # One timer per quiet spell, not one per wait: a push wakes the writer straight through
                            # its future, and a timer that fires after a message was sent is re-armed for the rest.
                            self._beat = loop.call_later(heartbeat - quiet, self._beat_due)
                    self._waiter = waiter = loop.create_future()
                    await waiter
                    continue
                if interval > 0 and not self.urgent and coalescing() and (wait := sent_at + interval - loop.time()) > 0:
                    await asyncio.sleep(wait)  # the optional cap: a fast engine's next steps merge into this message
                sent_at = loop.time()
                if self.flow:
                    self.inflight += 1
                items, self.items, self.last, self.urgent = self.items, [], {}, False
                down = session_pb2.SessionDown()
                add = down.items.add
                for sid, x in items:
                    it = add(stream_id=sid)
                    if isinstance(x, MeshError):
                        it.error.code = x.code
                        it.error.message = x.message
                    else:
                        chunk_into_proto(it.chunk, x)
                yield down
        finally:
            if self._beat is not None:
                self._beat.cancel()
                self._beat = None
            reader.cancel()
            tasks = list(self.tasks.values())
            for t in tasks:
                t.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    def _ended(self) -> bool:
        return not self.tasks and (not self.reading or self.server.closing)

    async def _read(self, request_iterator: AsyncIterator[session_pb2.SessionUp]) -> None:
        try:
            async for msg in request_iterator:
                if msg.flow_control:
                    self.flow = True
                if msg.acked or msg.flow_control:
                    self.acknowledged(msg.acked)
                for sid in msg.cancel:
                    task = self.tasks.get(sid)
                    if task is not None:
                        task.cancel()
                for op in msg.open:
                    self._start(op)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            log.debug("session reader ended: %s", exc)
        except MeshError as exc:  # a message that does not parse (the transport's checked request stream)
            self.failed = exc
        finally:
            # The client closed its side: it reads no more, so its streams are cancelled (and acknowledges nothing).
            self.reading = False
            self.flow = False
            for t in list(self.tasks.values()):
                t.cancel()
            self.wake()

    def _start(self, op: session_pb2.StreamOpen) -> None:
        sid = op.stream_id
        if sid in self.tasks:
            self.push(sid, InvalidArgument(f"stream id {sid} is already open in this session", param="stream_id"))
            return
        if not math.isfinite(op.timeout_s):
            self.push(sid, InvalidArgument(f"timeout_s must be finite, got {op.timeout_s}", param="timeout_s"))
            return
        if self.server.closing:
            self.push(sid, EngineShutdown("the server is shutting down and admits no new streams"))
            return
        if not self.tasks:
            self.busy_since = asyncio.get_running_loop().time()
            self.wake()  # the writer now sends heartbeats while nothing else is sent
        self.tasks[sid] = asyncio.ensure_future(self._stream(sid, op))

    async def _stream(self, sid: int, op: session_pb2.StreamOpen) -> None:
        tp = op.traceparent or None
        span, token = None, None
        if tracing_enabled():
            span = tracer().start_span(
                self.server.method, context=propagate.extract({"traceparent": tp or ""}), kind=SpanKind.SERVER
            )
            token = otel_context.attach(trace.set_span_in_context(span))
        try:
            deadline = time.monotonic() + op.timeout_s if op.timeout_s > 0 else None
            relay = functools.partial(self.push, sid) if self.server.relays else None
            stream = self.server.handler(request_from_proto(op.request), CallInfo(tp, deadline, relay))
            try:
                if deadline is None:
                    await self._pump(sid, stream)
                else:
                    try:
                        async with asyncio.timeout(op.timeout_s) as scope:
                            await self._pump(sid, stream)
                    except TimeoutError:
                        if not scope.expired():
                            raise  # the handler's own TimeoutError: unexpected, Unknown below
                        raise ResponseTimeout("the stream's deadline passed") from None
            finally:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
        except MeshError as exc:
            self.push(sid, exc)
        except asyncio.CancelledError:
            pass  # the client cancelled it, or the session ended
        except Exception as exc:
            log_unexpected(log, "unexpected error in a session stream", exc)
            self.push(sid, Unknown(f"{type(exc).__name__}: {exc}"))
        finally:
            if token is not None:
                otel_context.detach(token)
            if span is not None:
                span.end()
            self.tasks.pop(sid, None)
            self.ended.discard(sid)
            self.started.discard(sid)
            if self._ended():
                self.wake()

    async def _pump(self, sid: int, stream: AsyncIterator[TokenChunk]) -> None:
        # The handler runs to its own end after the terminal (its bookkeeping
        # sees a finished request, not a cancelled one); nothing after it is sent.
        ended = False
        async for chunk in stream:
            if not ended:
                self.push(sid, chunk)
                if ended := "finish_reason" in chunk:
                    self.ended.add(sid)
        if not ended:
            raise StreamIncomplete("the stream ended without a terminal chunk")

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
outbox holds as one message whenever it has something. While a write waits
(the client reads slowly), later tokens of a stream are merged into its
pending chunk (`meshllm.protocol.chunks`), so nothing blocks the engine and
memory stays bounded by tokens, not messages. Tokens reach the client as soon
as they exist when it keeps up: the writer wakes on the first push.

Client side, per (address, method): a reader task demultiplexes items into
one pipe per stream (merging the same way when its consumer lags), a writer
task batches opens and cancels. A stream is an async iterator with the
contract of `generate_stream`: chunks, then exactly one terminal, or the
MeshError the server (or the broken call) stands for; dropping it sends a
cancel. A session that breaks fails all its open streams (`Unavailable` /
`StreamIncomplete`, which the router migrates) and the next stream opens a
new one. Per-request tracing (traceparent) and deadlines travel in
`StreamOpen`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from meshllm.errors import (
    Cancelled,
    MeshError,
    ResponseTimeout,
    StreamIncomplete,
    Unavailable,
    Unknown,
    error_from_code,
)
from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.local import LocalPeers
from meshllm.plane.transport import DEFAULT_STREAM_INTERVAL_S, CallInfo, ChannelCache, GenerateHandler, mesh_error
from meshllm.protocol.chunks import merge_into, mergeable
from meshllm.protocol.convert import chunk_from_proto, chunk_into_proto, request_from_proto, request_to_proto
from meshllm.protocol.types import GenerateChunk, GenerateRequest
from meshllm.tracing import tracer, tracing_enabled
from meshllm.v1 import session_pb2

__all__ = ["DEFAULT_INTERVAL_S", "SessionClient", "SessionHandler", "SessionServer", "generate_to", "session_key"]

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = DEFAULT_STREAM_INTERVAL_S
SessionHandler = GenerateHandler


def _wake(waiter: asyncio.Future[None] | None) -> None:
    """Resolve a task's waiter, if it is waiting."""
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


# ---------------------------------------------------------------- server


class SessionServer:
    """Serves `GenerateSession` calls of one service: each stream runs `handler(request, call)`.

    The handler has the contract of a Generate servicer: chunks, then one
    terminal; a MeshError it raises ends the stream as an error item. `close()`
    lets open sessions end once their streams have; new streams are refused
    with Unavailable.
    """

    def __init__(self, handler: SessionHandler, method: str, *, min_interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.handler = handler
        self.min_interval_s = min_interval_s
        self.method = method  # the span name of each stream when tracing records, e.g. "/meshllm.v1.Worker/Generate"
        self._sessions: set[_ServerSession] = set()
        self.closing = False

    async def serve(
        self, request_iterator: AsyncIterator[session_pb2.SessionUp], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[session_pb2.SessionDown]:
        """The body of a `GenerateSession` handler: yields the messages to send."""
        session = _ServerSession(self)
        self._sessions.add(session)
        try:
            async for down in session.run(request_iterator):
                yield down
        finally:
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
        self.items: list[tuple[int, GenerateChunk | MeshError]] = []
        self.last: dict[int, int] = {}  # stream id -> index in items of its pending chunk
        self.ended: set[int] = set()  # streams whose terminal is pushed: nothing more of them is sent
        self.reading = True
        self._waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        _wake(self._waiter)

    def push(self, sid: int, item: GenerateChunk | MeshError) -> None:
        if sid in self.ended:
            return
        i = self.last.get(sid)
        if i is not None and not isinstance(item, MeshError) and mergeable(item):
            pending = self.items[i][1]
            if not isinstance(pending, MeshError) and mergeable(pending):
                merge_into(pending, item)
                return
        self.last[sid] = len(self.items)
        self.items.append((sid, item))
        self.wake()

    async def run(self, request_iterator: AsyncIterator[session_pb2.SessionUp]) -> AsyncIterator[session_pb2.SessionDown]:
        reader = asyncio.ensure_future(self._read(request_iterator))
        loop = asyncio.get_running_loop()
        interval = self.server.min_interval_s
        sent_at = -1.0
        try:
            while True:
                if not self.items:
                    if self._ended():
                        return
                    self._waiter = loop.create_future()
                    await self._waiter
                    continue
                if interval > 0 and (wait := sent_at + interval - loop.time()) > 0:
                    await asyncio.sleep(wait)  # a fast engine's next steps merge into this message
                sent_at = loop.time()
                items, self.items, self.last = self.items, [], {}
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
                for sid in msg.cancel:
                    task = self.tasks.get(sid)
                    if task is not None:
                        task.cancel()
                for op in msg.open:
                    self._start(op)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            log.debug("session reader ended: %s", exc)
        finally:
            # The client closed its side: it reads no more, so its streams are cancelled.
            self.reading = False
            for t in list(self.tasks.values()):
                t.cancel()
            self.wake()

    def _start(self, op: session_pb2.StreamOpen) -> None:
        sid = op.stream_id
        if sid in self.tasks:
            self.push(sid, Unknown(f"stream id {sid} is already open in this session"))
            return
        if self.server.closing:
            self.push(sid, Unavailable("the server is shutting down and admits no new streams"))
            return
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
            stream = self.server.handler(request_from_proto(op.request), CallInfo(tp, deadline))
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
            log.exception("unexpected error in a session stream", exc_info=exc)
            self.push(sid, Unknown(f"{type(exc).__name__}: {exc}"))
        finally:
            if token is not None:
                otel_context.detach(token)
            if span is not None:
                span.end()
            self.tasks.pop(sid, None)
            self.ended.discard(sid)
            if self._ended():
                self.wake()

    async def _pump(self, sid: int, stream: AsyncIterator[GenerateChunk]) -> None:
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


# ---------------------------------------------------------------- client


class _Pipe:
    """One stream's chunks on the client: merged while the consumer lags."""

    __slots__ = ("error", "queue", "waiter")

    def __init__(self) -> None:
        self.queue: collections.deque[GenerateChunk] = collections.deque()
        self.error: MeshError | None = None
        self.waiter: asyncio.Future[None] | None = None

    def put(self, chunk: GenerateChunk) -> None:
        q = self.queue
        if q and mergeable(chunk) and mergeable(q[-1]):
            merge_into(q[-1], chunk)
        else:
            q.append(chunk)
        self._wake()

    def fail(self, err: MeshError) -> None:
        if self.error is None:
            self.error = err
        self._wake()

    def _wake(self) -> None:
        _wake(self.waiter)


class _ClientSession:
    """One open GenerateSession call and the streams on it."""

    def __init__(self, call: Any, peer: str, stats: list[int]) -> None:
        self.call = call
        self.peer = peer
        self.stats = stats  # [messages, items] received, shared by the client's sessions
        self.pipes: dict[int, _Pipe] = {}
        self.dead = False
        self._opens: list[session_pb2.StreamOpen] = []
        self._cancels: list[int] = []
        self._send_waiter: asyncio.Future[None] | None = None
        self._reader = asyncio.ensure_future(self._read())
        self._writer = asyncio.ensure_future(self._write())

    def open(self, sid: int, op: session_pb2.StreamOpen) -> _Pipe:
        pipe = _Pipe()
        self.pipes[sid] = pipe
        self._opens.append(op)
        self._kick()
        return pipe

    def release(self, sid: int, *, cancel: bool) -> None:
        if self.pipes.pop(sid, None) is not None and cancel and not self.dead:
            self._cancels.append(sid)
            self._kick()

    def _kick(self) -> None:
        _wake(self._send_waiter)

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self._opens and not self._cancels:
                    self._send_waiter = loop.create_future()
                    await self._send_waiter
                    continue
                msg = session_pb2.SessionUp(open=self._opens, cancel=self._cancels)
                self._opens, self._cancels = [], []
                await self.call.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            log.debug("session to %s: write failed: %s", self.peer, exc)  # the reader reports the call's end

    async def _read(self) -> None:
        err: MeshError = StreamIncomplete(f"{self.peer} ended the session")
        try:
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    break
                self.stats[0] += 1
                self.stats[1] += len(msg.items)
                pipes = self.pipes
                for item in msg.items:
                    pipe = pipes.get(item.stream_id)
                    if pipe is None:
                        continue  # a stream the client already dropped
                    if item.HasField("error"):
                        pipe.fail(error_from_code(item.error.code, item.error.message))
                    else:
                        pipe.put(chunk_from_proto(item.chunk))
        except grpc.aio.AioRpcError as exc:
            err = mesh_error(exc)
        except asyncio.CancelledError:
            err = Cancelled(f"the session to {self.peer} was closed")
            raise
        finally:
            self.dead = True
            for pipe in self.pipes.values():
                pipe.fail(err)
            self._kick()
            self._writer.cancel()

    @property
    def closed_down(self) -> bool:
        """Whether its reader and writer have both ended (nothing left to close)."""
        return self._reader.done() and self._writer.done()

    async def aclose(self) -> None:
        self.dead = True
        self.call.cancel()
        self._reader.cancel()
        self._writer.cancel()
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)


class SessionClient(AsyncCloseable):
    """Generate streams to one peer over one `GenerateSession` call, opened on first use and after a break.

    `open_call()` starts a new call (e.g. `stub.GenerateSession()`). When
    tracing records, each stream is a CLIENT span named `method` (the logical
    Generate call) whose context travels in `StreamOpen.traceparent`.
    """

    def __init__(self, open_call: Callable[[], Any], peer: str, method: str) -> None:
        self._open_call = open_call
        self.peer = peer
        self.method = method  # the span name of each stream when tracing records
        self._session: _ClientSession | None = None
        self._ids = itertools.count(1)
        self._dead: list[_ClientSession] = []
        self.stats = [0, 0]  # messages and stream items received (items per message = batching achieved)

    def _current(self) -> _ClientSession:
        if self.closed:
            raise Cancelled(f"the session client of {self.peer} is closed")
        s = self._session
        if s is None or s.dead:
            if s is not None:
                self._dead = [d for d in self._dead if not d.closed_down]
                self._dead.append(s)
            s = self._session = _ClientSession(self._open_call(), self.peer, self.stats)
        return s

    async def generate(
        self, request: GenerateRequest, *, traceparent: str | None = None, deadline: float | None = None
    ) -> AsyncIterator[GenerateChunk]:
        """Chunks of one stream, then exactly one terminal; or the MeshError it ended with.

        `deadline` is a `time.monotonic()` instant: past it the stream fails
        with ResponseTimeout (the server enforces the same deadline).
        """
        timeout_s = 0.0
        if deadline is not None:
            timeout_s = deadline - time.monotonic()
            if timeout_s <= 0:
                raise ResponseTimeout("deadline exceeded before the call was made")
        session = self._current()
        sid = next(self._ids)
        span = None
        if tracing_enabled():
            span = tracer().start_span(self.method, kind=SpanKind.CLIENT)
            carrier: dict[str, str] = {}
            propagate.inject(carrier, context=trace.set_span_in_context(span))
            traceparent = carrier.get("traceparent", traceparent)
        op = session_pb2.StreamOpen(
            stream_id=sid, request=request_to_proto(request), traceparent=traceparent or "", timeout_s=timeout_s
        )
        pipe = session.open(sid, op)
        loop = asyncio.get_running_loop()
        finished = False
        try:
            while True:
                q = pipe.queue
                while q:
                    chunk = q.popleft()
                    if "finish_reason" in chunk:
                        finished = True
                        yield chunk
                        return
                    yield chunk
                if pipe.error is not None:
                    finished = True
                    raise pipe.error
                pipe.waiter = waiter = loop.create_future()
                if deadline is None:
                    await waiter
                else:
                    try:
                        await asyncio.wait_for(waiter, deadline - time.monotonic())
                    except TimeoutError:
                        raise ResponseTimeout(f"no answer from {self.peer} before the deadline") from None
        finally:
            session.release(sid, cancel=not finished)
            if span is not None:
                span.end()

    async def _aclose(self) -> None:
        sessions = [s for s in (self._session, *self._dead) if s is not None]
        self._session, self._dead = None, []
        await asyncio.gather(*(s.aclose() for s in sessions), return_exceptions=True)


# ---------------------------------------------------------------- choosing the way


def session_key(service: str) -> str:
    """The `ChannelCache.shared` key of a process's session to a `service` ("Worker", "Router")."""
    return f"{service.lower()}-session"


def generate_to(
    channels: ChannelCache, address: str, service: str, request: GenerateRequest, call: CallInfo | None = None
) -> AsyncIterator[GenerateChunk]:
    """One Generate stream to `meshllm.v1.<service>` at `address`.

    A peer living in this very process (`channels.local`, meshllm run) is
    called directly (plane/local.py); any other goes over the process's one
    GenerateSession call to it.
    """
    info = call or CallInfo()
    local: LocalPeers | None = channels.local
    peer = local.get(address) if local is not None else None
    if peer is not None:
        return peer.generate(request, info)

    def make(channel: grpc.aio.Channel) -> SessionClient:
        open_call = channel.stream_stream(
            f"/meshllm.v1.{service}/GenerateSession",
            request_serializer=session_pb2.SessionUp.SerializeToString,
            response_deserializer=session_pb2.SessionDown.FromString,
        )
        return SessionClient(open_call, f"{service.lower()} {address}", f"/meshllm.v1.{service}/Generate")

    session = channels.shared(address, session_key(service), make)
    return session.generate(request, traceparent=info.traceparent, deadline=info.deadline)

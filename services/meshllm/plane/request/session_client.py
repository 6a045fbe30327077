"""The client side of Generate sessions (`SessionClient`; the server is in plane/request/session.py).

Per (address, method): a reader task demultiplexes items into one pipe per
stream (merging the same way as the server when its consumer lags), a writer
task batches opens, cancels and acknowledgements: each message taken is
acknowledged on the loop's next turn, once its items are in their pipes or
relayed (the consumer tasks they woke work while the next message travels),
and the server sends its next message only then (flow control,
plane/request/session.py). A stream is an async iterator with the
contract of `generate_stream`: chunks, then exactly one terminal, or the
MeshError the server (or the broken call) stands for; dropping it sends a
cancel. A session that breaks fails all its open streams (`Unavailable` /
`StreamIncomplete`, which the router migrates) and the next stream opens a
new one. Per-request tracing (traceparent) and deadlines travel in
`StreamOpen`.

Liveness (`SessionLiveness`, docs/architecture.md "Stall detection"): a
watchdog task per session fails the whole session when it hears nothing —
not even a server heartbeat — for its stall bound (a frozen peer), and one
stream when it gets no chunk after its first for its progress bound (a hung
engine), both with `Disconnected`, which the router migrates.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from meshllm.errors import (
    Cancelled,
    Disconnected,
    MeshError,
    ResponseTimeout,
    StreamIncomplete,
    Unknown,
    error_from_code,
    log_unexpected,
)
from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.request.liveness import SessionLiveness
from meshllm.plane.request.transport import ChunkRelay, mesh_error
from meshllm.protocol.chunks import merge_into, mergeable
from meshllm.protocol.convert import chunk_from_proto, request_to_proto
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.tracing import tracer, tracing_enabled
from meshllm.v1 import session_pb2

__all__ = ["STALL_STEPS", "STEP_WEIGHT", "SessionClient", "wake"]

log = logging.getLogger(__name__)

# A stall bound is at least this many of the session's observed steps (SessionLiveness).
STALL_STEPS = 5.0
STEP_WEIGHT = 0.1  # of the newest gap in the observed step's exponential mean


def wake(waiter: asyncio.Future[None] | None) -> None:
    """Resolve a task's waiter, if it is waiting."""
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class _Pipe:
    """One stream's chunks on the client: merged while the consumer lags, or handed to its relay."""

    __slots__ = ("error", "expired", "last_at", "queue", "relay", "relay_failed", "waiter")

    def __init__(self, relay: ChunkRelay | None = None) -> None:
        self.queue: collections.deque[TokenChunk] = collections.deque()
        self.error: MeshError | None = None
        self.expired = False  # its deadline passed (set by a timer: no wait_for per wake-up)
        self.waiter: asyncio.Future[None] | None = None
        self.last_at = 0.0  # loop time its last chunk arrived; 0 = none yet (no progress deadline before the first)
        self.relay = relay  # takes the non-terminal chunks as they arrive (SessionClient.generate)
        self.relay_failed = False  # the relay raised: the server's stream goes on and must be cancelled

    def put(self, chunk: TokenChunk) -> None:
        if self.error is not None:
            return  # a failed stream takes nothing more (after its relay failed, not even its terminal)
        relay = self.relay
        if relay is not None and "finish_reason" not in chunk:
            try:
                relay(chunk)
            except Exception as exc:  # the relay's bug fails its stream, never the session's reader
                log_unexpected(log, "a stream's chunk relay failed", exc)
                self.relay = None
                self.relay_failed = True
                self.fail(Unknown(f"{type(exc).__name__}: {exc}"))
            return
        q = self.queue
        if q and mergeable(chunk) and mergeable(q[-1]):
            merge_into(q[-1], chunk)
        else:
            q.append(chunk)
        self._wake()

    @property
    def finished(self) -> bool:
        """Its terminal has arrived (the consumer has yet to read it)."""
        return bool(self.queue) and "finish_reason" in self.queue[-1]

    def fail(self, err: MeshError) -> None:
        if self.error is None:
            self.error = err
        self._wake()

    def expire(self) -> None:
        self.expired = True
        self._wake()

    def _wake(self) -> None:
        wake(self.waiter)


class _ClientSession:
    """One open GenerateSession call and the streams on it, watched for stalls (`SessionLiveness`)."""

    def __init__(self, call: Any, peer: str, stats: list[int], liveness: SessionLiveness) -> None:
        self.call = call
        self.peer = peer
        self.stats = stats  # [messages, items] received, shared by the client's sessions
        self.liveness = liveness
        self.pipes: dict[int, _Pipe] = {}
        self.dead = False
        self._loop = asyncio.get_running_loop()
        self.last_rx = self.busy_since = self._loop.time()  # last message; first open stream since idle
        self.step_s = 0.0  # exponential mean of the gaps between messages while streams are open
        self._stall: MeshError | None = None  # why the watchdog broke the session
        self._opens: list[session_pb2.StreamOpen] = []
        self._cancels: list[int] = []
        self._acks = 0  # messages taken and not yet acknowledged (SessionUp.acked)
        self._ack_due = False  # an acknowledgement is scheduled for after the consumers' turn
        self._flow_sent = False  # SessionUp.flow_control goes in the session's first message
        self._send_waiter: asyncio.Future[None] | None = None
        self._busy_waiter: asyncio.Future[None] | None = None
        self._reader = asyncio.ensure_future(self._read())
        self._writer = asyncio.ensure_future(self._write())
        self._watchdog = asyncio.ensure_future(self._watch())

    def open(self, sid: int, op: session_pb2.StreamOpen, relay: ChunkRelay | None = None) -> _Pipe:
        pipe = _Pipe(relay)
        if not self.pipes:
            self.busy_since = self._loop.time()
            wake(self._busy_waiter)
        self.pipes[sid] = pipe
        self._opens.append(op)
        self._kick()
        return pipe

    def release(self, sid: int, *, cancel: bool) -> None:
        if self.pipes.pop(sid, None) is not None and cancel and not self.dead:
            self._cancels.append(sid)
            self._kick()

    def _kick(self) -> None:
        wake(self._send_waiter)

    def _acknowledge(self) -> None:
        # Runs on the loop's next turn after the message(s) taken: their relays have already run, while the
        # consumer tasks and writes they woke run after it, so the server's next message travels while they
        # work (one message in flight, FLOW_WINDOW). A process too busy to reach its next turn acknowledges
        # late, and the server merges meanwhile. Acknowledging only after the consumers' writes instead cost
        # the split mesh at c=64 4 % of its req/s and 1.4x its ITL p50 (docs/benchmarks.md, "Change against
        # its base: a message acknowledged after the consumers it woke").
        self._ack_due = False
        if self._acks and not self._opens and not self._cancels and self._flow_sent:
            # A carrier that can write at once (TCP) takes the acknowledgement here, without waking the writer.
            write_now = getattr(self.call, "write_nowait", None)
            if write_now is not None and write_now(session_pb2.SessionUp(acked=self._acks)):
                self._acks = 0
                return
        self._kick()

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self._opens and not self._cancels and (not self._acks or self._ack_due):
                    self._send_waiter = loop.create_future()
                    await self._send_waiter
                    continue
                msg = session_pb2.SessionUp(open=self._opens, cancel=self._cancels, acked=self._acks)
                if not self._flow_sent:
                    msg.flow_control = self._flow_sent = True
                self._opens, self._cancels, self._acks = [], [], 0
                await self.call.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            log.debug("session to %s: write failed: %s", self.peer, exc)  # the reader reports the call's end

    async def _read(self) -> None:
        err: MeshError = StreamIncomplete(f"{self.peer} ended the session")
        try:
            receive = getattr(self.call, "receive", None)
            if receive is not None:
                receive(self._take)  # a TcpCall hands each message over as it is read; read() returns only the end
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    break
                self._take(msg)
        except grpc.aio.AioRpcError as exc:
            err = mesh_error(exc)
        except MeshError as exc:  # a TcpCall (plane/request/tcp_session.py) raises the session's end as it is
            err = exc
        except asyncio.CancelledError:
            err = Cancelled(f"the session to {self.peer} was closed")
            raise
        finally:
            self.dead = True
            if self._stall is not None:
                err = self._stall
            for pipe in self.pipes.values():
                pipe.fail(err)
            self._kick()
            self._writer.cancel()
            self._watchdog.cancel()

    def _take(self, msg: session_pb2.SessionDown) -> None:
        """One message from the server: its items to their streams' pipes, and its acknowledgement scheduled."""
        if self.dead:
            return
        loop = self._loop
        now = loop.time()
        pipes = self.pipes
        if pipes:
            self.step_s += STEP_WEIGHT * (now - max(self.last_rx, self.busy_since) - self.step_s)
        self.last_rx = now
        if not msg.items:
            return  # a heartbeat
        self.stats[0] += 1
        self.stats[1] += len(msg.items)
        self._acks += 1
        if not self._ack_due:
            # Ahead of what the items wake: the next message travels while their consumers work (see _acknowledge).
            self._ack_due = True
            loop.call_soon(self._acknowledge)
        for item in msg.items:
            pipe = pipes.get(item.stream_id)
            if pipe is None:
                continue  # a stream the client already dropped
            if item.HasField("error"):
                pipe.fail(error_from_code(item.error.code, item.error.message))
            else:
                pipe.last_at = now
                pipe.put(chunk_from_proto(item.chunk))

    async def _watch(self) -> None:
        """Break the session when its peer falls silent, and fail streams that stop making progress."""
        live, loop = self.liveness, self._loop
        tick = live.stall_timeout_s / 8  # how late past its bound a stall is noticed
        while True:
            if not self.pipes:
                self._busy_waiter = loop.create_future()
                await self._busy_waiter
                continue
            await asyncio.sleep(tick)
            now = loop.time()
            steps = STALL_STEPS * self.step_s
            silent, bound = now - max(self.last_rx, self.busy_since), max(live.stall_timeout_s, steps)
            if self.pipes and silent > bound:
                self._stall = Disconnected(
                    f"{self.peer} sent nothing for {silent:.1f} s while {len(self.pipes)} streams were open "
                    f"(stall bound {bound:.1f} s)"
                )
                log.warning("session to %s: %s; failing its streams", self.peer, self._stall.message)
                self.dead = True  # no new stream joins it; the next opens a new call
                self.call.cancel()
                self._reader.cancel()
                return
            if not live.stream_stall_timeout_s:
                continue
            stream_bound = max(live.stream_stall_timeout_s, steps)
            for sid, pipe in list(self.pipes.items()):
                if pipe.last_at and pipe.error is None and now - pipe.last_at > stream_bound and not pipe.finished:
                    del self.pipes[sid]  # nothing more of it is delivered; the server is told to stop it
                    pipe.fail(
                        Disconnected(
                            f"stream {sid} made no progress on {self.peer} for {now - pipe.last_at:.1f} s "
                            f"(bound {stream_bound:.1f} s)"
                        )
                    )
                    self._cancels.append(sid)
                    self._kick()

    @property
    def closed_down(self) -> bool:
        """Whether its reader, writer and watchdog have all ended (nothing left to close)."""
        return self._reader.done() and self._writer.done() and self._watchdog.done()

    async def aclose(self) -> None:
        self.dead = True
        self.call.cancel()
        self._reader.cancel()
        self._writer.cancel()
        self._watchdog.cancel()
        await asyncio.gather(self._reader, self._writer, self._watchdog, return_exceptions=True)


class SessionClient(AsyncCloseable):
    """Generate streams to one peer over one `GenerateSession` call, opened on first use and after a break.

    `open_call()` starts a new call (e.g. `stub.GenerateSession()`). When
    tracing records, each stream is a CLIENT span named `method` (the logical
    Generate call) whose context travels in `StreamOpen.traceparent`.
    `liveness` bounds how long a session or a started stream may stall.
    """

    def __init__(self, open_call: Callable[[], Any], peer: str, method: str, *, liveness: SessionLiveness | None = None) -> None:
        self._open_call = open_call
        self.peer = peer
        self.method = method  # the span name of each stream when tracing records
        self.liveness = liveness if liveness is not None else SessionLiveness()
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
            s = self._session = _ClientSession(self._open_call(), self.peer, self.stats, self.liveness)
        return s

    # size: one stream of a session: open, per-chunk reads and cancel in one generator whose finally sees every exit
    async def generate(
        self,
        request: TokenRequest,
        *,
        traceparent: str | None = None,
        deadline: float | None = None,
        relay: ChunkRelay | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """Chunks of one stream, then exactly one terminal; or the MeshError it ended with.

        `deadline` is a `time.monotonic()` instant: past it the stream fails
        with ResponseTimeout (the server enforces the same deadline).

        With a `relay`, the session's reader calls `relay(chunk)` with each
        non-terminal chunk as its message arrives, in order, and the iterator
        yields only the terminal (or raises the error): a relay (the router)
        forwards tokens without waking the consuming task once per message.
        A relay must not block or await; one that raises fails its stream with
        Unknown. Nothing reaches the relay after the iterator is closed.
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
        pipe = session.open(sid, op, relay)
        loop = asyncio.get_running_loop()
        timer = None if deadline is None else loop.call_later(deadline - time.monotonic(), pipe.expire)
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
                    finished = not pipe.relay_failed  # the server ended it, unless it failed here
                    raise pipe.error
                if pipe.expired:
                    raise ResponseTimeout(f"no answer from {self.peer} before the deadline")
                pipe.waiter = loop.create_future()
                await pipe.waiter
        finally:
            if timer is not None:
                timer.cancel()
            session.release(sid, cancel=not finished)
            if span is not None:
                span.end()

    async def _aclose(self) -> None:
        sessions = [s for s in (self._session, *self._dead) if s is not None]
        self._session, self._dead = None, []
        await asyncio.gather(*(s.aclose() for s in sessions), return_exceptions=True)

"""Generate sessions on a plain TCP (or TLS) connection: the session protocol without gRPC's cost per message.

A Generate session (session.proto, plane/request/session.py) moves all of a client's
streams to one peer on one long-lived call. Over gRPC every message of that
call pays HTTP/2 framing, the completion-queue poller thread and a loop
wake-up per read at each end; the same `SessionDown` written as a
length-prefixed frame on a socket costs a fraction of that (docs/benchmarks.md
"Session carriers"). A worker or router started with `--session-port` also
serves its sessions so and registers the address in discovery
(`Instance.session_address`); clients that know it use it, everything else
(health, reflection, unary calls, grpcurl) stays on gRPC.

Frames: a 5-byte header (kind, little-endian payload length) and the payload.

- HELLO (client, first frame): JSON `{"service": "Worker", "caller": id, "token": t}`.
  The server checks the mesh token as the gRPC interceptor does (constant-time;
  refused with `FailedPrecondition`, which UNAUTHENTICATED maps to); with TLS
  and `--tls-ca` the handshake already admitted only mesh certificates.
- UP (client): a `SessionUp`.  DOWN (server): a `SessionDown`.
- END (server, last frame): JSON `{"code": class name, "message": ...}`; an
  empty code is a clean end (the client reads EOF).

Backpressure is the socket's: the server writes each message when it is
ready and waits only while the kernel buffer is full (`pause_writing`), so
chunks that arrive meanwhile merge into the next message; a reader takes every
complete frame of one `data_received` at once. The session protocol itself
(streams, cancels, heartbeats, liveness) is plane/request/session.py's, unchanged:
`TcpCall` stands for the gRPC call object `SessionClient` drives, and
`TcpSessionServer` feeds a connection to `SessionServer.serve`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

import grpc

from meshllm.errors import (
    CannotConnect,
    Disconnected,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    error_from_code,
    log_unexpected,
)
from meshllm.plane.auth import session_scope
from meshllm.plane.request.tcp_frames import DOWN, END, HELLO, UP, FrameConnection
from meshllm.v1 import session_pb2

if TYPE_CHECKING:
    from meshllm.plane.request.session import SessionServer

__all__ = ["TcpCall", "TcpSessionServer"]

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
MAX_HELLO_BYTES = 64 * 1024


# ---------------------------------------------------------------- client


class TcpCall:
    """A GenerateSession "call" on a TCP connection, with the three methods `SessionClient` uses of gRPC's.

    `read()` returns the next `SessionDown`, `grpc.aio.EOF` after a clean end,
    or raises the MeshError the server ended the session with (a broken
    connection is `Disconnected`, one never made `CannotConnect`: both
    Unavailable, which the router migrates). `write(up)` sends a `SessionUp`;
    `cancel()` closes the connection.
    """

    def __init__(
        self,
        address: str,
        service: str,
        *,
        caller: str,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.address = address
        self._messages: collections.deque[session_pb2.SessionDown] = collections.deque()
        self._receiver: Callable[[session_pb2.SessionDown], None] | None = None  # takes DOWN messages as read
        self._waiter: asyncio.Future[None] | None = None
        self._error: MeshError | None = None
        self._eof = False
        self._conn = FrameConnection(max_message_bytes, self._on_frame, self._on_lost)
        hello = {"service": service, "caller": caller}
        if token is not None:
            hello["token"] = token
        self._connected = asyncio.ensure_future(
            self._connect(address, json.dumps(hello).encode(), ssl_context, connect_timeout_s)
        )

    async def _connect(self, address: str, hello: bytes, ctx: ssl.SSLContext | None, timeout_s: float) -> None:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                await loop.create_connection(
                    lambda: self._conn, host, int(port), ssl=ctx, server_hostname=host if ctx is not None else None
                )
        except (OSError, TimeoutError, ValueError, ssl.SSLError) as exc:
            err = CannotConnect(f"cannot open a session to {address}: {exc or type(exc).__name__}")
            err.from_transport = True
            self._fail(err)
            return
        self._conn.write(HELLO, hello)

    def _on_frame(self, kind: int, payload: bytes) -> None:
        if kind == DOWN:
            try:
                down = session_pb2.SessionDown.FromString(payload)
            except Exception:
                self._fail(Disconnected(f"{self.address} sent a malformed session message"))
                self._conn.abort()
                return
            receiver = self._receiver
            if receiver is None:
                self._messages.append(down)
            else:
                try:
                    receiver(down)  # no reader task wakes per message
                except Exception as exc:
                    log_unexpected(log, "a session message's receiver failed", exc)
                    self._fail(Disconnected(f"the session to {self.address} failed on a message: {exc!r}"))
                    self._conn.abort()
                return
        elif kind == END:
            try:
                end = json.loads(payload)
                code, message = str(end.get("code", "")), str(end.get("message", ""))
            except (ValueError, AttributeError):
                code, message = "Unknown", "malformed end of session"
            if code:
                self._fail(error_from_code(code, message))
            else:
                self._eof = True
        else:
            self._fail(Disconnected(f"{self.address} sent an unexpected session frame (kind {kind})"))
            self._conn.abort()
            return
        self._wake()

    def _on_lost(self, exc: Exception | None) -> None:
        if not self._eof:
            err = Disconnected(f"the session connection to {self.address} broke" + (f": {exc}" if exc else ""))
            err.from_transport = True
            self._fail(err)
        self._wake()

    def _fail(self, err: MeshError) -> None:
        if self._error is None:
            self._error = err
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def receive(self, receiver: Callable[[session_pb2.SessionDown], None]) -> None:
        """Hand every DOWN message to `receiver` as it is read (those read already first); `read()` then
        returns only the end: `grpc.aio.EOF`, or the session's error raised."""
        while self._messages:
            receiver(self._messages.popleft())
        self._receiver = receiver

    async def read(self) -> Any:
        while True:
            if self._messages:
                return self._messages.popleft()
            if self._error is not None:
                raise self._error
            if self._eof:
                return grpc.aio.EOF
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    def write_nowait(self, message: session_pb2.SessionUp) -> bool:
        """Write `message` now, without waiting for the kernel's buffer; False (nothing written) before the
        connection is up or after it broke. For small control messages (acknowledgements)."""
        up = self._connected
        if not up.done() or up.cancelled() or up.exception() is not None or self._error is not None or self._conn.lost:
            return False
        self._conn.write(UP, message.SerializeToString())
        return True

    async def write(self, message: session_pb2.SessionUp) -> None:
        if not self._connected.done():
            await asyncio.shield(self._connected)
        if self._error is not None or self._conn.lost:
            raise asyncio.InvalidStateError("the session connection is closed")
        self._conn.write(UP, message.SerializeToString())
        await self._conn.drain()

    def cancel(self) -> bool:
        self._connected.cancel()
        self._conn.abort()
        return True


# ---------------------------------------------------------------- server


class TcpSessionServer:
    """Serves the GenerateSession calls of `services` ("Worker" → its SessionServer) on a TCP port."""

    def __init__(
        self,
        services: Mapping[str, SessionServer],
        *,
        host: str,
        port: int,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.services = dict(services)
        self.host = host
        self.requested_port = port
        self.token = token
        self.ssl_context = ssl_context
        self.max_message_bytes = max_message_bytes
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._conns: set[FrameConnection] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, self.host, self.requested_port, ssl=self.ssl_context)
        self.port = self._server.sockets[0].getsockname()[1]

    def _accept(self) -> FrameConnection:
        state = _ServerConn(self)
        self._conns.add(state.conn)
        return state.conn

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def wait_closed(self, grace_s: float | None = None) -> None:
        """Wait for open sessions to end (their SessionServer was closed), then cut what is left."""
        if self._tasks:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace_s):
                    await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.aclose()

    async def aclose(self) -> None:
        self.stop_accepting()
        for c in list(self._conns):
            c.abort()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class _ServerConn:
    """One accepted connection: the hello, then one session of the named service."""

    def __init__(self, owner: TcpSessionServer) -> None:
        self.owner = owner
        self.conn = FrameConnection(owner.max_message_bytes, self._on_frame, self._on_lost)
        self.ups: collections.deque[session_pb2.SessionUp] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.failed: MeshError | None = None
        self.greeted = False
        self.take_acks: Callable[[int], None] | None = None  # the session's, while it runs (SessionServer.serve)
        self._hello_timer = asyncio.get_running_loop().call_later(HELLO_TIMEOUT_S, self.conn.abort)

    def _on_frame(self, kind: int, payload: bytes) -> None:
        if not self.greeted:
            self._hello_timer.cancel()
            self.greeted = True
            if kind != HELLO or len(payload) > MAX_HELLO_BYTES:
                self._refuse(InvalidArgument("a session connection must start with its hello"))
                return
            self._hello(payload)
            return
        if kind != UP:
            self.failed = InvalidArgument(f"unexpected session frame from the client (kind {kind})")
        else:
            try:
                up = session_pb2.SessionUp.FromString(payload)
            except Exception:
                self.failed = InvalidArgument("a session message from the client does not parse")
            else:
                take = self.take_acks
                if take is not None and not self.ups and not up.open and not up.cancel and not up.flow_control:
                    take(up.acked)  # an acknowledgement alone (nearly every message): no reader task wakes for it
                    return
                self.ups.append(up)
        self._wake()

    def _hello(self, payload: bytes) -> None:
        try:
            hello = json.loads(payload)
            service, caller, token = str(hello["service"]), str(hello.get("caller", "")), hello.get("token")
        except (ValueError, KeyError, TypeError):
            self._refuse(InvalidArgument("malformed session hello"))
            return
        server = self.owner.services.get(service)
        if server is None:
            self._refuse(InvalidArgument(f"no service {service!r} here (serves {', '.join(sorted(self.owner.services))})"))
            return
        expected = self.owner.token
        sent = token.encode() if isinstance(token, str) else b""
        if expected is not None and not hmac.compare_digest(sent, expected.encode()):
            self._refuse(FailedPrecondition("this service accepts only mesh peers: missing or wrong mesh token"))
            return
        principal = "token" if expected is not None else "anonymous"
        peer_cert = self.conn.transport.get_extra_info("peercert") if self.conn.transport is not None else None
        if peer_cert:
            subject = ",".join("=".join(kv) for rdn in peer_cert.get("subject", ()) for kv in rdn)
            principal = "cert:" + subject
        task = asyncio.ensure_future(self._serve(server, f"{principal}/{caller}"))
        self.owner._tasks.add(task)
        task.add_done_callback(self.owner._tasks.discard)

    def _refuse(self, err: MeshError) -> None:
        self.conn.write(END, json.dumps({"code": err.code, "message": err.message}).encode())
        if self.conn.transport is not None:
            self.conn.transport.close()

    def _on_lost(self, exc: Exception | None) -> None:
        self._hello_timer.cancel()
        self.closed = True
        self.owner._conns.discard(self.conn)
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _bind_acks(self, take: Callable[[int], None] | None) -> None:
        self.take_acks = take

    async def _requests(self) -> AsyncIterator[session_pb2.SessionUp]:
        while True:
            if self.ups:
                yield self.ups.popleft()
                continue
            if self.failed is not None:
                raise self.failed
            if self.closed:
                return
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter

    async def _serve(self, server: SessionServer, identity: str) -> None:
        session_scope.set(identity)  # this task's streams belong to the session's caller
        conn = self.conn
        end: dict[str, str] = {"code": "", "message": ""}
        try:
            async for down in server.serve(self._requests(), None, bind_acks=self._bind_acks):
                if conn.lost:
                    break
                conn.write(DOWN, down.SerializeToString())
                await conn.drain()
        except MeshError as exc:
            end = {"code": exc.code, "message": exc.message}
        except Exception as exc:
            log.exception("a TCP session failed")
            end = {"code": "Unknown", "message": f"{type(exc).__name__}: {exc}"}
        finally:
            if not conn.lost and conn.transport is not None:
                conn.write(END, json.dumps(end).encode())
                conn.transport.close()

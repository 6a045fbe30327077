"""The NATS backend of the events plane: core NATS (at most once), reconnecting forever.

`NatsEventBus.connect(url)` fails with CannotConnect when the first connection
cannot be made within `connect_timeout_s` (a wrong URL should stop a service
at startup). After that the client reconnects by itself forever, every
`reconnect_wait_s`; nats-py replays the subscriptions on each new connection,
so a `Subscription` survives a nats-server restart without its consumer
noticing (messages sent while it was away are lost: consumers repair gaps).

Publishing goes through this module's own bounded buffer, drained by one
background task that hands a message to the client only while it is
connected. So while NATS is away messages wait here (bounded by count and
bytes, oldest dropped and counted) and go out in order after the reconnect,
after the client has replayed its subscriptions.

Connection trouble is logged (warning, repeats rate-limited), never raised
from the client's callbacks.

Security (`NatsCredentials`, docs/security.md): TLS with a CA and client
certificate, and a token, user/password, creds file or NKey seed. At the
first connection refused credentials or a failed TLS handshake end the
attempt at once with one line naming the flags to check (instead of
retrying until the connect timeout). With TLS configured the client never
falls back to plaintext: a server that does not require TLS is refused
before any credential is sent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from typing import Any

import nats
import nats.errors
from google.protobuf.message import Message
from nats.aio.msg import Msg

from meshllm.credentials import NatsCredentials
from meshllm.errors import CannotConnect, Unavailable
from meshllm.logs import redact_text, redact_url
from meshllm.plane.events.base import DEFAULT_MAX_PENDING, EventBus, M, Subscription, check_subject
from meshllm.plane.events.nats_client import SecureClient, is_refusal, refusal_message

__all__ = ["NatsEventBus"]

log = logging.getLogger(__name__)

_REPEAT_LOG_S = 30.0  # the same connection error is logged at warning at most this often
_ROUNDTRIP_LIMIT_S = 60  # longer than stale-connection detection (3 pings x 10 s), see _roundtrip
_YIELD_EVERY = 256  # hand this many buffered messages to the client between yields to the loop


class NatsEventBus(EventBus):
    """An `EventBus` on core NATS. Make one with `await NatsEventBus.connect(url)`.

    `connected` tells whether the client is connected now; `buffered` how
    many published messages wait in this bus's buffer; `reconnects` how many
    times the connection came back.
    """

    def __init__(
        self,
        *,
        max_buffered: int = 10_000,
        max_buffered_bytes: int = 64 * 1024 * 1024,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        super().__init__()
        self.max_buffered = max_buffered
        self.max_buffered_bytes = max_buffered_bytes
        self.max_pending = max_pending
        self.reconnects = 0
        self._nc = SecureClient()
        self._connecting: asyncio.Future[BaseException] | None = None  # set by _on_error when the server refuses us
        self._connect_error: BaseException | None = None
        self._buffer: collections.deque[tuple[int, str, bytes]] = collections.deque()
        self._buffered_bytes = 0
        self._published_seq = 0  # sequence number of the last message published
        self._done_seq = 0  # every message up to this one was handed to the client or dropped
        self._wake = asyncio.Event()  # the pump has something to do
        self._progress = asyncio.Event()  # _done_seq moved or the connection came back
        self._pump_task: asyncio.Task[None] | None = None
        self._roundtrips: set[asyncio.Future[None]] = set()
        self._disconnected_at: float | None = None
        self._last_error: tuple[str, float] = ("", 0.0)
        self._quiet = False  # no disconnect / close warnings: we are closing on purpose

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        name: str = "meshllm",
        reconnect_wait_s: float = 1.0,
        connect_timeout_s: float = 10.0,
        max_buffered: int = 10_000,
        max_buffered_bytes: int = 64 * 1024 * 1024,
        max_pending: int = DEFAULT_MAX_PENDING,
        credentials: NatsCredentials | None = None,
    ) -> NatsEventBus:
        """Connect to `url` (`nats://host:port`, or several comma-separated) and start the drain.

        CannotConnect if no connection is made within `connect_timeout_s`, or at once when the server refuses
        `credentials` or the TLS handshake. `max_buffered(_bytes)` bound the publish buffer, `max_pending` each
        subscription's queue."""
        credentials = credentials if credentials is not None else NatsCredentials()
        bus = cls(max_buffered=max_buffered, max_buffered_bytes=max_buffered_bytes, max_pending=max_pending)
        servers = [u.strip() for u in url.split(",") if u.strip()]
        shown = redact_url(url)  # a URL may hold user:password or a token: never printed
        bus._nc.require_tls = credentials.tls or any(s.startswith("tls://") for s in servers)
        bus._nc.credentials = credentials
        options = credentials.connect_options()
        refused: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        bus._connecting = refused
        connecting = asyncio.ensure_future(
            bus._nc.connect(
                servers,
                name=name,
                error_cb=bus._on_error,
                disconnected_cb=bus._on_disconnected,
                reconnected_cb=bus._on_reconnected,
                closed_cb=bus._on_closed,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=reconnect_wait_s,  # type: ignore[arg-type]  # nats-py accepts floats
                connect_timeout=max(1, min(2, int(connect_timeout_s))),
                ping_interval=10,
                max_outstanding_pings=3,
                **options,
            )
        )
        try:
            await bus._first_connection(connecting, refused, shown, connect_timeout_s, credentials)
        finally:
            bus._connecting = None
        bus._pump_task = asyncio.create_task(bus._pump(), name=f"meshllm-events-pump-{name}")
        log.info("events: connected to NATS at %s (%s)", shown, credentials.describe())
        return bus

    async def _first_connection(
        self,
        connecting: asyncio.Future[Any],
        refused: asyncio.Future[BaseException],
        shown: str,
        timeout_s: float,
        credentials: NatsCredentials,
    ) -> None:
        """Wait for the first connection; CannotConnect (one line) on a refusal, a failure or the timeout."""
        try:
            done, _ = await asyncio.wait({connecting, refused}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if connecting in done:
                connecting.result()
            elif refused in done:
                raise CannotConnect(refusal_message(shown, refused.result(), credentials))
            else:
                last = self._connect_error
                raise CannotConnect(
                    f"cannot connect to NATS at {shown} in {timeout_s:g}s"
                    + (f": {redact_text(str(last)) or type(last).__name__}" if last is not None else "")
                )
        except (TimeoutError, OSError, nats.errors.Error, CannotConnect) as exc:
            self._quiet = True
            connecting.cancel()
            with contextlib.suppress(BaseException):
                await connecting
            with contextlib.suppress(Exception):
                await self._nc.close()
            if isinstance(exc, CannotConnect):
                raise
            if is_refusal(exc):
                raise CannotConnect(refusal_message(shown, exc, credentials)) from exc
            raise CannotConnect(f"cannot connect to NATS at {shown}: {redact_text(str(exc)) or type(exc).__name__}") from exc

    @property
    def connected(self) -> bool:
        return self._nc.is_connected

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def publish(self, subject: str, message: Message) -> None:
        check_subject(subject, wildcards=False)
        if self.closed:
            self.dropped += 1
            return
        data = message.SerializeToString()
        self._published_seq += 1
        self._buffer.append((self._published_seq, subject, data))
        self._buffered_bytes += len(data)
        while len(self._buffer) > self.max_buffered or (self._buffered_bytes > self.max_buffered_bytes and len(self._buffer) > 1):
            self._retire(*self._buffer.popleft())
            self.dropped += 1
        self._wake.set()

    def _retire(self, seq: int, subject: str, data: bytes) -> None:
        """Account for a message that left the buffer (handed over or dropped)."""
        self._buffered_bytes -= len(data)
        self._done_seq = seq
        self._progress.set()

    async def _pump(self) -> None:
        """Hand buffered messages to the client, in order, whenever it is connected."""
        handed = 0
        while True:
            if not self._buffer or not self._nc.is_connected:
                self._wake.clear()
                await self._wake.wait()
                continue
            seq, subject, data = self._buffer.popleft()
            try:
                # Connected was checked just above with no await in between, so
                # the client takes the message into its own pending buffer.
                await self._nc.publish(subject, data)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.dropped += 1
                log.warning("events: dropped a message on %s: %s", subject, exc or type(exc).__name__)
            self._retire(seq, subject, data)
            handed += 1
            if handed % _YIELD_EVERY == 0:
                await asyncio.sleep(0)  # let the loop breathe while a backlog drains

    async def flush(self, timeout_s: float = 5.0) -> None:
        target = self._published_seq
        async with asyncio.timeout(timeout_s):
            while True:
                while self._done_seq < target or not self._nc.is_connected:
                    if self._nc.is_closed:
                        raise TimeoutError("the NATS connection is closed")
                    self._progress.clear()
                    await self._progress.wait()
                try:
                    await self._roundtrip()
                    return
                except nats.errors.Error:
                    # Disconnected in the middle: what was handed is in the client's
                    # pending buffer (sent after the reconnect) or lost; wait and retry.
                    self._progress.clear()

    async def _roundtrip(self) -> None:
        """PING/PONG: the server has processed everything written before.

        A PONG that arrives for a cancelled future kills nats-py's read loop, so
        the client's flush runs in a task of its own that our deadlines never
        cancel (it ends with the PONG, its own long timeout, or `aclose`).
        """
        task = asyncio.ensure_future(self._nc.flush(timeout=_ROUNDTRIP_LIMIT_S))
        self._roundtrips.add(task)
        task.add_done_callback(self._roundtrip_done)
        await asyncio.shield(task)

    def _roundtrip_done(self, task: asyncio.Future[None]) -> None:
        self._roundtrips.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("events: NATS flush ended with %r", task.exception())

    async def subscribe(self, subject: str, message_type: type[M]) -> Subscription[M]:
        check_subject(subject, wildcards=True)
        self._ensure_open()
        sub: Subscription[M]
        nats_sub: Any = None

        async def on_message(msg: Msg) -> None:
            sub.deliver(msg.data)

        async def unsubscribe() -> None:
            self._subscriptions.discard(sub)
            if nats_sub is not None:
                with contextlib.suppress(nats.errors.Error):
                    await nats_sub.unsubscribe()

        sub = Subscription(subject, message_type, max_pending=self.max_pending, on_close=unsubscribe, on_drop=self._count_drop)
        try:
            nats_sub = await self._nc.subscribe(subject, cb=on_message)
        except nats.errors.Error as exc:
            raise Unavailable(f"cannot subscribe to {subject}: {exc or type(exc).__name__}") from exc
        self._subscriptions.add(sub)
        if self._nc.is_connected:
            # Make sure the server knows the interest before we return; when
            # disconnected, the client sends it on reconnect.
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                async with asyncio.timeout(2.0):
                    await self._roundtrip()
        return sub

    async def _aclose(self) -> None:
        if self._buffer or self._nc.is_connected:  # nothing to wait for when down with nothing buffered
            try:
                await self.flush(timeout_s=2.0)
            except TimeoutError:
                log.warning("events: closing with %d messages not handed to NATS", len(self._buffer))
        if self._pump_task is not None:
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump_task
        await self._close_subscriptions()
        # Our buffer is flushed and our subscriptions are gone, so closing
        # (which writes whatever the client still holds) is all a drain would do.
        with contextlib.suppress(Exception):
            await self._nc.close()
        roundtrips = list(self._roundtrips)
        for task in roundtrips:
            task.cancel()
        await asyncio.gather(*roundtrips, return_exceptions=True)

    # Callbacks of the nats-py client: log, wake the pump, never raise.

    async def _on_error(self, exc: Exception) -> None:
        if self._connecting is not None:  # the first connection: connect() reports it
            self._connect_error = exc
            if is_refusal(exc) and not self._connecting.done():
                self._connecting.set_result(exc)
            return
        text = f"{type(exc).__name__}: {redact_text(str(exc))}"
        now = time.monotonic()
        last_text, last_at = self._last_error
        level = logging.DEBUG if text == last_text and now - last_at < _REPEAT_LOG_S else logging.WARNING
        if level == logging.WARNING:
            self._last_error = (text, now)
        log.log(level, "events: NATS error: %s", text)

    async def _on_disconnected(self) -> None:
        if self.closed or self._quiet:
            return
        self._disconnected_at = time.monotonic()
        log.warning("events: disconnected from NATS; buffering up to %d messages until it is back", self.max_buffered)

    async def _on_reconnected(self) -> None:
        self.reconnects += 1
        away = time.monotonic() - self._disconnected_at if self._disconnected_at is not None else 0.0
        url = self._nc.connected_url
        log.info(
            "events: reconnected to NATS at %s after %.1fs; %d messages buffered, %d dropped so far",
            f"{url.hostname}:{url.port}" if url is not None else "?", away, len(self._buffer), self.dropped,
        )  # fmt: skip
        self._last_error = ("", 0.0)
        self._wake.set()
        self._progress.set()

    async def _on_closed(self) -> None:
        self._wake.set()
        self._progress.set()
        if not (self.closed or self._quiet):
            log.warning("events: the NATS connection closed")

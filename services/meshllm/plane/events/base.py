"""The events plane: publish and subscribe protobuf events on subjects (NATS | memory | none).

Workers publish `KvEventBatch` and `LoadSnapshot` messages, router replicas
`RouterSyncBatch`es, on the subjects of `meshllm.protocol.names`. Every
backend has the same contract, written on `EventBus` and `Subscription`:

- `publish()` is a plain function that never blocks and never raises on
  transport trouble. It serialises the message (protobuf binary) and leaves it
  in a bounded buffer; when a buffer is full the oldest message is dropped and
  counted in `dropped`.
- Delivery is at most once. Consumers detect gaps with the per-worker event
  ids inside the messages and repair them out of band (`Worker.GetKvSnapshot`).
- `subscribe()` accepts NATS wildcards: `*` matches one token, `>` one or more
  trailing tokens. Each subscription has its own bounded queue (drop oldest);
  a message that does not decode as the subscription's type is logged and
  skipped, never ends the iteration.
- Closing a subscription, or the bus that made it, ends its iteration.

Backends: `MemoryEventBus` (handles on one in-process `MemoryBroker`, for
`meshllm run` and tests) and `NullEventBus` (events kind "none"), here;
`NatsEventBus` (`meshllm.plane.events.nats`, core NATS), which builds on this module
and which this module never imports. `open_events()` builds the one a
`PlaneConfig` names with the opener registered for its kind
(`register_events`; `meshllm.plane.backends` registers NATS). All of them
must be used from the event loop's thread.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

from google.protobuf.message import DecodeError, Message

from meshllm.config import EventsKind, PlaneConfig
from meshllm.errors import InvalidArgument, Unavailable
from meshllm.lifecycle import AsyncCloseable

__all__ = [
    "DEFAULT_MAX_PENDING",
    "EventBus",
    "EventsOpener",
    "MemoryBroker",
    "MemoryEventBus",
    "NullEventBus",
    "Subscription",
    "check_subject",
    "open_events",
    "register_events",
    "subject_matches",
]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

DEFAULT_MAX_PENDING = 10_000  # messages queued per subscription before the oldest is dropped


def check_subject(subject: str, *, wildcards: bool) -> None:
    """Raise InvalidArgument unless `subject` is a valid NATS subject (a pattern when `wildcards`)."""
    tokens = subject.split(".")
    if not subject or any(not t or any(c.isspace() for c in t) for t in tokens):
        raise InvalidArgument(f"subject {subject!r} must be non-empty dot-separated tokens without spaces")
    for i, token in enumerate(tokens):
        if "*" in token or ">" in token:
            if not wildcards:
                raise InvalidArgument(f"cannot publish on wildcard subject {subject!r}")
            if token not in ("*", ">") or (token == ">" and i != len(tokens) - 1):
                raise InvalidArgument(f"subject {subject!r}: '*' must be a whole token and '>' the last one")


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS matching: `*` matches exactly one token, a final `>` one or more tokens."""
    p_tokens = pattern.split(".")
    s_tokens = subject.split(".")
    for i, p in enumerate(p_tokens):
        if p == ">":
            return len(s_tokens) > i
        if i >= len(s_tokens) or (p != "*" and p != s_tokens[i]):
            return False
    return len(p_tokens) == len(s_tokens)


class Subscription(AsyncCloseable, Generic[M]):
    """An async iterator of decoded messages on one subject pattern.

        async with await bus.subscribe(kv_subject(ns, "*"), KvEventBatch) as sub:
            async for batch in sub:
                ...

    Raw payloads wait in a queue of at most `max_pending`; when it is full the
    oldest is dropped and counted in `dropped`. Decoding happens as the
    consumer iterates; a payload that fails to decode is logged, counted in
    `decode_errors` and skipped. `aclose()` is idempotent; once it is called,
    iteration ends (whatever is still queued is discarded). Backends create
    subscriptions; consumers only iterate and close them.
    """

    def __init__(
        self,
        subject: str,
        message_type: type[M],
        *,
        max_pending: int = DEFAULT_MAX_PENDING,
        on_close: Callable[[], Awaitable[None]] | None = None,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        if max_pending < 1:
            raise InvalidArgument(f"max_pending must be at least 1, not {max_pending}")
        self.subject = subject
        self.message_type = message_type
        self.max_pending = max_pending
        self.dropped = 0
        self.decode_errors = 0
        self._queue: collections.deque[bytes] = collections.deque()
        self._ready = asyncio.Event()
        self._on_close = on_close
        self._on_drop = on_drop

    @property
    def pending(self) -> int:
        """Payloads received and not yet iterated."""
        return len(self._queue)

    def deliver(self, data: bytes) -> None:
        """Queue one raw payload (called by the backend); drops the oldest when full."""
        if self.closed:
            return
        if len(self._queue) >= self.max_pending:
            self._queue.popleft()
            self.dropped += 1
            if self._on_drop is not None:
                self._on_drop()
        self._queue.append(data)
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[M]:
        return self

    async def __anext__(self) -> M:
        while not self.closed:
            if not self._queue:
                self._ready.clear()
                await self._ready.wait()
                continue
            data = self._queue.popleft()
            try:
                return self.message_type.FromString(data)
            except (DecodeError, ValueError) as exc:
                self.decode_errors += 1
                log.warning(
                    "skipping a %d-byte message on %s that is not a %s: %s",
                    len(data), self.subject, self.message_type.DESCRIPTOR.full_name, exc,
                )  # fmt: skip
        raise StopAsyncIteration

    async def _aclose(self) -> None:
        self._queue.clear()
        self._ready.set()  # wake a waiting iterator so that it sees `closed`
        if self._on_close is not None:
            await self._on_close()


class EventBus(AsyncCloseable, abc.ABC):
    """One process's handle on the events plane.

    `publish(subject, message)` never blocks and never raises because of the
    transport: it serialises and buffers (bounded, drop oldest, counted in
    `dropped`); a background drain hands messages to the transport, in order.
    An invalid subject is a programming error and raises InvalidArgument.
    Publishing on a closed bus drops the message (counted).

    `flush(timeout_s)` waits until everything published before the call has
    been handed to the server, or raises TimeoutError.

    `subscribe(subject, message_type)` returns a `Subscription`; interest is
    registered with the server when it returns (if connected).

    `aclose()` flushes what is pending (bounded), closes every subscription made
    through this bus, stops background tasks and releases the transport.

    `dropped` counts messages this handle lost: publish-buffer overflow,
    publishes after close, and overflow of its subscriptions' queues.
    """

    def __init__(self) -> None:
        self.dropped = 0
        self._subscriptions: set[Subscription[Any]] = set()

    @abc.abstractmethod
    def publish(self, subject: str, message: Message) -> None: ...

    @abc.abstractmethod
    async def flush(self, timeout_s: float = 5.0) -> None: ...

    @abc.abstractmethod
    async def subscribe(self, subject: str, message_type: type[M]) -> Subscription[M]: ...

    def _count_drop(self) -> None:
        self.dropped += 1

    def _open_subscription(
        self, subject: str, message_type: type[M], *, max_pending: int, broker: MemoryBroker | None = None
    ) -> Subscription[M]:
        """A new subscription of this handle (and of `broker`, which delivers to it), forgotten when it closes."""
        check_subject(subject, wildcards=True)
        self._ensure_open()
        sub: Subscription[M]

        async def unregister() -> None:
            if broker is not None:
                broker.discard(sub)
            self._subscriptions.discard(sub)

        sub = Subscription(subject, message_type, max_pending=max_pending, on_close=unregister, on_drop=self._count_drop)
        if broker is not None:
            broker.add(sub)
        self._subscriptions.add(sub)
        return sub

    def _ensure_open(self) -> None:
        if self.closed:
            raise Unavailable("the event bus is closed")

    async def _close_subscriptions(self) -> None:
        subs = list(self._subscriptions)
        self._subscriptions.clear()
        for sub in subs:
            await sub.aclose()


class MemoryBroker:
    """The in-process bus that `MemoryEventBus` handles share (one per `meshllm run`).

    `max_pending` bounds each subscription's queue.
    """

    def __init__(self, *, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.max_pending = max_pending
        self._subscriptions: set[Subscription[Any]] = set()

    def deliver(self, subject: str, data: bytes) -> None:
        """Queue `data` on every open subscription whose pattern matches `subject`."""
        for sub in list(self._subscriptions):
            if subject_matches(sub.subject, subject):
                sub.deliver(data)

    def add(self, sub: Subscription[Any]) -> None:
        self._subscriptions.add(sub)

    def discard(self, sub: Subscription[Any]) -> None:
        self._subscriptions.discard(sub)


class MemoryEventBus(EventBus):
    """A handle on a `MemoryBroker`: delivers to matching subscribers of the same broker.

    Publishing copies the serialised bytes straight into each matching
    subscription's bounded queue, so it never blocks, there is nothing to
    flush and no background task; subscribers still decode (and may fail to
    decode) as they would over NATS.
    """

    def __init__(self, broker: MemoryBroker) -> None:
        super().__init__()
        self.broker = broker

    def publish(self, subject: str, message: Message) -> None:
        check_subject(subject, wildcards=False)
        if self.closed:
            self.dropped += 1
            return
        self.broker.deliver(subject, message.SerializeToString())

    async def flush(self, timeout_s: float = 5.0) -> None:
        return None

    async def subscribe(self, subject: str, message_type: type[M]) -> Subscription[M]:
        return self._open_subscription(subject, message_type, max_pending=self.broker.max_pending, broker=self.broker)

    async def _aclose(self) -> None:
        await self._close_subscriptions()


class NullEventBus(EventBus):
    """Events kind "none": publishing drops silently; subscriptions yield nothing until closed."""

    def publish(self, subject: str, message: Message) -> None:
        check_subject(subject, wildcards=False)

    async def flush(self, timeout_s: float = 5.0) -> None:
        return None

    async def subscribe(self, subject: str, message_type: type[M]) -> Subscription[M]:
        return self._open_subscription(subject, message_type, max_pending=1)  # nothing is ever delivered

    async def _aclose(self) -> None:
        await self._close_subscriptions()


class EventsOpener(Protocol):
    """Builds (and connects) the EventBus of one kind from the plane config."""

    async def __call__(self, config: PlaneConfig, *, memory_broker: MemoryBroker | None, name: str) -> EventBus: ...


_OPENERS: dict[EventsKind, EventsOpener] = {}


def register_events(kind: EventsKind, opener: EventsOpener) -> None:
    """Make `open_events` build `kind` with `opener` (a backend's wiring calls this; the last one wins)."""
    _OPENERS[kind] = opener


async def open_events(config: PlaneConfig, *, memory_broker: MemoryBroker | None = None, name: str = "meshllm") -> EventBus:
    """The bus `config.events` asks for, built by the opener registered for it.

    "memory" uses `memory_broker` (a fresh private broker when None: pass the
    shared one to connect the services of one process); "none" gives a
    NullEventBus (both registered here); "nats" (registered by
    `meshllm.plane.backends`) connects to `config.nats_url`, raises
    CannotConnect when the first connection fails and reconnects by itself
    afterwards.
    """
    opener = _OPENERS.get(config.events)
    if opener is None:
        raise InvalidArgument(f"no events backend is registered for {config.events.value!r} (import meshllm.plane.backends)")
    return await opener(config, memory_broker=memory_broker, name=name)


async def _open_memory(config: PlaneConfig, *, memory_broker: MemoryBroker | None, name: str) -> EventBus:
    return MemoryEventBus(memory_broker if memory_broker is not None else MemoryBroker())


async def _open_none(config: PlaneConfig, *, memory_broker: MemoryBroker | None, name: str) -> EventBus:
    return NullEventBus()


register_events(EventsKind.MEMORY, _open_memory)
register_events(EventsKind.NONE, _open_none)

"""The discovery plane: register instances and model cards, watch who is alive (etcd | memory | static).

Every backend speaks the same contract, written once on `Discovery`:

- `register_instance` / `register_model` bind a record to this handle's
  lease (etcd) or to the handle itself (memory). Registering the same key again
  replaces its value.
- `unregister()` removes everything this handle registered, at once (etcd:
  revokes the lease). It is idempotent, never raises for an unreachable
  backend (the lease then expires on its own), and registration may happen
  again afterwards.
- `watch_instances` / `watch_models` yield complete snapshots keyed by
  instance id: first the current state (possibly empty), then a new snapshot
  after every change. Snapshots are coalesced: a consumer slower than the
  changes skips straight to the newest state, never to a partial or stale one.
  The iterator ends when the Discovery is closed.
- `aclose()` is idempotent: it ends every watch and unregisters.

Backends: `MemoryDiscovery` (several handles sharing one `MemoryStore`, the
embedded `meshllm run`) and `StaticDiscovery` (fixed records, nothing
registers), here; `EtcdDiscovery` (`meshllm.plane.discovery.etcd`, real deployments),
which builds on this module and which this module never imports.
`open_discovery` builds the one a `PlaneConfig` names with the opener
registered for its kind (`register_discovery`; `meshllm.plane.backends`
registers etcd).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from meshllm.config import DiscoveryKind, PlaneConfig
from meshllm.errors import InvalidArgument, Unavailable
from meshllm.lifecycle import AsyncCloseable
from meshllm.protocol.names import instance_key, instances_prefix, model_key, models_prefix
from meshllm.v1 import discovery_pb2

__all__ = [
    "Discovery",
    "DiscoveryOpener",
    "MemoryDiscovery",
    "MemoryStore",
    "OpenArgs",
    "SnapshotFeed",
    "StaticDiscovery",
    "instance_entry",
    "model_entry",
    "open_discovery",
    "record_id",
    "register_discovery",
]

log = logging.getLogger(__name__)

Instance = discovery_pb2.Instance
ModelCard = discovery_pb2.ModelCard
M = TypeVar("M", discovery_pb2.Instance, discovery_pb2.ModelCard)
Record = discovery_pb2.Instance | discovery_pb2.ModelCard


def record_id(key: str) -> str:
    """The instance id a key ends with (the snapshot key)."""
    return key.rsplit("/", 1)[-1]


def _segment(value: str, what: str) -> str:
    if not value or "/" in value:
        raise InvalidArgument(f"{what} {value!r} must be non-empty and hold no '/'", param=what)
    return value


def _copy(record: M) -> M:
    out = type(record)()
    out.CopyFrom(record)
    return out


def instance_entry(namespace: str, instance: discovery_pb2.Instance) -> tuple[str, discovery_pb2.Instance]:
    """(key, validated copy) of an Instance; an empty namespace field is filled in."""
    if instance.namespace and instance.namespace != namespace:
        raise InvalidArgument(
            f"instance namespace {instance.namespace!r} differs from discovery namespace {namespace!r}",
            param="namespace",
        )
    key = instance_key(
        namespace,
        _segment(instance.component, "component"),
        _segment(instance.endpoint, "endpoint"),
        _segment(instance.id, "id"),
    )
    record = _copy(instance)
    record.namespace = namespace
    return key, record


def model_entry(namespace: str, card: discovery_pb2.ModelCard) -> tuple[str, discovery_pb2.ModelCard]:
    """(key, validated copy) of a ModelCard."""
    if not card.name:
        raise InvalidArgument("model card name is empty", param="name")
    return model_key(namespace, card.name, _segment(card.instance_id, "instance_id")), _copy(card)


class SnapshotFeed(Generic[M]):
    """Hands the newest snapshot from a producer to one consumer.

    `publish` never blocks and replaces a snapshot not yet taken, so every
    snapshot the consumer sees is complete and current. `close` ends the
    consumer's iteration (pending snapshots are dropped); `fail` raises an
    error in it.
    """

    def __init__(self) -> None:
        self._pending: dict[str, M] | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._wake = asyncio.Event()

    @property
    def closed(self) -> bool:
        return self._closed

    def publish(self, snapshot: dict[str, M]) -> None:
        if not self._closed:
            self._pending = snapshot
            self._wake.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    async def snapshots(self) -> AsyncIterator[dict[str, M]]:
        while True:
            if self._closed:
                return
            if self._pending is not None:
                snapshot, self._pending = self._pending, None
                yield snapshot
                continue
            if self._error is not None:
                raise self._error
            self._wake.clear()
            await self._wake.wait()


class Discovery(AsyncCloseable, abc.ABC):
    """Registration and watching of Instances and ModelCards in one namespace (contract above)."""

    namespace: str

    async def register_instance(self, instance: discovery_pb2.Instance) -> None:
        """Publish `instance` under instance_key(ns, component, endpoint, id), bound to this handle."""
        await self._register(*instance_entry(self.namespace, instance))

    async def register_model(self, card: discovery_pb2.ModelCard) -> None:
        """Publish `card` under model_key(ns, card.name, card.instance_id), bound to this handle."""
        await self._register(*model_entry(self.namespace, card))

    @abc.abstractmethod
    async def unregister(self) -> None:
        """Remove everything this handle registered; idempotent; never raises for an unreachable backend."""

    def watch_instances(
        self, component: str | None = None, endpoint: str | None = None
    ) -> AsyncIterator[dict[str, discovery_pb2.Instance]]:
        """Snapshots {instance id: Instance} of one component (and endpoint), or all when None."""
        return self._watch(self._instances_prefix(component, endpoint), discovery_pb2.Instance)

    def watch_models(self, model: str | None = None) -> AsyncIterator[dict[str, discovery_pb2.ModelCard]]:
        """Snapshots {instance id: ModelCard} of one model, or of all models when None."""
        return self._watch(self._models_prefix(model), discovery_pb2.ModelCard)

    async def list_instances(
        self, component: str | None = None, endpoint: str | None = None
    ) -> dict[str, discovery_pb2.Instance]:
        """The current {instance id: Instance}, once."""
        return await self._list(self._instances_prefix(component, endpoint), discovery_pb2.Instance)

    async def list_models(self, model: str | None = None) -> dict[str, discovery_pb2.ModelCard]:
        """The current {instance id: ModelCard}, once."""
        return await self._list(self._models_prefix(model), discovery_pb2.ModelCard)

    def _instances_prefix(self, component: str | None, endpoint: str | None) -> str:
        if endpoint is not None and component is None:
            raise InvalidArgument("an endpoint filter needs a component", param="endpoint")
        return instances_prefix(self.namespace, component, endpoint)

    def _models_prefix(self, model: str | None) -> str:
        return models_prefix(self.namespace, model)

    def _check_open(self) -> None:
        if self.closed:
            raise Unavailable(f"discovery ({type(self).__name__}) is closed")

    @abc.abstractmethod
    async def _register(self, key: str, record: Record) -> None:
        """Store `record` (already validated, owned by the callee) under `key`."""

    @abc.abstractmethod
    def _watch(self, prefix: str, kind: type[M]) -> AsyncIterator[dict[str, M]]:
        """Snapshots of the records of type `kind` under `prefix`."""

    @abc.abstractmethod
    async def _list(self, prefix: str, kind: type[M]) -> dict[str, M]:
        """The records of type `kind` under `prefix`, once."""


# ---------------------------------------------------------------- memory


def _view(entries: Iterable[tuple[str, Record]], prefix: str, kind: type[M]) -> dict[str, M]:
    """{instance id: copy} of the records of `kind` whose keys start with `prefix`."""
    return {record_id(k): _copy(r) for k, r in entries if k.startswith(prefix) and isinstance(r, kind)}


@dataclass(eq=False, slots=True)
class _Subscription(Generic[M]):
    prefix: str
    kind: type[M]
    feed: SnapshotFeed[M]


class MemoryStore:
    """The in-process registry shared by the MemoryDiscovery handles of one process.

    Each key remembers the handle that wrote it last (as an etcd key remembers
    its lease); removing a handle's keys is the in-memory lease revoke.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[object, Record]] = {}
        self._subs: set[_Subscription[Any]] = set()

    def put(self, owner: object, key: str, record: Record) -> None:
        self._entries[key] = (owner, record)
        self._changed([key])

    def remove_owner(self, owner: object) -> None:
        keys = [k for k, (o, _) in self._entries.items() if o is owner]
        for k in keys:
            del self._entries[k]
        self._changed(keys)

    def view(self, prefix: str, kind: type[M]) -> dict[str, M]:
        return _view(((k, r) for k, (_, r) in self._entries.items()), prefix, kind)

    def subscribe(self, sub: _Subscription[M]) -> None:
        self._subs.add(sub)
        sub.feed.publish(self.view(sub.prefix, sub.kind))

    def unsubscribe(self, sub: _Subscription[M]) -> None:
        self._subs.discard(sub)

    def _changed(self, keys: Sequence[str]) -> None:
        for sub in list(self._subs):
            if any(k.startswith(sub.prefix) for k in keys):
                sub.feed.publish(self.view(sub.prefix, sub.kind))


class MemoryDiscovery(Discovery):
    """One handle on a shared MemoryStore (one per embedded service of `meshllm run`)."""

    def __init__(self, store: MemoryStore, namespace: str = "meshllm") -> None:
        self.store = store
        self.namespace = namespace
        self._feeds: set[SnapshotFeed[Any]] = set()

    async def _register(self, key: str, record: Record) -> None:
        self._check_open()
        self.store.put(self, key, record)

    async def unregister(self) -> None:
        self.store.remove_owner(self)

    async def _list(self, prefix: str, kind: type[M]) -> dict[str, M]:
        return self.store.view(prefix, kind)

    async def _watch(self, prefix: str, kind: type[M]) -> AsyncIterator[dict[str, M]]:
        if self.closed:
            return
        feed: SnapshotFeed[M] = SnapshotFeed()
        sub = _Subscription(prefix, kind, feed)
        self._feeds.add(feed)
        self.store.subscribe(sub)
        try:
            async for snapshot in feed.snapshots():
                yield snapshot
        finally:
            self.store.unsubscribe(sub)
            self._feeds.discard(feed)

    async def _aclose(self) -> None:
        for feed in list(self._feeds):
            feed.close()
        self.store.remove_owner(self)


# ---------------------------------------------------------------- static


class StaticDiscovery(Discovery):
    """Fixed records given at startup (static mode); registration is a no-op."""

    def __init__(
        self,
        namespace: str,
        instances: Sequence[discovery_pb2.Instance],
        models: Sequence[discovery_pb2.ModelCard],
    ) -> None:
        self.namespace = namespace
        entries = [instance_entry(namespace, i) for i in instances] + [model_entry(namespace, c) for c in models]
        self._records: dict[str, Record] = dict(entries)
        self._closed_event = asyncio.Event()

    async def _register(self, key: str, record: Record) -> None:
        log.debug("static discovery: not registering %s", key)

    async def unregister(self) -> None:
        return None

    async def _list(self, prefix: str, kind: type[M]) -> dict[str, M]:
        return _view(self._records.items(), prefix, kind)

    async def _watch(self, prefix: str, kind: type[M]) -> AsyncIterator[dict[str, M]]:
        if self.closed:
            return
        yield _view(self._records.items(), prefix, kind)
        await self._closed_event.wait()

    async def _aclose(self) -> None:
        self._closed_event.set()


# ---------------------------------------------------------------- factory


@dataclass(frozen=True, slots=True)
class OpenArgs:
    """What `open_discovery` hands an opener besides the config; each backend uses what it needs."""

    memory_store: MemoryStore | None = None  # memory: the process-wide store of `meshllm run`
    static_instances: Sequence[discovery_pb2.Instance] = ()  # static: the fixed records
    static_models: Sequence[discovery_pb2.ModelCard] = ()


#: Builds (and connects) the Discovery of one kind.
DiscoveryOpener = Callable[[PlaneConfig, OpenArgs], Awaitable[Discovery]]

_OPENERS: dict[DiscoveryKind, DiscoveryOpener] = {}


def register_discovery(kind: DiscoveryKind, opener: DiscoveryOpener) -> None:
    """Make `open_discovery` build `kind` with `opener` (a backend's wiring calls this; the last one wins)."""
    _OPENERS[kind] = opener


async def open_discovery(
    config: PlaneConfig,
    *,
    memory_store: MemoryStore | None = None,
    static_instances: Sequence[discovery_pb2.Instance] = (),
    static_models: Sequence[discovery_pb2.ModelCard] = (),
) -> Discovery:
    """The Discovery backend `config.discovery` names, built by the opener registered for it.

    `memory_store` is the process-wide store of `meshllm run`; without one a
    memory handle gets a private store. The static records are used only by
    the static backend. Memory and static are registered here; etcd by
    `meshllm.plane.backends`, which the services import.
    """
    opener = _OPENERS.get(config.discovery)
    if opener is None:
        raise InvalidArgument(
            f"no discovery backend is registered for {config.discovery.value!r} (import meshllm.plane.backends)"
        )
    return await opener(config, OpenArgs(memory_store, static_instances, static_models))


async def _open_memory(config: PlaneConfig, args: OpenArgs) -> Discovery:
    return MemoryDiscovery(args.memory_store if args.memory_store is not None else MemoryStore(), config.namespace)


async def _open_static(config: PlaneConfig, args: OpenArgs) -> Discovery:
    return StaticDiscovery(config.namespace, args.static_instances, args.static_models)


register_discovery(DiscoveryKind.MEMORY, _open_memory)
register_discovery(DiscoveryKind.STATIC, _open_static)

"""The plane backends that live in modules of their own (etcd, NATS), registered with the base modules by kind.

`meshllm.plane.discovery.base` and `meshllm.plane.events.base` know only the contract
and their in-process backends (memory, static, none); this module is the one
place that knows the others. The services' wiring imports it (worker,
router, frontend), which registers an opener per kind; each opener imports
its backend only when a process asks for it, so a process on the in-memory
planes never loads `aetcd` or `nats-py`.
"""

from __future__ import annotations

from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.plane.discovery.base import Discovery, OpenArgs, register_discovery
from meshllm.plane.events.base import EventBus, MemoryBroker, register_events

__all__: list[str] = []


async def _open_etcd(config: PlaneConfig, args: OpenArgs) -> Discovery:
    from meshllm.plane.discovery.etcd import EtcdDiscovery

    return await EtcdDiscovery.connect(
        config.etcd_endpoints, config.namespace, config.lease_ttl_s, credentials=config.etcd_credentials
    )


async def _open_nats(config: PlaneConfig, *, memory_broker: MemoryBroker | None, name: str) -> EventBus:
    from meshllm.plane.events.nats import NatsEventBus

    return await NatsEventBus.connect(config.nats_url, name=name, credentials=config.nats_credentials)


register_discovery(DiscoveryKind.ETCD, _open_etcd)
register_events(EventsKind.NATS, _open_nats)

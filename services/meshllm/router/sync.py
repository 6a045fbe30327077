"""Replica sync: router replicas share route / prefill-done / complete decisions over the events plane.

Every charge a replica makes on its own `LoadTracker` is also published as a
`RouterSyncEvent` on `meshllm.<ns>.router.<component>`; every replica applies
the other replicas' events to its tracker, keyed by (router id, request id),
so their per-worker load views agree. Delivery is at most once: a lost
COMPLETED is cleaned up by the tracker's stale-charge expiry, and the
workers' LoadSnapshots correct any drift.
"""

from __future__ import annotations

import asyncio
import logging
import time

from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.events import EventBus, Subscription
from meshllm.protocol.names import router_subject
from meshllm.router.kv_index import SlotKey
from meshllm.router.load import LoadTracker
from meshllm.v1 import events_pb2

__all__ = ["ReplicaSync"]

log = logging.getLogger(__name__)

Kind = events_pb2.RouterSyncEvent


class ReplicaSync(AsyncCloseable):
    """Publishes this replica's charges and applies the other replicas'."""

    def __init__(self, bus: EventBus, namespace: str, component: str, router_id: str, load: LoadTracker) -> None:
        self.bus = bus
        self.subject = router_subject(namespace, component)
        self.router_id = router_id
        self.load = load
        self.received = 0
        self._sub: Subscription[events_pb2.RouterSyncEvent] | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        """Events received and not applied yet."""
        return self._sub.pending if self._sub is not None else 0

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(self.subject, events_pb2.RouterSyncEvent)
        self._task = asyncio.create_task(self._loop(self._sub), name="router-replica-sync")

    # ------------------------------------------------------------ publish
    def routed(self, request_id: str, key: SlotKey, *, prefill_tokens: int, blocks: int) -> None:
        self._publish(Kind.KIND_ROUTED, request_id, key, prefill_tokens=prefill_tokens, blocks=blocks)

    def prefill_done(self, request_id: str, key: SlotKey) -> None:
        self._publish(Kind.KIND_PREFILL_DONE, request_id, key)

    def completed(self, request_id: str, key: SlotKey) -> None:
        self._publish(Kind.KIND_COMPLETED, request_id, key)

    def _publish(self, kind: int, request_id: str, key: SlotKey, *, prefill_tokens: int = 0, blocks: int = 0) -> None:
        if self.closed:
            return
        self.bus.publish(
            self.subject,
            events_pb2.RouterSyncEvent(
                router_id=self.router_id,
                request_id=request_id,
                kind=kind,  # type: ignore[arg-type]
                worker_id=key[0],
                dp_rank=key[1],
                prefill_tokens=prefill_tokens,
                blocks=blocks,
            ),
        )

    # ------------------------------------------------------------ apply
    async def _loop(self, sub: Subscription[events_pb2.RouterSyncEvent]) -> None:
        async for ev in sub:
            if ev.router_id == self.router_id:
                continue
            self.received += 1
            self.apply(ev)

    def apply(self, ev: events_pb2.RouterSyncEvent) -> None:
        """Apply another replica's event to the load tracker."""
        if ev.kind == Kind.KIND_ROUTED:
            self.load.route(
                ev.router_id, ev.request_id, (ev.worker_id, ev.dp_rank),
                prefill_tokens=ev.prefill_tokens, blocks=ev.blocks, now=time.time(),
            )  # fmt: skip
        elif ev.kind == Kind.KIND_PREFILL_DONE:
            self.load.prefill_done(ev.router_id, ev.request_id)
        elif ev.kind == Kind.KIND_COMPLETED:
            self.load.complete(ev.router_id, ev.request_id)

    async def _aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._sub is not None:
            await self._sub.aclose()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

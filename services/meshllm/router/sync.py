"""Replica sync: router replicas share route / prefill-done / complete decisions over the events plane.

Every charge a replica makes on its own `LoadTracker` is also published as a
`RouterSyncEvent` on `meshllm.<ns>.router.<component>`; every replica applies
the other replicas' events to its tracker, keyed by (router id, request id),
so their per-worker load views agree. Delivery is at most once: a lost
COMPLETED is cleaned up by the tracker's stale-charge expiry, and the
workers' LoadSnapshots correct any drift.

Events travel in `RouterSyncBatch`es, as the workers' KV events do: the first
event after a quiet period goes at once, later ones wait for the next batch,
at most one every `FLUSH_INTERVAL_S`. A request makes three events (routed,
prefill done, completed); one message per event cost a busy frontend about a
tenth of its CPU in publishing and in parsing its own events back.

A routed event carries the time its replica charged the request
(`routed_at_ms`), and every replica charges it at that time, not when the
batch arrived: whether a worker's LoadSnapshot already counts a request is
decided by comparing the two times (`LoadTracker.apply_snapshot`), and a
batch's few milliseconds of delay made replicas decide it differently.
"""

from __future__ import annotations

import asyncio
import logging
import time

from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.batching import FlushPacer
from meshllm.plane.events import EventBus, Subscription
from meshllm.protocol.names import router_subject
from meshllm.router.kv_index import SlotKey
from meshllm.router.load import LoadTracker, plausible_time
from meshllm.v1 import events_pb2

__all__ = ["ReplicaSync"]

log = logging.getLogger(__name__)

Kind = events_pb2.RouterSyncEvent

# Events made within this long of the last batch wait and go in the next one.
FLUSH_INTERVAL_S = 0.005


class ReplicaSync(AsyncCloseable):
    """Publishes this replica's charges and applies the other replicas'."""

    def __init__(self, bus: EventBus, namespace: str, component: str, router_id: str, load: LoadTracker) -> None:
        self.bus = bus
        self.subject = router_subject(namespace, component)
        self.router_id = router_id
        self.load = load
        self.received = 0
        self.batches_published = 0
        self._sub: Subscription[events_pb2.RouterSyncBatch] | None = None
        self._task: asyncio.Task[None] | None = None
        self._pending: events_pb2.RouterSyncBatch | None = None
        self._pacer = FlushPacer(self._flush, FLUSH_INTERVAL_S)

    @property
    def pending(self) -> int:
        """Events received and not applied yet."""
        return self._sub.pending if self._sub is not None else 0

    @property
    def unpublished(self) -> int:
        """Events of this replica waiting for their batch."""
        return len(self._pending.events) if self._pending is not None else 0

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(self.subject, events_pb2.RouterSyncBatch)
        self._task = asyncio.create_task(self._loop(self._sub), name="router-replica-sync")

    # ------------------------------------------------------------ publish
    def routed(self, request_id: str, key: SlotKey, *, prefill_tokens: int, blocks: int, at_ms: int = 0) -> None:
        """Publish a charge; `at_ms` is the wall-clock ms the load tracker charged it at (0: the receivers' clock)."""
        self._publish(Kind.KIND_ROUTED, request_id, key, prefill_tokens=prefill_tokens, blocks=blocks, at_ms=at_ms)

    def prefill_done(self, request_id: str, key: SlotKey) -> None:
        self._publish(Kind.KIND_PREFILL_DONE, request_id, key)

    def completed(self, request_id: str, key: SlotKey) -> None:
        self._publish(Kind.KIND_COMPLETED, request_id, key)

    def _publish(
        self, kind: int, request_id: str, key: SlotKey, *, prefill_tokens: int = 0, blocks: int = 0, at_ms: int = 0
    ) -> None:
        if self.closed:
            return
        batch = self._pending
        if batch is None:
            batch = self._pending = events_pb2.RouterSyncBatch(router_id=self.router_id)
        batch.events.add(
            request_id=request_id,
            kind=kind,  # type: ignore[arg-type]
            worker_id=key[0],
            dp_rank=key[1],
            prefill_tokens=prefill_tokens,
            blocks=blocks,
            routed_at_ms=at_ms,
        )
        self._pacer.request()

    def _flush(self) -> None:
        batch, self._pending = self._pending, None
        if batch is None:
            return
        self.bus.publish(self.subject, batch)
        self.batches_published += 1

    # ------------------------------------------------------------ apply
    async def _loop(self, sub: Subscription[events_pb2.RouterSyncBatch]) -> None:
        async for batch in sub:
            if batch.router_id == self.router_id:
                continue
            for ev in batch.events:
                self.received += 1
                self.apply(batch.router_id, ev)

    def apply(self, router_id: str, ev: events_pb2.RouterSyncEvent) -> None:
        """Apply an event of replica `router_id` to the load tracker."""
        if ev.kind == Kind.KIND_ROUTED:
            at = plausible_time(ev.routed_at_ms, time.time())
            self.load.route(
                router_id, ev.request_id, (ev.worker_id, ev.dp_rank),
                prefill_tokens=ev.prefill_tokens, blocks=ev.blocks, now=at,
            )  # fmt: skip
        elif ev.kind == Kind.KIND_PREFILL_DONE:
            self.load.prefill_done(router_id, ev.request_id)
        elif ev.kind == Kind.KIND_COMPLETED:
            self.load.complete(router_id, ev.request_id)

    async def _aclose(self) -> None:
        self._pacer.flush_now()  # the last events still reach the other replicas
        if self._task is not None:
            self._task.cancel()
        if self._sub is not None:
            await self._sub.aclose()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

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

A replica publishes its events only while it knows another replica: a
frontend or router that runs alone would otherwise pay a NATS message per
interval (and the parse of its own batch coming back) for nobody; the
profile of a lone frontend at --speedup-ratio 10 put that at ~5 % of its CPU,
and of a router process at ~8 %. Presence travels on the same subject: every
replica publishes an empty batch when it starts and every `HELLO_S`, and
answers a replica it had not heard with one at once, so two replicas know
each other within a loop turn of the second one's start. A replica it has not
heard for `PEER_TTL_HELLOS` intervals is gone. Events made before a newcomer was heard are
not sent to it; like a lost message, the workers' LoadSnapshots correct that.

A routed event carries the time its replica charged the request
(`routed_at_ms`), and every replica charges it at that time, not when the
batch arrived: whether a worker's LoadSnapshot already counts a request is
decided by comparing the two times (`LoadTracker.apply_snapshot`), and a
batch's few milliseconds of delay made replicas decide it differently.
A completed event carries the time its replica released the request
(`ended_at_ms`) for the same reason: whether a snapshot still counts it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.events.base import EventBus, Subscription
from meshllm.plane.events.batching import FlushPacer
from meshllm.protocol.names import router_subject
from meshllm.router.kv.blocks import SlotKey
from meshllm.router.policy.load import LoadTracker, plausible_time
from meshllm.v1 import events_pb2

__all__ = ["ReplicaSync"]

log = logging.getLogger(__name__)

Kind = events_pb2.RouterSyncEvent

# Events made within this long of the last batch wait and go in the next one.
FLUSH_INTERVAL_S = 0.005
# Every replica says it is there this often (an empty batch) ...
HELLO_S = 1.0
# ... and one not heard for this many intervals has gone: no events are published for it.
PEER_TTL_HELLOS = 3.5


class ReplicaSync(AsyncCloseable):
    """Publishes this replica's charges and applies the other replicas'."""

    def __init__(
        self,
        bus: EventBus,
        namespace: str,
        component: str,
        router_id: str,
        load: LoadTracker,
        *,
        hello_s: float = HELLO_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`hello_s`: how often this replica announces itself; a peer silent for `PEER_TTL_HELLOS` of them is gone."""
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
        self.hello_s = hello_s
        self._clock = clock
        self._peers: dict[str, float] = {}  # other replica id -> when last heard (clock)
        self._peers_until = -math.inf  # while clock() < this, some other replica is live: events are published
        self._hello: asyncio.Task[None] | None = None

    @property
    def peers(self) -> list[str]:
        """The other replicas heard within the last `peer_ttl_s` (their ids, sorted)."""
        now = self._clock()
        return sorted(rid for rid, at in self._peers.items() if now - at < self.peer_ttl_s)

    @property
    def peer_ttl_s(self) -> float:
        return PEER_TTL_HELLOS * self.hello_s

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
        self._hello = asyncio.create_task(self._announce(), name="router-replica-hello")

    # ------------------------------------------------------------ publish
    def routed(self, request_id: str, key: SlotKey, *, prefill_tokens: int, blocks: int, at_ms: int = 0) -> None:
        """Publish a charge; `at_ms` is the wall-clock ms the load tracker charged it at (0: the receivers' clock)."""
        self._publish(Kind.KIND_ROUTED, request_id, key, prefill_tokens=prefill_tokens, blocks=blocks, at_ms=at_ms)

    def prefill_done(self, request_id: str, key: SlotKey) -> None:
        self._publish(Kind.KIND_PREFILL_DONE, request_id, key)

    def completed(self, request_id: str, key: SlotKey, *, at_ms: int = 0) -> None:
        """Publish a release; `at_ms` is the wall-clock ms the load tracker released it at (0: the receivers' clock)."""
        self._publish(Kind.KIND_COMPLETED, request_id, key, at_ms=at_ms)

    def _publish(
        self, kind: int, request_id: str, key: SlotKey, *, prefill_tokens: int = 0, blocks: int = 0, at_ms: int = 0
    ) -> None:
        if self.closed or self._clock() >= self._peers_until:
            return  # nobody else to tell
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
            routed_at_ms=at_ms if kind == Kind.KIND_ROUTED else 0,
            ended_at_ms=at_ms if kind == Kind.KIND_COMPLETED else 0,
        )
        self._pacer.request()

    def _flush(self) -> None:
        batch, self._pending = self._pending, None
        if batch is None:
            return
        self.bus.publish(self.subject, batch)
        self.batches_published += 1

    def _say_hello(self) -> None:
        self.bus.publish(self.subject, events_pb2.RouterSyncBatch(router_id=self.router_id))

    async def _announce(self) -> None:
        while True:
            self._say_hello()
            await asyncio.sleep(self.hello_s)

    def _heard(self, router_id: str) -> None:
        now = self._clock()
        last = self._peers.get(router_id)
        self._peers[router_id] = now
        self._peers_until = max(self._peers_until, now + self.peer_ttl_s)
        if last is None or now - last >= self.peer_ttl_s:
            self._say_hello()  # a newcomer (or one back): tell it at once, not at the next hello
            for rid, at in list(self._peers.items()):
                if now - at >= self.peer_ttl_s:
                    del self._peers[rid]

    # ------------------------------------------------------------ apply
    async def _loop(self, sub: Subscription[events_pb2.RouterSyncBatch]) -> None:
        async for batch in sub:
            if batch.router_id == self.router_id:
                continue
            self._heard(batch.router_id)
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
            self.load.complete(router_id, ev.request_id, now=plausible_time(ev.ended_at_ms, time.time()))

    async def _aclose(self) -> None:
        self._pacer.flush_now()  # the last events still reach the other replicas
        if self._hello is not None:
            self._hello.cancel()
        if self._task is not None:
            self._task.cancel()
        if self._sub is not None:
            await self._sub.aclose()
        await asyncio.gather(*(t for t in (self._task, self._hello) if t is not None), return_exceptions=True)

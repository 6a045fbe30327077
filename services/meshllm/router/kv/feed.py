"""The router's event feed: KV events and load snapshots from the events plane, and index resyncs.

Order matters and is kept here: the feed subscribes to
`meshllm.<ns>.kv.*` and `meshllm.<ns>.load.*` *before* the worker pool
starts, so every worker the pool reports is asked for its
`Worker.GetKvSnapshot` only after its events are already being received
(and buffered by the index while it syncs). A resync is retried with backoff
while the worker stays in the pool.

Lost trailing events (nothing newer arrives to reveal the gap) are caught
through the load snapshots: each carries the worker's last event id, and if
the index is still behind that id a second later, the worker is resynced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from meshllm.errors import MeshError
from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.events.base import EventBus, Subscription
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.names import kv_subject, load_subject
from meshllm.router.kv.index import KvIndex
from meshllm.router.metrics import RouterMetrics
from meshllm.router.policy.load import LoadTracker
from meshllm.router.workers import PoolWorker, WorkerPool
from meshllm.v1 import events_pb2
from meshllm.worker.client import WorkerClient

__all__ = ["EventFeed"]

log = logging.getLogger(__name__)

BEHIND_GRACE_S = 1.0  # how long the index may trail a load snapshot's last_event_id
MAX_BACKOFF_S = 5.0


@dataclass(eq=False)
class EventFeed(AsyncCloseable):
    """Applies KvEventBatch to the index and LoadSnapshot to the load tracker; runs resyncs."""

    bus: EventBus
    namespace: str
    _: KW_ONLY
    index: KvIndex
    load: LoadTracker
    pool: WorkerPool
    channels: ChannelCache
    metrics: RouterMetrics
    use_kv: bool = True
    snapshot_timeout_s: float = 10.0
    backoff_s: float = 0.2
    _subs: list[Subscription[Any]] = field(init=False, default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(init=False, default_factory=list)
    _resyncs: dict[str, asyncio.Task[None]] = field(init=False, default_factory=dict)
    _behind: dict[str, tuple[int, float]] = field(init=False, default_factory=dict)  # worker -> (event id seen in load, when)

    @property
    def pending(self) -> int:
        """Messages received and not applied yet."""
        return sum(sub.pending for sub in self._subs)

    async def start(self) -> None:
        """Subscribe (the pool starts after this returns)."""
        load_sub = await self.bus.subscribe(load_subject(self.namespace, "*"), events_pb2.LoadSnapshot)
        self._subs.append(load_sub)
        self._tasks.append(asyncio.create_task(self._load_loop(load_sub), name="router-load-feed"))
        if self.use_kv:
            kv_sub = await self.bus.subscribe(kv_subject(self.namespace, "*"), events_pb2.KvEventBatch)
            self._subs.append(kv_sub)
            self._tasks.append(asyncio.create_task(self._kv_loop(kv_sub), name="router-kv-feed"))

    # ------------------------------------------------------------ pool changes
    def worker_added(self, worker: PoolWorker) -> None:
        if self.use_kv and self.index.add_worker(worker.id):
            self._resync(worker.id)

    def worker_removed(self, worker: PoolWorker) -> None:
        self.index.remove_worker(worker.id)
        self._behind.pop(worker.id, None)
        task = self._resyncs.pop(worker.id, None)
        if task is not None:
            task.cancel()
        self.metrics.index_blocks.set(self.index.size)

    # ------------------------------------------------------------ loops
    async def _kv_loop(self, sub: Subscription[events_pb2.KvEventBatch]) -> None:
        index, applied = self.index, self.metrics.events_applied
        async for batch in sub:
            before = index.applied
            try:
                gap = index.apply_batch(batch)
            except Exception:  # a malformed batch must not stop the feed
                log.exception("cannot apply a KV event batch of worker %s: resyncing it", batch.worker_id)
                gap = index.request_resync(batch.worker_id)
            if gap:
                log.info("KV event gap from worker %s: resyncing", batch.worker_id)
                self.metrics.recent.event("gap", f"KV event gap from worker {batch.worker_id}", worker_id=batch.worker_id)
                self._resync(batch.worker_id)
            if index.applied != before:
                applied.inc(index.applied - before)
            if sub.pending == 0:
                self.metrics.index_blocks.set(index.size)

    async def _load_loop(self, sub: Subscription[events_pb2.LoadSnapshot]) -> None:
        async for snap in sub:
            if self.pool.get(snap.worker_id) is None:
                continue
            self.load.apply_snapshot(snap, now=time.time())
            if self.use_kv:
                self._check_behind(snap)

    def _check_behind(self, snap: events_pb2.LoadSnapshot) -> None:
        wid = snap.worker_id
        if wid not in self.index or self.index.syncing(wid):
            self._behind.pop(wid, None)
            return
        now = time.monotonic()
        seen = self._behind.get(wid)
        if seen is not None and self.index.last_event_id(wid) < seen[0] and now - seen[1] >= BEHIND_GRACE_S:
            log.info("KV index of worker %s is behind event %d: resyncing", wid, seen[0])
            self._behind.pop(wid, None)
            if self.index.request_resync(wid):
                self._resync(wid)
            return
        if snap.last_event_id > self.index.last_event_id(wid):
            if seen is None or self.index.last_event_id(wid) >= seen[0]:
                self._behind[wid] = (snap.last_event_id, now)
        else:
            self._behind.pop(wid, None)

    # ------------------------------------------------------------ resync
    def _resync(self, worker_id: str) -> None:
        if worker_id in self._resyncs or self.closed:
            return
        self._resyncs[worker_id] = asyncio.create_task(self._resync_worker(worker_id), name=f"router-resync-{worker_id}")

    async def _resync_worker(self, worker_id: str) -> None:
        delay = self.backoff_s
        try:
            while True:
                worker = self.pool.get(worker_id)
                if worker is None or worker_id not in self.index:
                    return
                try:
                    snap = await WorkerClient(self.channels, worker.address).get_kv_snapshot(timeout_s=self.snapshot_timeout_s)
                except MeshError as exc:
                    log.warning("KV snapshot of worker %s failed (%s); retrying in %.1fs", worker_id, exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, MAX_BACKOFF_S)
                    continue
                snap.worker_id = worker_id
                again = self.index.apply_snapshot(snap)
                self.metrics.resyncs.inc()
                self.metrics.recent.event(
                    "resync", f"KV index of worker {worker_id} resynced at event {snap.last_event_id} "
                    f"({self.index.worker_blocks(worker_id)} blocks)", worker_id=worker_id,
                )  # fmt: skip
                self.metrics.index_blocks.set(self.index.size)
                log.debug("worker %s resynced at event %d (%d blocks)", worker_id, snap.last_event_id,
                          self.index.worker_blocks(worker_id))  # fmt: skip
                if not again:
                    return
        finally:
            if self._resyncs.get(worker_id) is asyncio.current_task():
                del self._resyncs[worker_id]

    async def wait_synced(self, timeout_s: float = 10.0) -> None:
        """Return once no resync is running (tests, startup probes)."""
        async with asyncio.timeout(timeout_s):
            while self._resyncs:
                await asyncio.gather(*list(self._resyncs.values()), return_exceptions=True)

    async def _aclose(self) -> None:
        tasks = [*self._tasks, *self._resyncs.values()]
        for t in tasks:
            t.cancel()
        for sub in self._subs:
            await sub.aclose()
        await asyncio.gather(*tasks, return_exceptions=True)

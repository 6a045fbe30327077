"""The router's KV index: every worker's resident KV blocks, fed by KV events (blocks in `meshllm.router.kv.blocks`).

Lower tiers (host memory, disk: `meshllm.v1.KvTier`): a worker may keep
blocks evicted from its device cache and restore them instead of computing
them again. `KvIndex.lower` (`meshllm.router.kv.tiers.LowerTiers`) holds,
per slot and lower tier, the hashes the tier holds; a block may be in
several tiers at once and each tier's set changes only by its own events;
"cleared" empties every tier. `KvIndex.tier_overlaps` continues a
candidate's device prefix through its lower tiers: the prompt prefix the
worker can serve without computing, each block counted in the nearest tier
that holds it (device, then host, then disk).

`KvIndex` keeps the event bookkeeping: per worker the id of the last applied
event. A batch whose first id is not `last + 1` (lost events, a restarted
worker), a new worker and a router start all put the worker in *syncing*
state: its events are buffered (not applied) until `apply_snapshot` replaces
its blocks with a `Worker.GetKvSnapshot` answer and replays the buffered
events whose id is greater than the snapshot's `last_event_id`. Subscribe
first, snapshot second: nothing falls in between. The index does no I/O;
`meshllm.router.kv.feed` fetches the snapshots it asks for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from meshllm.router.kv.blocks import SlotKey, block_map
from meshllm.router.kv.capacity import SlotCapacities
from meshllm.router.kv.tiers import LowerTiers, TierOverlap
from meshllm.v1 import events_pb2, worker_pb2

__all__ = ["KvIndex", "TierOverlap"]

MAX_BUFFERED_EVENTS = 200_000  # per syncing worker; beyond it the buffer is dropped and the sync restarted


@dataclass(slots=True)
class _WorkerState:
    last_event_id: int = 0
    syncing: bool = True
    buffer: list[tuple[int, events_pb2.KvEvent]] = field(default_factory=list)
    overflowed: bool = False


class KvIndex(SlotCapacities):
    """The event-fed index of every worker's resident KV blocks (see the module docstring).

    `applied` counts block-events applied (one per stored or removed block);
    `resyncs_requested` counts gaps and new workers that asked for a snapshot.
    """

    def __init__(self) -> None:
        self.map = block_map()
        self.totals: dict[SlotKey, int] = {}  # capacity per slot, when known
        self.lower = LowerTiers()  # host and disk blocks per slot
        self._workers: dict[str, _WorkerState] = {}
        self.applied = 0
        self.resyncs_requested = 0
        self.dropped_unknown = 0

    # ------------------------------------------------------------ workers
    def add_worker(self, worker_id: str) -> bool:
        """Start tracking a worker (in syncing state); True when it is new (fetch its snapshot)."""
        if worker_id in self._workers:
            return False
        self._workers[worker_id] = _WorkerState()
        self.resyncs_requested += 1
        return True

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and every block it held, at once."""
        self._workers.pop(worker_id, None)
        for key in self.map.keys_of(worker_id):
            self.lower.clear_slot(self.map.slot_of[key])
            self.map.drop(key)
        self._forget_totals(worker_id)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def workers(self) -> list[str]:
        return list(self._workers)

    def syncing(self, worker_id: str) -> bool:
        st = self._workers.get(worker_id)
        return st is not None and st.syncing

    def last_event_id(self, worker_id: str) -> int:
        st = self._workers.get(worker_id)
        return 0 if st is None else st.last_event_id

    def request_resync(self, worker_id: str) -> bool:
        """Put a tracked worker back in syncing state; True when it was not syncing already."""
        st = self._workers.get(worker_id)
        if st is None or st.syncing:
            return False
        st.syncing = True
        st.buffer = []
        self.resyncs_requested += 1
        return True

    # ------------------------------------------------------------ events
    def apply_batch(self, batch: events_pb2.KvEventBatch) -> bool:
        """Apply (or buffer) one batch; True when it revealed a gap and a snapshot is needed."""
        st = self._workers.get(batch.worker_id)
        events = batch.events
        if st is None:
            self.dropped_unknown += len(events)
            return False
        dp = batch.dp_rank
        if st.syncing:
            self._buffer(st, dp, events)
            return False
        slot = -1
        expected = st.last_event_id + 1
        for i, ev in enumerate(events):
            if ev.event_id != expected:
                st.syncing = True
                st.buffer = []
                self._buffer(st, dp, events[i:])
                self.resyncs_requested += 1
                return True
            if slot < 0:
                slot = self.map.slot((batch.worker_id, dp))
            self._apply(slot, ev)
            st.last_event_id = expected
            expected += 1
        return False

    def apply_snapshot(self, snapshot: worker_pb2.KvSnapshot) -> bool:
        """Replace a syncing worker's blocks with `snapshot`, then replay newer buffered events.

        Returns True when another snapshot is needed (the buffer overflowed or
        the replay found a gap). A snapshot for an unknown worker is ignored.
        """
        wid = snapshot.worker_id
        st = self._workers.get(wid)
        if st is None:
            return False
        device: dict[int, list[int]] = {}  # dp rank -> its blocks (a rank listed twice: both lists)
        for rank in snapshot.ranks:
            device.setdefault(rank.dp_rank, []).extend(_hashes(rank))
        for key in self.map.keys_of(wid):
            if key[1] not in device:
                self.map.clear_slot(self.map.slot_of[key])
            self.lower.clear_slot(self.map.slot_of[key])
        for dp, hashes in device.items():
            self.map.replace(self.map.slot((wid, dp)), hashes)
        for rank in snapshot.ranks:
            slot = self.map.slot_of[(wid, rank.dp_rank)]
            for tb in rank.lower_tiers:
                if tb.tier:
                    self.lower.add(tb.tier, slot, _hashes(tb))
        st.last_event_id = snapshot.last_event_id
        buffered, overflowed = st.buffer, st.overflowed
        st.buffer, st.overflowed, st.syncing = [], False, False
        if overflowed:
            return self.request_resync(wid)
        expected = st.last_event_id + 1
        for dp, ev in buffered:
            if ev.event_id < expected:
                continue  # already reflected in the snapshot
            if ev.event_id != expected:
                return self.request_resync(wid)
            self._apply(self.map.slot((wid, dp)), ev)
            st.last_event_id = expected
            expected += 1
        return False

    def _buffer(self, st: _WorkerState, dp: int, events: Sequence[events_pb2.KvEvent]) -> None:
        if st.overflowed:
            return
        if len(st.buffer) + len(events) > MAX_BUFFERED_EVENTS:
            st.buffer, st.overflowed = [], True
            return
        st.buffer.extend((dp, ev) for ev in events)

    def _apply(self, slot: int, ev: events_pb2.KvEvent) -> None:
        kind = ev.WhichOneof("data")
        if kind == "stored":
            stored = ev.stored
            hashes = _hashes(stored)
            if stored.tier:
                self.lower.add(stored.tier, slot, hashes)
            else:
                self.map.add(slot, hashes[::-1])  # the first block most recently used
            self.applied += len(hashes)
        elif kind == "removed":
            gone = ev.removed.block_hashes
            if ev.removed.tier:
                self.lower.remove(ev.removed.tier, slot, gone)
            else:
                self.map.remove(slot, gone)
            self.applied += len(gone)
        elif kind == "cleared":
            self.applied += self.map.clear_slot(slot) + self.lower.clear_slot(slot)

    # ------------------------------------------------------------ queries
    def overlaps(self, hashes: Sequence[int], keys: Iterable[SlotKey]) -> dict[SlotKey, int]:
        """Leading prompt blocks each candidate (worker id, dp rank) caches."""
        return self.map.overlaps(hashes, keys)

    def tier_overlaps(
        self, hashes: Sequence[int], keys: Iterable[SlotKey], starts: Mapping[SlotKey, int]
    ) -> dict[SlotKey, TierOverlap]:
        """Continue each candidate's prefix (`starts[key]` blocks, 0 if absent) through its lower tiers.

        From block `starts[key]` on, a block counts while some tier of the
        candidate holds it: device first (a device copy beats a host copy),
        then the lower tiers nearest first (host before disk). Only
        candidates holding lower-tier blocks are walked, and only those
        that serve at least one more block are in the answer. Chained
        hashes make the run a prefix: a block is only usable after every
        block before it.
        """
        if not self.lower:
            return {}
        slot_of = self.map.slot_of
        starts_by_slot, key_of = {}, {}
        for key in keys:
            s = slot_of.get(key)
            if s is not None:
                starts_by_slot[s], key_of[s] = starts.get(key, 0), key
        return {key_of[s]: t for s, t in self.lower.served(hashes, self.map, starts_by_slot).items()}

    def worker_blocks(self, worker_id: str) -> int:
        """Blocks of `worker_id` in the index (all dp ranks)."""
        return sum(self.map.count(k) for k in self.map.keys_of(worker_id))

    def lower_blocks(self, worker_id: str, tier: int) -> int:
        """Blocks of `worker_id` the index has in lower `tier` (all dp ranks)."""
        return sum(self.lower.count(tier, self.map.slot_of[k]) for k in self.map.keys_of(worker_id))

    # ------------------------------------------------------------ eviction order

    def touch(self, key: SlotKey, hashes: Sequence[int], *, reused: bool) -> None:
        """A prompt routed to `key` (or ending there) used its cached `hashes`: most recently used now."""
        s = self.map.slot_of.get(key)
        if s is not None and hashes:
            self.map.touch(s, hashes, reused=reused)

    @property
    def size(self) -> int:
        """Distinct block hashes indexed in device tiers."""
        return len(self.map)


def _hashes(msg: events_pb2.BlocksStored | worker_pb2.KvRankSnapshot | worker_pb2.KvTierBlocks) -> list[int]:
    """A message's block hashes: packed `block_hashes` (workers since 2026-11-29), then `blocks` (older workers)."""
    hashes = list(msg.block_hashes)
    if msg.blocks:
        hashes += [b.block_hash for b in msg.blocks]
    return hashes

"""The router's KV index: block hash → the workers (and dp ranks) caching it, fed by KV events.

Layout, chosen for speed (bench/indexer.py): every (worker id, dp rank) gets a
*slot*, a small integer; `BlockMap.masks` maps a block hash to an int whose
bit `slot` is set when that slot holds the block. Applying a stored block is
one dict update; the overlap of a prompt is a walk over its chained block
hashes that ANDs the masks and stops at the first block nobody (among the
candidates) holds — chained hashes make "holds block i" imply "holds the
prefix up to i". Each slot also keeps the set of its hashes, so removing a
worker or clearing its cache touches only its own blocks.

`KvIndex` adds the event bookkeeping: per worker the id of the last applied
event. A batch whose first id is not `last + 1` (lost events, a restarted
worker), a new worker and a router start all put the worker in *syncing*
state: its events are buffered (not applied) until `apply_snapshot` replaces
its blocks with a `Worker.GetKvSnapshot` answer and replays the buffered
events whose id is greater than the snapshot's `last_event_id`. Subscribe
first, snapshot second: nothing falls in between. The index does no I/O;
`meshllm.router.feed` fetches the snapshots it asks for.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from meshllm.v1 import events_pb2, worker_pb2

__all__ = ["BlockMap", "KvIndex", "SlotKey"]

SlotKey = tuple[str, int]  # (worker id, dp rank)

MAX_BUFFERED_EVENTS = 200_000  # per syncing worker; beyond it the buffer is dropped and the sync restarted


class BlockMap:
    """block hash → bitmask of slots, plus each slot's set of hashes."""

    __slots__ = ("_free", "_keys", "blocks", "masks", "slot_of")

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}
        self.slot_of: dict[SlotKey, int] = {}
        self.blocks: list[set[int]] = []
        self._keys: list[SlotKey | None] = []
        self._free: list[int] = []

    def slot(self, key: SlotKey) -> int:
        """The slot of `key`, allocated on first use (freed slots are reused, lowest first)."""
        s = self.slot_of.get(key)
        if s is None:
            if self._free:
                s = self._free.pop()
                self._keys[s] = key
            else:
                s = len(self._keys)
                self._keys.append(key)
                self.blocks.append(set())
            self.slot_of[key] = s
        return s

    def add(self, slot: int, hashes: Iterable[int]) -> int:
        """Mark `hashes` held by `slot`; returns how many were new to it."""
        masks, held, bit = self.masks, self.blocks[slot], 1 << slot
        get = masks.get
        before = len(held)
        for h in hashes:
            masks[h] = get(h, 0) | bit
            held.add(h)
        return len(held) - before

    def remove(self, slot: int, hashes: Iterable[int]) -> int:
        """Unmark `hashes` for `slot`; returns how many it actually held."""
        masks, held, keep = self.masks, self.blocks[slot], ~(1 << slot)
        n = 0
        for h in hashes:
            if h in held:
                held.discard(h)
                m = masks[h] & keep
                if m:
                    masks[h] = m
                else:
                    del masks[h]
                n += 1
        return n

    def clear_slot(self, slot: int) -> int:
        """Drop every block of `slot`; returns how many."""
        held = self.blocks[slot]
        n = len(held)
        masks, keep = self.masks, ~(1 << slot)
        for h in held:
            m = masks[h] & keep
            if m:
                masks[h] = m
            else:
                del masks[h]
        self.blocks[slot] = set()
        return n

    def drop(self, key: SlotKey) -> None:
        """Forget `key` and its blocks; its slot becomes free."""
        s = self.slot_of.pop(key, None)
        if s is None:
            return
        self.clear_slot(s)
        self._keys[s] = None
        self._free.append(s)
        self._free.sort(reverse=True)

    def keys_of(self, worker_id: str) -> list[SlotKey]:
        return [k for k in self.slot_of if k[0] == worker_id]

    def count(self, key: SlotKey) -> int:
        s = self.slot_of.get(key)
        return 0 if s is None else len(self.blocks[s])

    def overlaps(self, hashes: Sequence[int], keys: Iterable[SlotKey]) -> dict[SlotKey, int]:
        """Leading blocks of `hashes` each of `keys` holds (keys holding none are absent)."""
        slot_of = self.slot_of
        mask = 0
        for k in keys:
            s = slot_of.get(k)
            if s is not None and self.blocks[s]:
                mask |= 1 << s
        out: dict[SlotKey, int] = {}
        if not mask:
            return out
        get = self.masks.get
        depth = 0
        for h in hashes:
            m = get(h, 0) & mask
            if m != mask:
                if depth:
                    self._record(mask & ~m, depth, out)
                mask = m
                if not mask:
                    return out
            depth += 1
        self._record(mask, depth, out)
        return out

    def _record(self, bits: int, depth: int, out: dict[SlotKey, int]) -> None:
        keys = self._keys
        while bits:
            low = bits & -bits
            key = keys[low.bit_length() - 1]
            if key is not None:
                out[key] = depth
            bits ^= low


@dataclass(slots=True)
class _WorkerState:
    last_event_id: int = 0
    syncing: bool = True
    buffer: list[tuple[int, events_pb2.KvEvent]] = field(default_factory=list)
    overflowed: bool = False


class KvIndex:
    """The event-fed index of every worker's resident KV blocks (see the module docstring).

    `applied` counts block-events applied (one per stored or removed block);
    `resyncs_requested` counts gaps and new workers that asked for a snapshot.
    """

    def __init__(self) -> None:
        self.map = BlockMap()
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
            self.map.drop(key)

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
        for key in self.map.keys_of(wid):
            self.map.clear_slot(self.map.slot_of[key])
        for rank in snapshot.ranks:
            slot = self.map.slot((wid, rank.dp_rank))
            self.map.add(slot, [b.block_hash for b in rank.blocks])
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
            blocks = ev.stored.blocks
            self.map.add(slot, [b.block_hash for b in blocks])
            self.applied += len(blocks)
        elif kind == "removed":
            hashes = ev.removed.block_hashes
            self.map.remove(slot, hashes)
            self.applied += len(hashes)
        elif kind == "cleared":
            self.applied += self.map.clear_slot(slot)

    # ------------------------------------------------------------ queries
    def overlaps(self, hashes: Sequence[int], keys: Iterable[SlotKey]) -> dict[SlotKey, int]:
        """Leading prompt blocks each candidate (worker id, dp rank) caches."""
        return self.map.overlaps(hashes, keys)

    def worker_blocks(self, worker_id: str) -> int:
        """Blocks of `worker_id` in the index (all dp ranks)."""
        return sum(self.map.count(k) for k in self.map.keys_of(worker_id))

    @property
    def size(self) -> int:
        """Distinct block hashes indexed."""
        return len(self.map.masks)

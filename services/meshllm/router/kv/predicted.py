"""The router's own prediction of what workers cache, from the prompts it routed.

Two structures:

- `PredictedIndex` — **in flight** (`kv` mode): a worker running a request
  holds that request's prompt blocks (they are referenced, so they cannot be
  evicted), even before its KV events arrive. Entries are removed when the
  request ends. This keeps a burst of same-prefix requests on one worker
  instead of spreading it while the first prefill is still running. Each
  entry is one routed request: (slot key, block hashes); blocks are
  reference-counted per slot so overlapping prompts share them.
- `RoutedCache` — **approximate** (`approximate` mode, no events): each
  slot's cache simulated from what was routed to it, with the treatment the
  KV index gets from events: the blocks of a routed prompt enter the slot's
  cache in the engine's eviction order (least recently used first, the
  prompt's first block last), a block routed again counts as reused, a slot
  over its capacity (`set_total`) drops its least recently used blocks as
  the engine would evict them, and a block not routed for `ttl_s` seconds is
  forgotten. `capacity` answers as `KvIndex.capacity` does.

The prefix walk of both is `BlockMap.overlaps`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from meshllm.router.kv.blocks import SlotKey, block_map
from meshllm.router.kv.capacity import SlotCapacities

__all__ = ["PredictedIndex", "RoutedCache"]


class PredictedIndex:
    """Reference-counted (slot, block hash) entries, removed explicitly when their request ends."""

    def __init__(self) -> None:
        self.map = block_map()
        self._refs: dict[tuple[int, int], int] = {}
        self._entries: dict[str, tuple[SlotKey, tuple[int, ...]]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: SlotKey, hashes: Sequence[int], *, entry_id: str | None = None) -> str:
        """Record that `key` holds (or will hold) `hashes`; returns the entry id."""
        if entry_id is None or entry_id in self._entries:
            self._seq += 1
            entry_id = f"{entry_id or 'e'}#{self._seq}"
        slot = self.map.slot(key)
        fresh = []
        refs = self._refs
        for h in hashes:
            k = (slot, h)
            n = refs.get(k, 0)
            refs[k] = n + 1
            if n == 0:
                fresh.append(h)
        self.map.add(slot, fresh)
        self._entries[entry_id] = (key, tuple(hashes))
        return entry_id

    def remove(self, entry_id: str) -> None:
        """Drop one entry (its blocks stay while another entry holds them)."""
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return
        key, hashes = entry
        slot = self.map.slot_of.get(key)
        if slot is None:
            return
        gone = []
        refs = self._refs
        for h in hashes:
            k = (slot, h)
            n = refs.get(k, 0) - 1
            if n > 0:
                refs[k] = n
            else:
                refs.pop(k, None)
                gone.append(h)
        self.map.remove(slot, gone)

    def remove_worker(self, worker_id: str) -> None:
        """Forget every entry of a worker."""
        for entry_id in [e for e, (k, _) in self._entries.items() if k[0] == worker_id]:
            del self._entries[entry_id]
        for key in self.map.keys_of(worker_id):
            slot = self.map.slot_of[key]
            for h in self.map.iter_blocks(slot):
                self._refs.pop((slot, h), None)
            self.map.drop(key)

    def overlaps(self, hashes: Sequence[int], keys: Iterable[SlotKey]) -> dict[SlotKey, int]:
        return self.map.overlaps(hashes, keys)

    def worker_blocks(self, worker_id: str) -> int:
        return sum(self.map.count(k) for k in self.map.keys_of(worker_id))


class RoutedCache(SlotCapacities):
    """approximate mode: each slot's cache simulated from routed prompts (see the module docstring)."""

    def __init__(self, *, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.map = block_map()
        self.totals: dict[SlotKey, int] = {}
        self._used: dict[int, dict[int, float]] = {}  # slot -> block hash -> when last routed

    def add(self, key: SlotKey, hashes: Sequence[int], *, now: float) -> None:
        """`hashes` were routed to `key` at `now`: cached there from now on, most recently used."""
        slot = self.map.slot(key)
        holds = self.map.holds
        reused = 0
        for h in hashes:
            if not holds(slot, h):
                break
            reused += 1
        self.map.touch(slot, hashes[:reused], reused=True)
        self.map.add(slot, hashes[reused:])
        self.map.touch(slot, hashes, reused=False)  # the engine's order: the first block released last
        used = self._used.setdefault(slot, {})
        for h in hashes:
            used[h] = now
        total, size = self.totals.get(key, 0), self.map.sizes[slot]
        if total > 0 and size > total:
            self._drop(slot, self.map.oldest(slot, size - total))

    def expire(self, now: float) -> int:
        """Forget blocks not routed for `ttl_s`; returns how many."""
        n = 0
        cutoff = now - self.ttl_s
        for slot, used in self._used.items():
            old = []
            for h in self.map.iter_blocks(slot):  # least recently routed first
                if used.get(h, cutoff) > cutoff:
                    break
                old.append(h)
            self._drop(slot, old)
            n += len(old)
        return n

    def _drop(self, slot: int, hashes: list[int]) -> None:
        if not hashes:
            return
        self.map.remove(slot, hashes)
        used = self._used.get(slot, {})
        for h in hashes:
            used.pop(h, None)

    def remove_worker(self, worker_id: str) -> None:
        """Forget every block of a worker."""
        for key in self.map.keys_of(worker_id):
            self._used.pop(self.map.slot_of[key], None)
            self.map.drop(key)
        self._forget_totals(worker_id)

    def overlaps(self, hashes: Sequence[int], keys: Iterable[SlotKey]) -> dict[SlotKey, int]:
        return self.map.overlaps(hashes, keys)

    def worker_blocks(self, worker_id: str) -> int:
        return sum(self.map.count(k) for k in self.map.keys_of(worker_id))

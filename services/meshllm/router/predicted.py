"""The router's own prediction of what workers cache: prompts it routed, before (or instead of) KV events.

Two uses, one structure:

- **in flight** (`kv` mode): a worker running a request holds that request's
  prompt blocks (they are referenced, so they cannot be evicted), even before
  its KV events arrive. Entries are removed when the request ends. This keeps
  a burst of same-prefix requests on one worker instead of spreading it while
  the first prefill is still running.
- **approximate** (`approximate` mode, no events): a routed prompt is assumed
  cached for `ttl_s` seconds after the last time it was routed.

Each entry is one routed request: (slot key, block hashes). Blocks are
reference-counted per slot so overlapping prompts share them; the prefix walk
is `BlockMap.overlaps`.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

from meshllm.router.kv_index import BlockMap, SlotKey

__all__ = ["PredictedIndex"]


class PredictedIndex:
    """Reference-counted (slot, block hash) entries with explicit removal or a TTL."""

    def __init__(self, *, ttl_s: float | None = None) -> None:
        self.ttl_s = ttl_s
        self.map = BlockMap()
        self._refs: dict[tuple[int, int], int] = {}
        self._entries: dict[str, tuple[SlotKey, tuple[int, ...]]] = {}
        self._expiry: collections.deque[tuple[float, str]] = collections.deque()
        self._seq = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: SlotKey, hashes: Sequence[int], *, entry_id: str | None = None, now: float = 0.0) -> str:
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
        if self.ttl_s is not None:
            self._expiry.append((now + self.ttl_s, entry_id))
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

    def expire(self, now: float) -> int:
        """Remove entries whose TTL passed; returns how many."""
        n = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, entry_id = self._expiry.popleft()
            if entry_id in self._entries:
                self.remove(entry_id)
                n += 1
        return n

    def remove_worker(self, worker_id: str) -> None:
        """Forget every entry of a worker."""
        for entry_id in [e for e, (k, _) in self._entries.items() if k[0] == worker_id]:
            del self._entries[entry_id]
        for key in self.map.keys_of(worker_id):
            slot = self.map.slot_of[key]
            for h in self.map.blocks[slot]:
                self._refs.pop((slot, h), None)
            self.map.drop(key)

    def overlaps(self, hashes: Sequence[int], keys: Iterable[SlotKey]) -> dict[SlotKey, int]:
        return self.map.overlaps(hashes, keys)

    def worker_blocks(self, worker_id: str) -> int:
        return sum(self.map.count(k) for k in self.map.keys_of(worker_id))

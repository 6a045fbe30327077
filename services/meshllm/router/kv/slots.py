"""The slots of a block map: each (worker id, dp rank) numbered, what both block maps share (blocks.py, compiled.py).

A slot is a small integer, the bit of its key in every block's mask; freed slots are reused, lowest first.
`sizes` and `hot` are int64 arrays (blocks held, blocks reused at least once, per slot) that a fleet decision
reads as numpy arrays without a copy (`np.frombuffer`).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

__all__ = ["SlotKey", "SlotTable"]

SlotKey = tuple[str, int]  # (worker id, dp rank)


class SlotTable:
    """Slot numbers of keys, and the overlaps by key that a block map's `overlap_groups` answers by slot bits."""

    __slots__ = ("_free", "_keys", "generation", "hot", "sizes", "slot_of")

    def __init__(self) -> None:
        self.slot_of: dict[SlotKey, int] = {}
        self.hot = array("q")
        self.sizes = array("q")
        self.generation = 0  # bumped whenever a slot is allocated or freed (fleet tables cache slot numbers)
        self._keys: list[SlotKey | None] = []
        self._free: list[int] = []

    def _grow(self) -> None:
        """A new slot number (len(self._keys) - 1) was given out: room for its state."""

    def clear_slot(self, slot: int) -> int:
        raise NotImplementedError

    def overlap_groups(self, hashes: Sequence[int], mask: int) -> list[tuple[int, int]]:
        raise NotImplementedError

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
                self.hot.append(0)
                self.sizes.append(0)
                self._grow()
            self.slot_of[key] = s
            self.generation += 1
        return s

    def drop(self, key: SlotKey) -> None:
        """Forget `key` and its blocks; its slot becomes free."""
        s = self.slot_of.pop(key, None)
        if s is None:
            return
        self.clear_slot(s)
        self._keys[s] = None
        self._free.append(s)
        self._free.sort(reverse=True)
        self.generation += 1

    def keys_of(self, worker_id: str) -> list[SlotKey]:
        return [k for k in self.slot_of if k[0] == worker_id]

    def count(self, key: SlotKey) -> int:
        s = self.slot_of.get(key)
        return 0 if s is None else self.sizes[s]

    def overlaps(self, hashes: Sequence[int], keys: Iterable[SlotKey]) -> dict[SlotKey, int]:
        """Leading blocks of `hashes` each of `keys` holds (keys holding none are absent)."""
        slot_of, sizes = self.slot_of, self.sizes
        mask = 0
        for k in keys:
            s = slot_of.get(k)
            if s is not None and sizes[s]:
                mask |= 1 << s
        out: dict[SlotKey, int] = {}
        if mask:
            for depth, bits in self.overlap_groups(hashes, mask):
                self._record(bits, depth, out)
        return out

    def _record(self, bits: int, depth: int, out: dict[SlotKey, int]) -> None:
        keys = self._keys
        while bits:
            low = bits & -bits
            key = keys[low.bit_length() - 1]
            if key is not None:
                out[key] = depth
            bits ^= low

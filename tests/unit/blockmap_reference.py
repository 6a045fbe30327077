"""The `BlockMap` of meshllm.router.kv.blocks before block ids (commit b9219d5): the reference the randomized
equivalence test (test_block_map_equivalence.py) holds the current one to — hash-keyed, one int object per pair."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from itertools import islice

SlotKey = tuple[str, int]


class ReferenceBlockMap:
    """block hash → bitmask of slots, plus each slot's blocks in eviction order with their reuse counts."""

    __slots__ = ("_free", "_keys", "blocks", "generation", "hot", "masks", "sizes", "slot_of")

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}
        self.slot_of: dict[SlotKey, int] = {}
        self.blocks: list[dict[int, int]] = []  # per slot: hash → reuses, least recently used first (insertion order)
        self.hot: list[int] = []  # per slot: how many of its blocks were reused (kept as blocks come and go)
        self.sizes: list[int] = []  # per slot: len(blocks[slot]), kept for fleet decisions (one list to read)
        self.generation = 0  # bumped whenever a slot is allocated or freed (fleet tables cache slot numbers)
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
                self.blocks.append({})
                self.hot.append(0)
                self.sizes.append(0)
            self.slot_of[key] = s
            self.generation += 1
        return s

    def add(self, slot: int, hashes: Iterable[int]) -> int:
        """Mark `hashes` held by `slot` (new ones at the most recently used end, in order); returns how many were new."""
        masks, held, bit = self.masks, self.blocks[slot], 1 << slot
        get = masks.get
        before = len(held)
        for h in hashes:
            masks[h] = get(h, 0) | bit
            if h not in held:
                held[h] = 0
        self.sizes[slot] = len(held)
        return len(held) - before

    def touch(self, slot: int, hashes: Sequence[int], *, reused: bool) -> None:
        """Move the held ones of `hashes` to the most recently used end, the first last; count a reuse if `reused`."""
        held = self.blocks[slot]
        pop = held.pop
        for h in reversed(hashes):
            n = pop(h, None)
            if n is not None:
                if reused:
                    if not n:
                        self.hot[slot] += 1
                    n += 1
                held[h] = n  # re-inserted: the most recently used end

    def hot_victims(self, slot: int, k: int, keep: AbstractSet[int] = frozenset()) -> int:
        """Of the `k` least recently used blocks of `slot` not in `keep`, how many were reused since stored."""
        if k <= 0:
            return 0
        held = self.blocks[slot]
        # The victims are the first `w` entries, `w` grown until k of them are outside `keep`;
        # slices and set operations keep the work at C speed (a routing decision asks this per worker).
        w = k
        inside: AbstractSet[int] = frozenset()
        while w < len(held):
            inside = keep & set(islice(held, w)) if keep else frozenset()
            if w - len(inside) >= k:
                break
            w = k + len(inside)
        else:
            inside = keep & held.keys() if keep else frozenset()
        window = list(islice(held.values(), w))
        return len(window) - window.count(0) - sum(1 for h in inside if held[h])

    def remove(self, slot: int, hashes: Iterable[int]) -> int:
        """Unmark `hashes` for `slot`; returns how many it actually held."""
        masks, held, keep = self.masks, self.blocks[slot], ~(1 << slot)
        n = hot = 0
        pop = held.pop
        for h in hashes:
            reuses = pop(h, None)
            if reuses is not None:
                if reuses:
                    hot += 1
                m = masks[h] & keep
                if m:
                    masks[h] = m
                else:
                    del masks[h]
                n += 1
        if hot:
            self.hot[slot] -= hot
        self.sizes[slot] = len(held)
        return n

    def clear_slot(self, slot: int) -> int:
        """Drop every block of `slot`; returns how many."""
        n = len(self.blocks[slot])
        self._unmark(slot, self.blocks[slot])
        self.blocks[slot] = {}
        self.hot[slot] = 0
        self.sizes[slot] = 0
        return n

    def _unmark(self, slot: int, hashes: Iterable[int]) -> None:
        """Clear `slot`'s bit in the masks of `hashes`, all of which it holds (a mask left empty goes)."""
        masks, keep = self.masks, ~(1 << slot)
        for h in hashes:
            m = masks[h] & keep
            if m:
                masks[h] = m
            else:
                del masks[h]

    def replace(self, slot: int, hashes: Iterable[int]) -> int:
        """Make `hashes` the blocks of `slot`, in that order, with no reuse counted: the state `clear_slot` then
        `add` leave (a snapshot), at the cost of the difference only. Returns how many blocks `slot` holds."""
        old, new = self.blocks[slot], dict.fromkeys(hashes, 0)
        self._unmark(slot, old.keys() - new.keys())
        masks, bit = self.masks, 1 << slot
        get = masks.get
        for h in new.keys() - old.keys():
            masks[h] = get(h, 0) | bit
        self.blocks[slot] = new
        self.hot[slot] = 0
        self.sizes[slot] = len(new)
        return len(new)

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
        if mask:
            for depth, bits in self.overlap_groups(hashes, mask):
                self._record(bits, depth, out)
        return out

    def overlap_groups(self, hashes: Sequence[int], mask: int) -> list[tuple[int, int]]:
        """`overlaps` by slot bits: (depth, bits of the slots among `mask` whose prefix ends there), depth > 0.

        The walk of `overlaps` without one dict entry per slot: a block every
        slot of a fleet holds (a chat template) ends as one group, not as
        a thousand keys.
        """
        out: list[tuple[int, int]] = []
        get = self.masks.get
        depth = 0
        for h in hashes:
            m = get(h, 0) & mask
            if m != mask:
                if depth:
                    out.append((depth, mask & ~m))
                mask = m
                if not mask:
                    return out
            depth += 1
        if depth and mask:
            out.append((depth, mask))
        return out

    def _record(self, bits: int, depth: int, out: dict[SlotKey, int]) -> None:
        keys = self._keys
        while bits:
            low = bits & -bits
            key = keys[low.bit_length() - 1]
            if key is not None:
                out[key] = depth
            bits ^= low

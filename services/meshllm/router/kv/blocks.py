"""Block hash → the slots (worker, dp rank) holding it, and each slot's blocks in eviction order.

`BlockMap` is the compiled map (compiled.py over `_blockcore.c`: ~54 B per pair at 1,024 workers against ~164
here, 2× the ingestion) wherever the extension was built, else `PyBlockMap`, this module's, which answers the
same (tests/unit/test_block_map_equivalence.py checks both against one reference).

The Python map's layout, chosen for speed and memory in Python (bench/indexer.py, bench/fleet.py): every
(worker id, dp rank) gets a *slot*, a small integer; every distinct block hash indexed gets a *block id*, a small integer
too (`BlockMap.ids`; the id of a hash nobody holds any more is reused). `BlockMap.bits[id]` is an int whose
bit `slot` is set when that slot holds the block; id 0 is never given out and its bits stay 0, so
`bits[ids.get(h, 0)]` is the mask of any hash. A stored block is one dict lookup and one mask update; the
overlap of a prompt is a walk over its chained block hashes that ANDs the masks and stops at the first
block nobody (among the candidates) holds — chained hashes make "holds block i" imply "holds the prefix".

Each slot keeps its blocks' ids in a dict (`BlockMap.held`; removing a worker touches only its blocks) whose
insertion order is the slot's *eviction order* (least recently used first; a block used again is popped and
re-inserted), with per block how often a routed prompt reused it. Keyed by id: one int object per block,
shared by every slot holding it, not one per pair (docs/routing.md "The KV index").

`KvIndex.set_total` records each slot's capacity; `KvIndex.capacity` answers, for one prompt, how full the
slot is and how many blocks it would evict were reused (`meshllm.router.policy.choice`). Stored blocks enter
at the most recently used end, a prompt's first block last (engines release a sequence tail first); `touch`
moves a routed prompt's cached blocks there and counts the reuse. `SlotCapacities` answers the capacity
terms (`meshllm.router.kv.capacity`) for the event-fed `KvIndex` and the approximate mode's `RoutedCache`.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from itertools import islice
from typing import TYPE_CHECKING

from meshllm.router.kv.slots import SlotKey, SlotTable

__all__ = ["BlockMap", "PyBlockMap", "SlotKey", "block_map"]

log = logging.getLogger(__name__)


class PyBlockMap(SlotTable):
    """block hash → block id → bitmask of slots, plus each slot's block ids in eviction order with their reuse counts."""

    __slots__ = ("_dead", "_free_ids", "_keep", "_version", "bits", "held", "ids", "keys")

    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[int, int] = {}  # block hash -> block id (> 0)
        self.bits: list[int] = [0]  # block id -> bitmask of the slots holding it; 0 for id 0 and free ids
        self.keys = array("Q", [0])  # block id -> its hash, unboxed (0 for id 0 and free ids: never read)
        self.held: list[dict[int, int]] = []  # per slot: block id -> reuses, least recently used first (insertion order)
        self._dead = array("q")  # per slot: entries popped from its dict since it was last compacted (`_compact`)
        self._free_ids: list[int] = []
        self._version = 0  # bumped whenever a block id is given out or freed
        self._keep: tuple[frozenset[int], int, frozenset[int]] = (frozenset(), 0, frozenset())  # see _keep_ids

    def __len__(self) -> int:
        """Distinct block hashes some slot holds."""
        return len(self.ids)

    def _grow(self) -> None:
        self.held.append({})
        self._dead.append(0)

    def _new_id(self, h: int) -> int:
        """A block id for `h` (not indexed yet), its mask 0 until a slot's bit is set."""
        if self._free_ids:
            i = self._free_ids.pop()
            self.keys[i] = h
        else:
            i = len(self.keys)
            self.keys.append(h)
            self.bits.append(0)
        self.ids[h] = i
        self._version += 1
        return i

    def _unmark(self, slot: int, block_ids: Iterable[int]) -> None:
        """Clear `slot`'s bit in the masks of `block_ids`, all of which it holds (an id left with no slot is freed)."""
        bits, keys, ids, keep = self.bits, self.keys, self.ids, ~(1 << slot)
        freed = self._free_ids
        before = len(freed)
        for i in block_ids:
            m = bits[i] & keep
            bits[i] = m
            if not m:
                del ids[keys[i]]
                keys[i] = 0
                freed.append(i)
        self._version += len(freed) - before

    def mask(self, h: int) -> int:
        """The bitmask of the slots holding `h`."""
        return self.bits[self.ids.get(h, 0)]

    def add(self, slot: int, hashes: Iterable[int]) -> int:
        """Mark `hashes` held by `slot` (new ones at the most recently used end, in order); returns how many were new."""
        ids, bits, keys, free, held, bit = self.ids, self.bits, self.keys, self._free_ids, self.held[slot], 1 << slot
        get = ids.get
        before = len(held)
        fresh = 0
        for h in hashes:
            i = get(h)
            if i is None:  # a block nobody holds: a new id (`_new_id`, inline: most stored blocks are new)
                if free:
                    i = free.pop()
                    keys[i] = h
                    bits[i] = bit  # one int for every block only this slot holds
                else:
                    i = len(keys)
                    keys.append(h)
                    bits.append(bit)
                ids[h] = i
                held[i] = 0
                fresh += 1
            elif i not in held:
                bits[i] |= bit
                held[i] = 0
        self._version += fresh
        self.sizes[slot] = len(held)
        return len(held) - before

    def touch(self, slot: int, hashes: Sequence[int], *, reused: bool) -> None:
        """Move the held ones of `hashes` to the most recently used end, the first last; count a reuse if `reused`."""
        held = self.held[slot]
        pop = held.pop
        moved = 0
        for i in map(self.ids.get, reversed(hashes)):  # None for a hash nobody holds: never in `held`
            n = pop(i, None)  # type: ignore[arg-type]
            if n is not None:
                moved += 1
                if reused:
                    if not n:
                        self.hot[slot] += 1
                    n += 1
                held[i] = n  # type: ignore[index]  # re-inserted: the most recently used end
        self._compact(slot, moved)

    def _compact(self, slot: int, popped: int) -> None:
        """Count `popped` entries of `slot`'s dict; once they pass a quarter of it, a compact copy (same order) replaces
        it. A popped entry is a hole only a resize reclaims, and a churning dict resizes to 3× its entries: ~2.2× the
        memory of a compact one, `hot_victims`'s end behind holes (docs/routing.md "The KV index")."""
        dead = self._dead[slot] + popped
        held = self.held[slot]
        if dead > (len(held) >> 2) + 64:
            self.held[slot] = dict(held)
            dead = 0
        self._dead[slot] = dead

    def hot_victims(self, slot: int, k: int, keep: AbstractSet[int] = frozenset()) -> int:
        """Of the `k` least recently used blocks of `slot` not in `keep` (hashes), how many were reused since stored."""
        if k <= 0:
            return 0
        held = self.held[slot]
        kept = self._keep_ids(keep)
        # The victims are the first `w` entries, `w` grown until k of them are outside `keep`;
        # islice and set.intersection keep the work at C speed (a routing decision asks this per worker).
        w = k
        inside: AbstractSet[int] = frozenset()
        while w < len(held):
            inside = kept.intersection(islice(held, w)) if kept else frozenset()
            if w - len(inside) >= k:
                break
            w = k + len(inside)
        else:
            inside = kept & held.keys()
        window = list(islice(held.values(), w))
        return len(window) - window.count(0) - sum(1 for i in inside if held[i])

    def _keep_ids(self, keep: AbstractSet[int]) -> frozenset[int]:
        """The block ids of the hashes of `keep` indexed. A decision asks `hot_victims` per candidate with one
        frozenset (the prompt): its ids are kept while that frozenset and every block id stay as they are."""
        last, version, kept = self._keep
        if keep is last and version == self._version:
            return kept
        kept = frozenset(filter(None, map(self.ids.get, keep)))  # id 0 is never given out
        if isinstance(keep, frozenset):  # immutable: the same object is the same hashes next time
            self._keep = (keep, self._version, kept)
        return kept

    def remove(self, slot: int, hashes: Iterable[int]) -> int:
        """Unmark `hashes` for `slot`; returns how many it actually held."""
        held = self.held[slot]
        pop, get = held.pop, self.ids.get
        gone = []
        hot = 0
        for h in hashes:
            i = get(h, 0)
            reuses = pop(i, None)
            if reuses is not None:
                if reuses:
                    hot += 1
                gone.append(i)
        if hot:
            self.hot[slot] -= hot
        self._unmark(slot, gone)
        self.sizes[slot] = len(held)
        self._compact(slot, len(gone))
        return len(gone)

    def clear_slot(self, slot: int) -> int:
        """Drop every block of `slot`; returns how many."""
        n = len(self.held[slot])
        self._unmark(slot, self.held[slot])
        self.held[slot] = {}
        self.hot[slot] = 0
        self.sizes[slot] = 0
        self._dead[slot] = 0
        return n

    def replace(self, slot: int, hashes: Iterable[int]) -> int:
        """Make `hashes` the blocks of `slot`, in that order, with no reuse counted: the state `clear_slot` then
        `add` leave (a snapshot), at the cost of the difference only. Returns how many blocks `slot` holds."""
        old = self.held[slot]
        known = dict(zip(map(self.keys.__getitem__, old), old, strict=True))  # by hash, without the fleet's ids dict
        new = dict.fromkeys(self._ids_of(list(dict.fromkeys(hashes)), known), 0)
        self._unmark(slot, old.keys() - new.keys())
        bits, bit = self.bits, 1 << slot
        for i in new.keys() - old.keys():
            bits[i] |= bit
        self.held[slot] = new
        self.hot[slot] = 0
        self.sizes[slot] = len(new)
        self._dead[slot] = 0
        return len(new)

    def _ids_of(self, hashes: list[int], known: dict[int, int]) -> list[int]:
        """The ids of distinct `hashes`, new ones given out: `known` (hash -> id) first, the fleet's ids dict after."""
        got = list(map(known.get, hashes))
        get = self.ids.get
        if got.count(None) * 8 > len(got):
            got = list(map(get, hashes))
        try:
            j = got.index(None)
            while True:
                i = get(hashes[j])
                got[j] = self._new_id(hashes[j]) if i is None else i
                j = got.index(None, j + 1)
        except ValueError:
            pass
        return got  # type: ignore[return-value]  # no None left

    # ------------------------------------------------------------ a slot's blocks by hash
    def blocks(self, slot: int) -> dict[int, int]:
        """`slot`'s blocks, hash → reuses, in eviction order (a copy)."""
        keys = self.keys
        return {keys[i]: n for i, n in self.held[slot].items()}

    def iter_blocks(self, slot: int) -> Iterator[int]:
        """`slot`'s block hashes, least recently used first (do not change the slot while iterating)."""
        return map(self.keys.__getitem__, self.held[slot])

    def oldest(self, slot: int, k: int) -> list[int]:
        """The `k` least recently used block hashes of `slot`, least recently used first."""
        return list(islice(self.iter_blocks(slot), max(k, 0)))

    def holds(self, slot: int, h: int) -> bool:
        return self.ids.get(h, 0) in self.held[slot]

    def holding(self, slot: int, hashes: Iterable[int]) -> set[int]:
        """Those of `hashes` that `slot` holds."""
        held, get = self.held[slot], self.ids.get
        return {h for h in hashes if get(h, 0) in held}

    def masks(self) -> dict[int, int]:
        """Every indexed hash → the bitmask of its slots (a copy, for checks)."""
        bits = self.bits
        return {h: bits[i] for h, i in self.ids.items()}

    # ------------------------------------------------------------ overlaps
    def overlap_groups(self, hashes: Sequence[int], mask: int) -> list[tuple[int, int]]:
        """`overlaps` by slot bits: (depth, bits of the slots among `mask` whose prefix ends there), depth > 0.

        The walk of `overlaps` without one dict entry per slot: a block every
        slot of a fleet holds (a chat template) ends as one group, not as
        a thousand keys. A block whose mask equals the one before it keeps
        every candidate the one before kept: no AND (a fleet's masks are
        ints of up to a thousand bits; a comparison allocates nothing).
        """
        out: list[tuple[int, int]] = []
        get, bits = self.ids.get, self.bits
        depth = 0
        prev = -1
        for h in hashes:
            b = bits[get(h, 0)]
            if b != prev:
                prev = b
                m = b & mask
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


COMPILED_ERROR = ""  # why the compiled map is not in use ("" when it is)

if TYPE_CHECKING:
    BlockMap = PyBlockMap
else:
    try:
        from meshllm.router.kv.compiled import CBlockMap as BlockMap
    except ImportError as e:  # built without a C compiler: the same answers, ~3x the memory, half the ingestion
        COMPILED_ERROR = str(e)
        BlockMap = PyBlockMap

_warned = False


def block_map() -> BlockMap:
    """A new block map, compiled where built; the first Python one a process makes says why in its log (once, and
    only where an index is made: not on every command's import)."""
    global _warned
    if COMPILED_ERROR and not _warned:
        _warned = True
        log.warning("the compiled KV index is not built (%s): using the Python one (same answers, ~3x the memory)",
                    COMPILED_ERROR)  # fmt: skip
    return BlockMap()

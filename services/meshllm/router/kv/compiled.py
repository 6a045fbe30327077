"""The block map on the C core (`_blockcore.c`): the same answers as blocks.py's, at a third of its memory.

`BlockCore` keeps the blocks, their holders and every slot's eviction order; this wrapper numbers the
slots (`SlotTable`) and mirrors each slot's size and hot count into the int64 arrays the fleet decision reads.
Importing this module fails when the extension was not built (no C compiler at install time); blocks.py
then serves the Python map and says so in the log.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet

from meshllm.router.kv._blockcore import BlockCore
from meshllm.router.kv.slots import SlotTable

__all__ = ["CBlockMap"]


class CBlockMap(SlotTable):
    """block hash → bitmask of slots, plus each slot's blocks in eviction order with their reuse counts (in C)."""

    __slots__ = ("_core",)

    def __init__(self) -> None:
        super().__init__()
        self._core = BlockCore()

    def __len__(self) -> int:
        """Distinct block hashes some slot holds."""
        return len(self._core)

    def memory(self) -> int:
        """Bytes the core has allocated (its tables, blocks, holders, nodes and slots)."""
        return self._core.memory()

    def mask(self, h: int) -> int:
        """The bitmask of the slots holding `h`."""
        return self._core.mask(h)

    def masks(self) -> dict[int, int]:
        """Every indexed hash → the bitmask of its slots (a copy, for checks)."""
        return self._core.masks()

    def add(self, slot: int, hashes: Iterable[int]) -> int:
        """Mark `hashes` held by `slot` (new ones at the most recently used end, in order); returns how many were new."""
        n = self._core.add(slot, hashes)
        if n:
            self.sizes[slot] += n
        return n

    def touch(self, slot: int, hashes: Sequence[int], *, reused: bool) -> None:
        """Move the held ones of `hashes` to the most recently used end, the first last; count a reuse if `reused`."""
        hot = self._core.touch(slot, hashes, reused)
        if hot:
            self.hot[slot] += hot

    def hot_victims(self, slot: int, k: int, keep: AbstractSet[int] = frozenset()) -> int:
        """Of the `k` least recently used blocks of `slot` not in `keep` (hashes), how many were reused since stored."""
        return self._core.hot_victims(slot, k, keep)

    def remove(self, slot: int, hashes: Iterable[int]) -> int:
        """Unmark `hashes` for `slot`; returns how many it actually held."""
        n, hot = self._core.remove(slot, hashes)
        if n:
            self.sizes[slot] -= n
            self.hot[slot] -= hot
        return n

    def clear_slot(self, slot: int) -> int:
        """Drop every block of `slot`; returns how many."""
        n = self._core.clear_slot(slot)
        self.hot[slot] = 0
        self.sizes[slot] = 0
        return n

    def replace(self, slot: int, hashes: Iterable[int]) -> int:
        """Make `hashes` the blocks of `slot`, in that order, with no reuse counted: the state `clear_slot` then `add`
        leave (a snapshot), moving the blocks it held already. Returns how many blocks `slot` holds."""
        n = self._core.replace(slot, hashes)
        self.hot[slot] = 0
        self.sizes[slot] = n
        return n

    def blocks(self, slot: int) -> dict[int, int]:
        """`slot`'s blocks, hash → reuses, in eviction order (a copy)."""
        return self._core.blocks(slot, True)  # type: ignore[return-value]

    def iter_blocks(self, slot: int) -> Iterator[int]:
        """`slot`'s block hashes, least recently used first."""
        return iter(self._core.blocks(slot, False))

    def oldest(self, slot: int, k: int) -> list[int]:
        """The `k` least recently used block hashes of `slot`, least recently used first."""
        return self._core.blocks(slot, False, max(k, 0))  # type: ignore[return-value]

    def holds(self, slot: int, h: int) -> bool:
        return self._core.holds(slot, h)

    def holding(self, slot: int, hashes: Iterable[int]) -> set[int]:
        """Those of `hashes` that `slot` holds."""
        return self._core.holding(slot, hashes)

    def overlap_groups(self, hashes: Sequence[int], mask: int) -> list[tuple[int, int]]:
        """(depth, bits of the slots among `mask` whose prefix of `hashes` ends there), depth > 0 (see blocks.py)."""
        return self._core.overlap_groups(hashes, mask)

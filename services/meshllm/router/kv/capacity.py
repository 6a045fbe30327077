"""What a prompt would do to a slot's cache: how full it is, and how many reused blocks it would evict.

`SlotCapacities` answers the capacity terms of a routing decision from a
`BlockMap` (`meshllm.router.kv.blocks`), for the event-fed `KvIndex` and the
approximate mode's `RoutedCache` alike; `meshllm.router.policy.choice` says
how the cost uses them.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import NamedTuple

from meshllm.router.kv.blocks import BlockMap, SlotKey

__all__ = ["Capacity", "SlotCapacities", "slot_capacity"]


class Capacity(NamedTuple):
    """How a prompt would fit into one slot's cache."""

    total: int  # blocks the slot holds at most (0 = unknown)
    resident: int  # blocks it holds now, plus `pending` (routed, not yet computed)
    evicted_hot: int  # reused blocks among those it would evict to add the prompt's new blocks


class SlotCapacities:
    """What a cache view needs for the capacity terms: each slot's total blocks, and the room query.

    Shared by `KvIndex` (fed by events) and the approximate mode's `RoutedCache`
    (fed by what was routed); both keep their blocks in `self.map`.
    """

    map: BlockMap
    totals: dict[SlotKey, int]

    def set_total(self, key: SlotKey, total: int) -> None:
        """Record how many blocks `key` holds at most (0 = unknown: no capacity bound)."""
        if total > 0:
            self.totals[key] = total
        else:
            self.totals.pop(key, None)

    def capacity(self, key: SlotKey, prompt: AbstractSet[int], new_blocks: int, pending: int = 0) -> Capacity:
        """How `new_blocks` more blocks of a prompt (its block hashes: `prompt`) fit into `key`'s cache.

        `pending` counts blocks routed to `key` and not computed yet: they
        take room before this prompt's do. The victims are the least
        recently used blocks outside the prompt itself.
        """
        return slot_capacity(self.map, self.totals.get(key, 0), key, prompt, new_blocks, pending)

    def _forget_totals(self, worker_id: str) -> None:
        for key in [k for k in self.totals if k[0] == worker_id]:
            del self.totals[key]


def slot_capacity(
    blocks: BlockMap, total: int, key: SlotKey, prompt: AbstractSet[int], new_blocks: int, pending: int
) -> Capacity:
    """`KvIndex.capacity` on any `BlockMap` (the approximate mode's too)."""
    resident = blocks.count(key) + max(0, pending)
    if total <= 0:
        return Capacity(0, resident, 0)
    evict = new_blocks + resident - total
    s = blocks.slot_of.get(key)
    if evict <= 0 or s is None:
        return Capacity(total, resident, 0)
    return Capacity(total, resident, blocks.hot_victims(s, evict, prompt))

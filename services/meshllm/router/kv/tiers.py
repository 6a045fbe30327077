"""Lower KV tiers in the router's index: the blocks each slot keeps in host memory or on disk.

An engine with lower tiers (`meshllm.v1.KvTier` HOST, DISK) reports each
tier's block set on its own: a block may be in several tiers at once, and a
removal from one tier leaves the others. `LowerTiers` keeps, per tier and
slot (the device `BlockMap`'s slot numbers), the set of hashes the tier
holds, and for every hash a bitmask of the slots holding it in *some* lower
tier. The mask makes the prefix walk one pass over the prompt for every
candidate at once, as the device walk is; the sets answer which tier a block
comes from, by C-level set operations on the blocks actually found.

`LowerTiers.served` continues each candidate's device prefix: from block
`start` on, a block counts while the candidate holds it in some tier; each
is counted in the nearest tier that holds it — device, then host, then disk
(a device copy beats a host copy of the same block; a tier with a lower
enum value is nearer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

__all__ = ["DeviceBlocks", "LowerTiers", "TierOverlap"]


class DeviceBlocks(Protocol):
    """What the tiers read of the device index (`blocks.BlockMap`, Python or compiled)."""

    def mask(self, h: int) -> int: ...  # the bitmask of the slots holding `h` (0: nobody)

    def holding(self, slot: int, hashes: Iterable[int]) -> set[int]: ...  # those of `hashes` that `slot` holds


class TierOverlap(NamedTuple):
    """What one candidate serves of a prompt beyond its device prefix."""

    device: int  # blocks after the start that the device tier holds (behind a lower-tier block)
    lower: dict[int, int]  # tier value (KV_TIER_HOST, KV_TIER_DISK) -> blocks restored from it


class LowerTiers:
    """Per lower tier and slot, the hashes it holds; per hash, the slots holding it in any lower tier."""

    __slots__ = ("any", "sets")

    def __init__(self) -> None:
        self.sets: dict[int, dict[int, set[int]]] = {}  # tier -> slot -> hashes; nearest tier first
        self.any: dict[int, int] = {}  # hash -> bitmask of slots holding it in some lower tier

    def __bool__(self) -> bool:
        return bool(self.any)

    def add(self, tier: int, slot: int, hashes: Iterable[int]) -> None:
        """`slot` holds `hashes` in `tier` now."""
        by_slot = self.sets.get(tier)
        if by_slot is None:
            by_slot = self.sets[tier] = {}
            self.sets = dict(sorted(self.sets.items()))
        held = by_slot.get(slot)
        if held is None:
            held = by_slot[slot] = set()
        masks, bit = self.any, 1 << slot
        get = masks.get
        for h in hashes:
            held.add(h)
            masks[h] = get(h, 0) | bit
        if not held:
            del by_slot[slot]

    def remove(self, tier: int, slot: int, hashes: Iterable[int]) -> None:
        """`slot` no longer holds `hashes` in `tier` (its other tiers may)."""
        held = self.sets.get(tier, {}).get(slot)
        if not held:
            return
        others = [s for t, by_slot in self.sets.items() if t != tier and (s := by_slot.get(slot))]
        masks, keep = self.any, ~(1 << slot)
        for h in hashes:
            if h in held:
                held.discard(h)
                if not any(h in o for o in others):
                    m = masks[h] & keep
                    if m:
                        masks[h] = m
                    else:
                        del masks[h]

    def clear_slot(self, slot: int) -> int:
        """Drop every lower-tier block of `slot`; returns how many (a block in two tiers counts twice)."""
        n = 0
        masks, keep = self.any, ~(1 << slot)
        for by_slot in self.sets.values():
            held = by_slot.pop(slot, None)
            if not held:
                continue
            n += len(held)
            for h in held:
                m = masks.get(h, 0) & keep
                if m:
                    masks[h] = m
                else:
                    masks.pop(h, None)
        return n

    def count(self, tier: int, slot: int) -> int:
        return len(self.sets.get(tier, {}).get(slot, ()))

    def holds_any(self, slot: int) -> bool:
        return any(by_slot.get(slot) for by_slot in self.sets.values())

    def served(self, hashes: Sequence[int], device: DeviceBlocks, starts: Mapping[int, int]) -> dict[int, TierOverlap]:
        """Per slot of `starts` (slot -> blocks already served), what its tiers serve next (see the module docstring).


        Only slots holding lower-tier blocks are considered, and only those
        that serve at least one more block are in the answer.
        """
        out: dict[int, TierOverlap] = {}
        alive = 0
        for s in starts:
            if self.holds_any(s):
                alive |= 1 << s
        if not alive:
            return out
        # One walk for every slot: where does each one's run through device ∪ lower tiers end?
        dmask, lget = device.mask, self.any.get
        ends: dict[int, int] = {}
        n = len(hashes)
        for i, h in enumerate(hashes):
            gone = alive & ~(dmask(h) | lget(h, 0))
            if gone:
                while gone:
                    low = gone & -gone
                    gone ^= low
                    s = low.bit_length() - 1
                    if i >= starts[s]:  # a block before its start is served already (in flight there)
                        ends[s] = i
                        alive ^= low
                if not alive:
                    break
        while alive:
            low = alive & -alive
            alive ^= low
            ends[low.bit_length() - 1] = n
        for s, end in ends.items():
            start = starts[s]
            if end > start:
                run = hashes[start:end]
                split = self._split(s, run, device.holding(s, run))
                if split.lower:
                    out[s] = split
        return out

    def _split(self, slot: int, run: Sequence[int], on_device: set[int]) -> TierOverlap:
        """Which tier each block of `run` (all held by `slot` somewhere) comes from: nearest first (`on_device`:
        those of `run` the device holds)."""
        tiers = [(t, held) for t, by_slot in self.sets.items() if (held := by_slot.get(slot))]
        dev = len(on_device)
        if not dev and len(tiers) <= 2:  # the usual case, in C: a device prefix, then host and/or disk
            if len(tiers) == 1:
                return TierOverlap(0, {tiers[0][0]: len(run)})
            near = len(tiers[0][1].intersection(run))
            return TierOverlap(0, {t: k for t, k in ((tiers[0][0], near), (tiers[1][0], len(run) - near)) if k})
        lower: dict[int, int] = {}
        dev = 0
        for h in run:
            if h in on_device:
                dev += 1
                continue
            for t, held in tiers:
                if h in held:
                    lower[t] = lower.get(t, 0) + 1
                    break
        return TierOverlap(dev, lower)

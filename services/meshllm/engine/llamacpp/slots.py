"""`SlotTable`: what each llama.cpp sequence slot holds in its KV, prefix matching, and KV events.

A slot is one llama.cpp sequence id with its own KV stream. It is *busy*
while a sequence owns it and *free* otherwise; a free slot keeps its KV as
prefix cache until a new sequence overwrites it. The table knows every slot's
resident tokens, so it can place a new prompt where the longest prefix is
already computed (in place, or copied from another slot) and report cache
changes as KV events: a full block is *stored* when the first slot holds it
and *removed* when the last slot drops it (reference counts by block hash,
hashes from `meshllm.protocol.kv`). The table does no llama.cpp calls; the
scheduler mirrors each change onto the context. `BlockRefs` (the reference
counts behind those events) also serves the lower tiers (`tiers.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshllm.engine.base import KvTier
from meshllm.protocol.kv import stored_blocks

__all__ = ["BlockRefs", "BlocksRemoved", "BlocksStored", "KvEvent", "Placement", "Slot", "SlotTable"]


@dataclass(frozen=True, slots=True)
class BlocksStored:
    blocks: list[tuple[int, int]]  # (block_hash, tokens_hash), chained after `parent_hash`
    parent_hash: int | None
    tier: KvTier = KvTier.DEVICE


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    block_hashes: list[int]
    tier: KvTier = KvTier.DEVICE


KvEvent = BlocksStored | BlocksRemoved


class BlockRefs:
    """Reference counts by block hash in one tier: a block is *stored* on its first reference, *removed* on its last."""

    def __init__(self, tier: KvTier, events: list[KvEvent]) -> None:
        self.tier = tier
        self.events = events  # shared with the owner, drained by it
        self.counts: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.counts)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.counts

    def holders(self, block_hash: int) -> int:
        return self.counts.get(block_hash, 0)

    def ref(self, blocks: list[tuple[int, int]], parent: int | None) -> None:
        """Count new references; report runs of blocks nothing held before."""
        run: list[tuple[int, int]] = []
        run_parent = parent
        for bh, th in blocks:
            count = self.counts.get(bh, 0)
            self.counts[bh] = count + 1
            if count == 0:
                run.append((bh, th))
                continue
            if run:
                self.events.append(BlocksStored(run, run_parent, self.tier))
                run = []
            run_parent = bh
        if run:
            self.events.append(BlocksStored(run, run_parent, self.tier))

    def unref(self, blocks: list[tuple[int, int]]) -> None:
        gone: list[int] = []
        for bh, _ in blocks:
            count = self.counts[bh] - 1
            if count:
                self.counts[bh] = count
            else:
                del self.counts[bh]
                gone.append(bh)
        if gone:
            self.events.append(BlocksRemoved(gone, self.tier))


@dataclass(eq=False)
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)  # resident KV, positions 0..len-1
    blocks: list[tuple[int, int]] = field(default_factory=list)  # full blocks of `tokens`
    busy: bool = False
    used_at: int = 0


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a new sequence goes: `target` keeps its first `reuse` tokens, copied from `source` when given."""

    target: Slot
    reuse: int
    source: Slot | None = None


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] matches, a[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class SlotTable:
    """Every slot's resident tokens and full blocks; pending KV events in `events`."""

    def __init__(self, n_slots: int, block_size: int, *, caching: bool = True) -> None:
        self.slots = [Slot(i) for i in range(n_slots)]
        self.block_size = block_size
        self.caching = caching
        self.events: list[KvEvent] = []
        self._refs = BlockRefs(KvTier.DEVICE, self.events)
        self._clock = 0

    # ------------------------------------------------------------ queries
    def free(self) -> list[Slot]:
        return [s for s in self.slots if not s.busy]

    @property
    def num_cached_blocks(self) -> int:
        """Distinct full blocks resident in any slot."""
        return len(self._refs)

    def holders(self, block_hash: int) -> int:
        """How many slots hold the block `block_hash` (and so its whole prefix)."""
        return self._refs.holders(block_hash)

    def victim(self) -> Slot | None:
        """The free slot a copied or restored prefix overwrites: an empty one, else the least recently used."""
        free = self.free()
        return min(free, key=lambda s: (bool(s.tokens), s.used_at)) if free else None

    def place(self, tokens: list[int], *, min_copy_gain: int) -> Placement | None:
        """Choose a free slot for a prompt (None when every slot is busy).

        The prompt's last token is always recomputed (its logits are needed), so
        at most `len(tokens) - 1` tokens are reused. A free slot holding a prefix
        within `min_copy_gain` tokens of the best is reused in place, when that
        reuses at least as many tokens as it drops from the slot; a longer prefix
        elsewhere (busy slots included) is copied into the least recently used
        free slot, preferring empty ones. So a prompt sharing only a few tokens
        with a slot (a 1-token health-check canary, a new chat sharing only the
        system prompt) goes elsewhere instead of truncating that slot's cached
        prefix.
        """
        free = self.free()
        if not free:
            return None
        limit = len(tokens) - 1 if self.caching else 0
        matches = {s.index: common_prefix(s.tokens, tokens, limit) for s in self.slots} if limit > 0 else {}
        best = max(self.slots, key=lambda s: matches.get(s.index, 0))
        own = max(free, key=lambda s: (matches.get(s.index, 0), -s.used_at))
        best_n, own_n = matches.get(best.index, 0), matches.get(own.index, 0)
        victim = self.victim()
        assert victim is not None
        if best_n - own_n > min_copy_gain:
            return Placement(victim, best_n, best)
        if own is victim or own_n >= len(own.tokens) - own_n:
            return Placement(own, own_n)
        if own_n > min_copy_gain:  # keep own's longer tail: copy the shared prefix instead
            return Placement(victim, own_n, own)
        return Placement(victim, matches.get(victim.index, 0))

    # ------------------------------------------------------------ changes
    def claim(self, slot: Slot) -> None:
        self._clock += 1
        slot.busy, slot.used_at = True, self._clock

    def release(self, slot: Slot) -> None:
        self._clock += 1
        slot.busy, slot.used_at = False, self._clock

    def truncate(self, slot: Slot, n: int) -> None:
        """Keep the first `n` resident tokens of `slot`."""
        if n >= len(slot.tokens):
            return
        del slot.tokens[n:]
        keep = n // self.block_size
        dropped, slot.blocks = slot.blocks[keep:], slot.blocks[:keep]
        self._refs.unref(dropped)

    def extend(self, slot: Slot, tokens: list[int]) -> None:
        """`tokens` entered `slot`'s KV after its resident ones."""
        if not tokens:
            return
        slot.tokens.extend(tokens)
        if not self.caching:
            return
        bs = self.block_size
        start = len(slot.blocks) * bs
        if len(slot.tokens) - start < bs:
            return
        parent = slot.blocks[-1][0] if slot.blocks else None
        new = stored_blocks(slot.tokens[start:], bs, parent_hash=parent)
        slot.blocks.extend(new)
        self._refs.ref(new, parent)

    def copy(self, source: Slot, target: Slot, n: int) -> None:
        """`target` now holds the first `n` tokens of `source` (its own KV replaced)."""
        keep = n // self.block_size
        shared = source.blocks[:keep]
        for bh, _ in shared:
            self._refs.counts[bh] += 1
        old = target.blocks
        target.tokens, target.blocks = source.tokens[:n], list(shared)
        self._refs.unref(old)

    def drain_events(self) -> list[KvEvent]:
        events = list(self.events)
        self.events.clear()  # the list is shared with the reference counts
        return events

"""The mocker's lower KV tiers: host memory and disk, each an LRU of blocks under a byte budget.

Policy (write-back, exclusive): a block enters a lower tier only when the
tier above evicts it — the device cache's LRU victim goes to HOST, HOST's
LRU victim goes to DISK, DISK's is dropped — and leaves it when a prompt
restores it into the device cache ("promotion": the block is *moved* up, so
a block is held in exactly one tier at a time and a budget holds only blocks
no other tier has). Real offload managers (Dynamo's KVBM, vLLM's offloading
connector, SGLang HiCache's default write-through) copy every computed block
down as it is computed, overlapped with compute; for hit rates that equals
this model when a lower tier is much larger than the tier above it (KVBM's
own advice), and the copies cost no simulated time either way. What the
mocker charges is the restore (`timing.restore_seconds`).

Blocks are `TierBlock`s (hash, tokens hash, parent hash) so that the KV
events a tier emits carry the chain the router indexes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

from meshllm.engine.base import EngineSink, KvTier, TierUsage

__all__ = ["LowerTier", "TierBlock", "emit_stored"]


class TierBlock(NamedTuple):
    """A full KV block as a tier keeps it: what its `blocks_stored` event needs."""

    block_hash: int
    tokens_hash: int
    parent_hash: int | None


class LowerTier:
    """One lower tier: at most `capacity_bytes // block_bytes` blocks, least recently stored evicted first."""

    __slots__ = ("_blocks", "block_bytes", "capacity_blocks", "capacity_bytes", "restore_bytes_per_s", "tier")

    def __init__(self, tier: KvTier, capacity_bytes: int, block_bytes: int, restore_bytes_per_s: float) -> None:
        if tier == KvTier.DEVICE:
            raise ValueError("a lower tier is HOST or DISK")
        if block_bytes <= 0 or capacity_bytes < block_bytes:
            raise ValueError(f"a {tier.name} tier of {capacity_bytes} bytes holds no block of {block_bytes} bytes")
        if restore_bytes_per_s <= 0:
            raise ValueError(f"the {tier.name} tier needs a restore bandwidth > 0")
        self.tier = tier
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.capacity_blocks = capacity_bytes // block_bytes
        self.restore_bytes_per_s = restore_bytes_per_s
        self._blocks: OrderedDict[int, TierBlock] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    @property
    def bytes_used(self) -> int:
        return len(self._blocks) * self.block_bytes

    def hashes(self) -> list[int]:
        """Held hashes, next victim first."""
        return list(self._blocks)

    def put(self, blocks: Iterable[TierBlock]) -> list[TierBlock]:
        """Store `blocks` (in order, each the newest); return the evicted ones, oldest first.

        A block that is already held only becomes the newest. A block stored
        and evicted by the same call is returned like any other victim.
        """
        held = self._blocks
        evicted: list[TierBlock] = []
        for block in blocks:
            held[block.block_hash] = block
            held.move_to_end(block.block_hash)
            if len(held) > self.capacity_blocks:
                evicted.append(held.popitem(last=False)[1])
        return evicted

    def take(self, block_hash: int) -> TierBlock | None:
        """Remove and return a block (a promotion into the device cache); None when not held."""
        return self._blocks.pop(block_hash, None)

    def clear(self) -> int:
        dropped = len(self._blocks)
        self._blocks.clear()
        return dropped

    def usage(self) -> TierUsage:
        return TierUsage(
            tier=self.tier,
            blocks=len(self._blocks),
            bytes_used=self.bytes_used,
            bytes_capacity=self.capacity_bytes,
            block_bytes=self.block_bytes,
            restore_bytes_per_s=self.restore_bytes_per_s,
        )


def emit_stored(sink: EngineSink, blocks: list[TierBlock], tier: KvTier) -> None:
    """Report `blocks` stored in `tier` as few `blocks_stored` events as their chains allow.

    An event's blocks must be one chain after its parent. Evictions come
    leaf first (a sequence's tail is released first), so the list is walked
    backwards and a block joins the run when the run's last block is its parent.
    """
    run: list[tuple[int, int]] = []
    parent: int | None = None
    for b in reversed(blocks):
        if run and b.parent_hash == run[-1][0]:
            run.append((b.block_hash, b.tokens_hash))
            continue
        if run:
            sink.blocks_stored(run, parent, tier=tier)
        run, parent = [(b.block_hash, b.tokens_hash)], b.parent_hash
    if run:
        sink.blocks_stored(run, parent, tier=tier)

"""Paged KV cache of the mocker: fixed-size blocks, ref counts, prefix caching, LRU eviction.

A block is in one of three states:

- *in use*: referenced by at least one sequence (or a held prefill result);
- *cached*: unreferenced but registered under its chained block hash, so a
  later prompt with the same prefix can reuse it; evictable, least recently
  released first;
- *free*: unreferenced and unregistered.

A full block is registered (and reported with `EngineSink.blocks_stored`)
when its KV is first computed; reporting happens once per hash, so a block
computed twice by two concurrent identical prompts is reported once and the
second copy stays private. Evicting a cached block reports
`blocks_removed`. Hashes come from `meshllm.protocol.kv`, the function the
router uses, so the router's index matches this cache block for block.

With lower tiers (`tiers.LowerTier`, HOST then DISK) an evicted block is not
lost: it moves down a tier (stored there, removed from the device), and a
prompt's prefix lookup continues past the device blocks into the lower
tiers. `allocate` promotes the lower-tier blocks of a hit back into the
device cache (removed from their tier, stored in DEVICE); the scheduler
charges the restore's simulated time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Sequence_
from typing import NamedTuple

from meshllm.engine.base import EngineSink, KvTier, TierUsage
from meshllm.engine.mocker.sequence import Sequence
from meshllm.engine.mocker.tiers import LowerTier, TierBlock, emit_stored

__all__ = ["Block", "BlockManager", "PrefixHit"]


class Block:
    __slots__ = ("block_hash", "block_id", "parent_hash", "ref_count", "tokens_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.tokens_hash = 0
        self.parent_hash: int | None = None


class PrefixHit(NamedTuple):
    """Leading full blocks of a sequence found in the cache (every tier), how many of them are
    unreferenced device blocks, and how many sit in the HOST and DISK tiers (to be restored)."""

    blocks: int
    unreferenced: int
    host: int = 0
    disk: int = 0

    @property
    def restored(self) -> int:
        """Blocks of the hit that come from a lower tier."""
        return self.host + self.disk

    @property
    def device(self) -> int:
        """Blocks of the hit already in the device cache."""
        return self.blocks - self.host - self.disk


class BlockManager:
    """Allocates KV blocks to sequences; verbs in pairs: `can_allocate`/`allocate`, `can_append`/`append`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        sink: EngineSink,
        *,
        prefix_caching: bool = True,
        watermark_blocks: int = 0,
        tiers: Sequence_[LowerTier] = (),
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.watermark_blocks = watermark_blocks
        self.sink = sink
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, int] = OrderedDict()  # hash -> block id, oldest release first
        self._by_hash: dict[int, int] = {}  # every registered hash -> block id
        self.num_used = 0
        if [t.tier for t in tiers] not in ([], [KvTier.HOST], [KvTier.DISK], [KvTier.HOST, KvTier.DISK]):
            raise ValueError("lower tiers are HOST, DISK or HOST then DISK")
        self.tiers = tuple(tiers) if prefix_caching else ()
        self._host = next((t for t in self.tiers if t.tier == KvTier.HOST), None)
        self._disk = next((t for t in self.tiers if t.tier == KvTier.DISK), None)

    # ------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for prefix reuse."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return self.num_used / self.num_blocks

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def lru_hashes(self) -> list[int]:
        """Evictable hashes, next victim first."""
        return list(self._cached)

    def holder(self, block_hash: int) -> KvTier | None:
        """The nearest tier holding `block_hash` (DEVICE, HOST, DISK), None when no tier does."""
        if block_hash in self._by_hash:
            return KvTier.DEVICE
        return next((t.tier for t in self.tiers if block_hash in t), None)

    def insert_pulled(self, prefix: Sequence_[tuple[int, int]]) -> bool:
        """Cache a prefix pulled from a peer as unreferenced device blocks (most recently used), reported stored.

        `prefix` is a chain of `(block_hash, tokens_hash)` from the first
        block. Blocks already on the device stay as they are. False (nothing
        changed) when the blocks it lacks do not fit beside the watermark.
        """
        missing = [i for i, (bh, _) in enumerate(prefix) if bh not in self._by_hash]
        if not missing:
            return True
        # The prefix's own cached blocks become most recent first, so that the takes below cannot evict them.
        present = [bh for bh, _ in prefix if bh in self._cached]
        if len(missing) > self.num_free - len(present) - self.watermark_blocks or not self.prefix_caching:
            return False
        for bh in present:
            self._cached.move_to_end(bh)
        evicted: list[TierBlock] = []
        run: list[tuple[int, int]] = []
        parent: int | None = None
        for i, (bh, th) in enumerate(prefix):
            if bh in self._by_hash:
                if run:
                    self.sink.blocks_stored(run, parent)
                    run = []
                continue
            bid = self._take(evicted)
            block = self.blocks[bid]
            block.block_hash, block.tokens_hash = bh, th
            block.parent_hash = prefix[i - 1][0] if i else None
            block.ref_count = 0
            self.num_used -= 1
            self._by_hash[bh] = bid
            self._cached[bh] = bid
            if not run:
                parent = block.parent_hash
            run.append((bh, th))
        if run:
            self.sink.blocks_stored(run, parent)
        self._evicted(evicted)
        return True

    def tier_usage(self) -> tuple[TierUsage, ...]:
        """What each lower tier holds, for `LoadMetrics.tiers`."""
        return tuple(t.usage() for t in self.tiers)

    def cached_prefix(self, seq: Sequence, max_tokens: int, *, lower: bool = True) -> PrefixHit:
        """How many leading full blocks of `seq`, covering at most `max_tokens` tokens, are cached.

        The prefix is contiguous: each block is looked up in the device
        cache, then (with `lower`) in HOST and DISK; the first block no tier
        holds ends it.
        """
        if not self.prefix_caching:
            return PrefixHit(0, 0)
        by_hash, blocks = self._by_hash, self.blocks
        host, disk = (self._host, self._disk) if lower else (None, None)
        hit = unreferenced = in_host = in_disk = 0
        for bh, _ in seq.block_hashes[: max_tokens // self.block_size]:
            bid = by_hash.get(bh)
            if bid is not None:
                if blocks[bid].ref_count == 0:
                    unreferenced += 1
            elif host is not None and bh in host:
                in_host += 1
            elif disk is not None and bh in disk:
                in_disk += 1
            else:
                break
            hit += 1
        return PrefixHit(hit, unreferenced, in_host, in_disk)

    # ------------------------------------------------------------ admission
    def can_allocate(self, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Whether a waiting sequence fits: its hit (restored blocks need device blocks) plus
        `num_new_tokens`, keeping the watermark free."""
        needed = -(-(hit.blocks * self.block_size + num_new_tokens) // self.block_size) - hit.device
        return self.num_free - hit.unreferenced - needed >= self.watermark_blocks

    def allocate(self, seq: Sequence, hit: PrefixHit, num_new_tokens: int) -> None:
        """Reference the cached prefix `hit`, restoring its lower-tier blocks into the device cache,
        and add blocks for `num_new_tokens` more tokens."""
        blocks, table, by_hash = self.blocks, seq.block_table, self._by_hash
        prefix = seq.block_hashes[: hit.blocks]
        # Lift the restored blocks out of their tiers first, so evictions below cannot push them further down.
        lifted: dict[int, TierBlock] = {}
        if hit.restored:
            for tier in self.tiers:
                taken = [b for b in (tier.take(bh) for bh, _ in prefix if bh not in by_hash) if b is not None]
                if taken:
                    self.sink.blocks_removed([b.block_hash for b in taken], tier=tier.tier)
                    lifted.update((b.block_hash, b) for b in taken)
        # Reference the device blocks before taking any (a take must not evict a block of this prefix).
        ids: list[int | None] = []
        for bh, _ in prefix:
            bid = by_hash.get(bh)
            ids.append(bid)
            if bid is None:
                continue
            block = blocks[bid]
            if block.ref_count == 0:
                del self._cached[bh]
                self.num_used += 1
            block.ref_count += 1
        evicted: list[TierBlock] = []
        restored: list[tuple[int, int]] = []
        parent: int | None = None
        for (bh, _), bid in zip(prefix, ids, strict=True):
            if bid is None:  # a restored block: a fresh device block, registered as if computed
                b = lifted[bh]
                bid = self._take(evicted)
                block = blocks[bid]
                block.block_hash, block.tokens_hash, block.parent_hash = bh, b.tokens_hash, b.parent_hash
                by_hash[bh] = bid
                if not restored:
                    parent = b.parent_hash
                restored.append((bh, b.tokens_hash))
            elif restored:
                self.sink.blocks_stored(restored, parent)
                restored = []
            table.append(bid)
        if restored:
            self.sink.blocks_stored(restored, parent)
        self._evicted(evicted)
        seq.num_computed = hit.blocks * self.block_size
        seq.num_registered = hit.blocks
        self.append(seq, num_new_tokens)

    # ------------------------------------------------------------ growth
    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether a running sequence can compute `num_new_tokens` more tokens (no watermark)."""
        needed = -(-(seq.num_computed + num_new_tokens) // self.block_size) - len(seq.block_table)
        return needed <= 0 or needed <= self.num_free

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Add blocks so `seq` can hold `num_new_tokens` more tokens (call `can_append` first)."""
        needed = -(-(seq.num_computed + num_new_tokens) // self.block_size) - len(seq.block_table)
        if needed <= 0:
            return
        evicted: list[TierBlock] = []
        table = seq.block_table
        for _ in range(needed):
            table.append(self._take(evicted))
        self._evicted(evicted)

    def register(self, seq: Sequence) -> None:
        """Offer `seq`'s newly computed full blocks to the prefix cache; report the new ones."""
        full = seq.num_computed // self.block_size
        start = seq.num_registered
        if full <= start:
            return
        seq.num_registered = full
        if not self.prefix_caching:
            return
        hashes, table, blocks, by_hash = seq.block_hashes, seq.block_table, self.blocks, self._by_hash
        run: list[tuple[int, int]] = []
        parent: int | None = None
        for i in range(start, full):
            bh, th = hashes[i]
            if bh in by_hash:  # computed meanwhile by another sequence: this copy stays private
                if run:
                    self.sink.blocks_stored(run, parent)
                    run = []
                continue
            block = blocks[table[i]]
            block.block_hash, block.tokens_hash = bh, th
            block.parent_hash = hashes[i - 1][0] if i else None
            by_hash[bh] = block.block_id
            if not run:
                parent = block.parent_hash
            run.append((bh, th))
        if run:
            self.sink.blocks_stored(run, parent)

    # ------------------------------------------------------------ release
    def deallocate(self, seq: Sequence) -> None:
        """Drop `seq`'s references; its registered blocks stay cached, tail first in line for eviction."""
        blocks, cached, free = self.blocks, self._cached, self._free
        for bid in reversed(seq.block_table):
            block = blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.num_used -= 1
                if block.block_hash is not None:
                    cached[block.block_hash] = bid
                else:
                    free.append(bid)
        seq.block_table = []
        seq.reset_progress()

    def clear(self) -> int:
        """Forget every registered hash and every lower tier's blocks; return how many
        unreferenced cached blocks (device and lower tiers) were dropped."""
        dropped = len(self._cached) + sum(t.clear() for t in self.tiers)
        for bid in self._cached.values():
            self._free.append(bid)
        self._cached.clear()
        for bid in self._by_hash.values():
            self.blocks[bid].block_hash = None  # blocks still in use finish as private copies
        self._by_hash.clear()
        self.sink.all_cleared()
        return dropped

    def _take(self, evicted: list[TierBlock]) -> int:
        """A block for a sequence: a free one, else the device LRU victim (which joins `evicted`)."""
        if self._free:
            bid = self._free.pop()
        else:
            bh, bid = self._cached.popitem(last=False)
            del self._by_hash[bh]
            block = self.blocks[bid]
            block.block_hash = None
            evicted.append(TierBlock(bh, block.tokens_hash, block.parent_hash))
        self.blocks[bid].ref_count = 1
        self.num_used += 1
        return bid

    def _evicted(self, evicted: list[TierBlock]) -> None:
        """Report device evictions (victims in order) and move them down the tiers.

        Each tier reports what it stored before what it evicted, so a block
        that passes through a full tier in one go ends up where it is.
        """
        if not evicted:
            return
        moving = evicted
        self.sink.blocks_removed([b.block_hash for b in moving])
        for tier in self.tiers:
            emit_stored(self.sink, moving, tier.tier)
            moving = tier.put(moving)
            if not moving:
                return
            self.sink.blocks_removed([b.block_hash for b in moving], tier=tier.tier)

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
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from meshllm.engine.base import EngineSink
from meshllm.engine.mocker.sequence import Sequence

__all__ = ["Block", "BlockManager", "PrefixHit"]


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None


class PrefixHit(NamedTuple):
    """Leading full blocks of a sequence found in the cache, and how many of them are unreferenced."""

    blocks: int
    unreferenced: int


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

    def cached_prefix(self, seq: Sequence, max_tokens: int) -> PrefixHit:
        """How many leading full blocks of `seq`, covering at most `max_tokens` tokens, are cached."""
        if not self.prefix_caching:
            return PrefixHit(0, 0)
        by_hash, blocks = self._by_hash, self.blocks
        hit = unreferenced = 0
        for bh, _ in seq.block_hashes[: max_tokens // self.block_size]:
            bid = by_hash.get(bh)
            if bid is None:
                break
            hit += 1
            if blocks[bid].ref_count == 0:
                unreferenced += 1
        return PrefixHit(hit, unreferenced)

    # ------------------------------------------------------------ admission
    def can_allocate(self, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Whether a waiting sequence fits: its hit plus `num_new_tokens`, keeping the watermark free."""
        needed = -(-(hit.blocks * self.block_size + num_new_tokens) // self.block_size) - hit.blocks
        return self.num_free - hit.unreferenced - needed >= self.watermark_blocks

    def allocate(self, seq: Sequence, hit: PrefixHit, num_new_tokens: int) -> None:
        """Reference the cached prefix `hit` and add blocks for `num_new_tokens` more tokens."""
        blocks, table = self.blocks, seq.block_table
        for bh, _ in seq.block_hashes[: hit.blocks]:
            block = blocks[self._by_hash[bh]]
            if block.ref_count == 0:
                del self._cached[bh]
                self.num_used += 1
            block.ref_count += 1
            table.append(block.block_id)
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
        evicted: list[int] = []
        table = seq.block_table
        for _ in range(needed):
            table.append(self._take(evicted))
        if evicted:
            self.sink.blocks_removed(evicted)

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
            block.block_hash = bh
            by_hash[bh] = block.block_id
            if not run:
                parent = hashes[i - 1][0] if i else None
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
        """Forget every registered hash; return how many unreferenced cached blocks were dropped."""
        dropped = len(self._cached)
        for bid in self._cached.values():
            self._free.append(bid)
        self._cached.clear()
        for bid in self._by_hash.values():
            self.blocks[bid].block_hash = None  # blocks still in use finish as private copies
        self._by_hash.clear()
        self.sink.all_cleared()
        return dropped

    def _take(self, evicted: list[int]) -> int:
        if self._free:
            bid = self._free.pop()
        else:
            bh, bid = self._cached.popitem(last=False)
            del self._by_hash[bh]
            self.blocks[bid].block_hash = None
            evicted.append(bh)
        self.blocks[bid].ref_count = 1
        self.num_used += 1
        return bid

"""meshllm.engine.mocker.block_manager: paged KV, prefix caching, ref counts, LRU eviction, KV events."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from meshllm.engine.base import LoadMetrics
from meshllm.engine.mocker.block_manager import BlockManager, PrefixHit
from meshllm.engine.mocker.sequence import Sequence
from meshllm.protocol.kv import stored_blocks


class RecordingSink:
    """An EngineSink that records every call."""

    def __init__(self) -> None:
        self.stored: list[tuple[list[tuple[int, int]], int | None]] = []
        self.removed: list[list[int]] = []
        self.cleared = 0

    def blocks_stored(self, blocks: Seq[tuple[int, int]], parent_hash: int | None, dp_rank: int = 0) -> None:
        self.stored.append((list(blocks), parent_hash))

    def blocks_removed(self, block_hashes: Seq[int], dp_rank: int = 0) -> None:
        self.removed.append(list(block_hashes))

    def all_cleared(self, dp_rank: int = 0) -> None:
        self.cleared += 1

    def load(self, metrics: LoadMetrics) -> None:
        pass

    def stored_hashes(self) -> list[int]:
        return [bh for blocks, _ in self.stored for bh, _ in blocks]


BS = 4


def seq(prompt: list[int], *, hashing: bool = True) -> Sequence:
    return Sequence("r", prompt, seed=1, vocab_size=100, block_size=BS, max_tokens=8, hashing=hashing)


def compute_prompt(bm: BlockManager, s: Sequence) -> None:
    """Admit `s` with whatever prefix is cached, then mark its whole prompt computed."""
    hit = bm.cached_prefix(s, s.num_tokens - 1)
    n = s.num_tokens - hit.blocks * BS
    assert bm.can_allocate(hit, n)
    bm.allocate(s, hit, n)
    s.num_computed = s.num_tokens
    bm.register(s)


def test_a_cached_prefix_is_shared_by_reference_and_each_block_reported_once() -> None:
    """Locks: a second identical prompt reuses the first's blocks (ref count 2) and adds no BlocksStored."""
    sink = RecordingSink()
    bm = BlockManager(16, BS, sink)
    prompt = list(range(12))
    a, b = seq(prompt), seq(prompt)
    compute_prompt(bm, a)
    assert sink.stored == [(stored_blocks(prompt, BS), None)]
    hit = bm.cached_prefix(b, b.num_tokens - 1)
    assert hit == PrefixHit(blocks=2, unreferenced=0)  # the last block is recomputed so a token can be sampled
    compute_prompt(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert sink.stored_hashes() == [bh for bh, _ in stored_blocks(prompt, BS)]  # the duplicate stays private
    assert bm.num_used == 4
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_used == 0 and bm.num_cached == 3 and bm.num_free == 16


def test_blocks_stored_carry_the_parent_hash_of_a_continued_prefix() -> None:
    """Locks: blocks computed after a cached prefix are reported chained to that prefix's last block."""
    sink = RecordingSink()
    bm = BlockManager(16, BS, sink)
    compute_prompt(bm, seq(list(range(8))))
    longer = list(range(16))
    compute_prompt(bm, seq(longer))
    expected = stored_blocks(longer, BS)
    assert sink.stored[1] == (expected[2:], expected[1][0])


def test_eviction_takes_least_recently_released_blocks_tail_first_and_reports_them() -> None:
    """Locks: LRU eviction order (a released sequence's tail goes first) and one BlocksRemoved per allocation."""
    sink = RecordingSink()
    bm = BlockManager(6, BS, sink)
    a, b = seq(list(range(8))), seq(list(range(100, 108)))
    for s in (a, b):
        compute_prompt(bm, s)
        bm.deallocate(s)
    ha = [bh for bh, _ in stored_blocks(a.tokens, BS)]
    hb = [bh for bh, _ in stored_blocks(b.tokens, BS)]
    assert bm.lru_hashes() == [ha[1], ha[0], hb[1], hb[0]]
    c = seq(list(range(200, 216)))  # 4 blocks: the 2 free ones, then 2 evictions
    compute_prompt(bm, c)
    assert sink.removed == [[ha[1], ha[0]]]
    assert not bm.is_cached(ha[0]) and bm.is_cached(hb[0])
    assert bm.lru_hashes() == [hb[1], hb[0]]


def test_a_hit_refreshes_recency_so_the_reused_prefix_outlives_older_blocks() -> None:
    """Locks: reusing a cached block moves it to the back of the eviction line when released again."""
    bm = BlockManager(8, BS, RecordingSink())
    a, b = seq(list(range(8))), seq(list(range(100, 108)))
    for s in (a, b):
        compute_prompt(bm, s)
        bm.deallocate(s)
    again = seq(list(range(8)) + [1, 2, 3])  # hits both of a's blocks
    compute_prompt(bm, again)
    bm.deallocate(again)
    ha = [bh for bh, _ in stored_blocks(a.tokens, BS)]
    assert bm.lru_hashes()[-2:] == [ha[1], ha[0]]


def test_watermark_applies_to_admission_but_not_to_running_growth() -> None:
    """Locks: can_allocate keeps `watermark_blocks` free; can_append may use every free block."""
    bm = BlockManager(10, BS, RecordingSink(), watermark_blocks=2)
    assert bm.can_allocate(PrefixHit(0, 0), 8 * BS)
    assert not bm.can_allocate(PrefixHit(0, 0), 8 * BS + 1)
    s = seq(list(range(8 * BS)))
    bm.allocate(s, PrefixHit(0, 0), 8 * BS)
    s.num_computed = 8 * BS
    assert bm.can_append(s, 2 * BS) and not bm.can_append(s, 2 * BS + 1)


def test_clear_drops_unreferenced_cached_blocks_and_forgets_every_hash() -> None:
    """Locks: clear() returns the dropped count, reports AllCleared, and nothing hits afterwards."""
    sink = RecordingSink()
    bm = BlockManager(16, BS, sink)
    done, live = seq(list(range(8))), seq(list(range(50, 58)))
    compute_prompt(bm, done)
    bm.deallocate(done)
    compute_prompt(bm, live)
    assert bm.clear() == 2
    assert sink.cleared == 1 and bm.num_cached == 0
    assert bm.cached_prefix(seq(list(range(50, 58)) + [0]), 8) == PrefixHit(0, 0)
    bm.deallocate(live)  # in-use blocks end as private copies: no stale cache entries
    assert bm.num_cached == 0 and bm.num_free == 16


def test_without_prefix_caching_nothing_hits_and_nothing_is_reported() -> None:
    """Locks: --no-enable-prefix-caching keeps the cache silent (no events the router could misread)."""
    sink = RecordingSink()
    bm = BlockManager(16, BS, sink, prefix_caching=False)
    for _ in range(2):
        s = seq(list(range(12)), hashing=False)
        compute_prompt(bm, s)
        assert s.num_registered == 3
        bm.deallocate(s)
    assert sink.stored == [] and bm.num_cached == 0

"""meshllm.engine.mocker tiers: LRU lower tiers under byte budgets, offload on eviction, restore on a hit, events."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import pytest

from meshllm.engine.base import KvTier, LoadMetrics
from meshllm.engine.mocker.block_manager import BlockManager, PrefixHit
from meshllm.engine.mocker.scheduler import Scheduler
from meshllm.engine.mocker.sequence import Sequence
from meshllm.engine.mocker.tiers import LowerTier, TierBlock
from meshllm.protocol.kv import stored_blocks

BS = 4
BB = 1000  # bytes per block


class TierSink:
    """Records every event and replays it into one block set per tier, as a WorkerSink does."""

    def __init__(self) -> None:
        self.events: list[tuple[str, KvTier, list[int]]] = []
        self.held: dict[KvTier, set[int]] = {t: set() for t in KvTier}
        self.parents: list[tuple[KvTier, list[int], int | None]] = []

    def blocks_stored(
        self, blocks: Seq[tuple[int, int]], parent_hash: int | None, dp_rank: int = 0, tier: KvTier = KvTier.DEVICE
    ) -> None:
        hashes = [bh for bh, _ in blocks]
        self.events.append(("stored", tier, hashes))
        self.parents.append((tier, hashes, parent_hash))
        self.held[tier].update(hashes)

    def blocks_removed(self, block_hashes: Seq[int], dp_rank: int = 0, tier: KvTier = KvTier.DEVICE) -> None:
        self.events.append(("removed", tier, list(block_hashes)))
        self.held[tier].difference_update(block_hashes)

    def all_cleared(self, dp_rank: int = 0) -> None:
        for s in self.held.values():
            s.clear()

    def load(self, metrics: LoadMetrics) -> None:
        pass


def tiers(host_blocks: int, disk_blocks: int) -> list[LowerTier]:
    out = []
    if host_blocks:
        out.append(LowerTier(KvTier.HOST, host_blocks * BB + BB - 1, BB, 25e9))  # a budget that is not a block multiple
    if disk_blocks:
        out.append(LowerTier(KvTier.DISK, disk_blocks * BB, BB, 10e9))
    return out


def seq(prompt: list[int]) -> Sequence:
    return Sequence("r", prompt, seed=1, vocab_size=100, block_size=BS, max_tokens=8)


def run_prompt(bm: BlockManager, prompt: list[int]) -> tuple[Sequence, PrefixHit]:
    """Admit `prompt` (restoring what the tiers hold), compute it, release it."""
    s = seq(prompt)
    hit = bm.cached_prefix(s, s.num_tokens - 1)
    n = s.num_tokens - hit.blocks * BS
    assert bm.can_allocate(hit, n)
    bm.allocate(s, hit, n)
    s.num_computed = s.num_tokens
    bm.register(s)
    bm.deallocate(s)
    return s, hit


def one_block(i: int) -> list[int]:
    return [1000 * (i + 1) + k for k in range(BS)]


def h(prompt: list[int], i: int = 0) -> int:
    return stored_blocks(prompt, BS)[i][0]


def check_consistent(bm: BlockManager, sink: TierSink) -> None:
    """The events replayed equal what the block manager holds, and no tier exceeds its budget."""
    assert sink.held[KvTier.DEVICE] == set(bm._by_hash)
    for t in bm.tiers:
        assert sink.held[t.tier] == set(t.hashes())
        assert t.bytes_used == len(t) * BB <= t.capacity_bytes


def test_a_lower_tier_keeps_its_budget_and_evicts_least_recently_stored_first() -> None:
    """Locks: capacity = budget // block bytes; put past it evicts oldest first; a re-put refreshes; take removes."""
    tier = LowerTier(KvTier.HOST, 3 * BB + BB - 1, BB, 1e9)
    assert tier.capacity_blocks == 3
    blocks = [TierBlock(i, 100 + i, i - 1 if i else None) for i in range(5)]
    assert tier.put(blocks[:3]) == []
    assert tier.put([blocks[0]]) == []  # refreshed: now the newest
    assert tier.hashes() == [1, 2, 0]
    assert tier.put(blocks[3:]) == [blocks[1], blocks[2]]
    assert tier.hashes() == [0, 3, 4] and tier.bytes_used == 3 * BB <= tier.capacity_bytes
    assert tier.take(3) == blocks[3] and tier.take(3) is None and tier.hashes() == [0, 4]
    usage = tier.usage()
    assert (usage.tier, usage.blocks, usage.bytes_used, usage.bytes_capacity, usage.block_bytes) == (
        KvTier.HOST, 2, 2 * BB, 4 * BB - 1, BB,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("capacity", "block_bytes", "bandwidth"), [(BB - 1, BB, 1e9), (BB, 0, 1e9), (BB, BB, 0.0)], ids=["tiny", "no-size", "no-bw"]
)
def test_a_lower_tier_refuses_a_budget_without_room_or_a_bandwidth(capacity: int, block_bytes: int, bandwidth: float) -> None:
    with pytest.raises(ValueError):
        LowerTier(KvTier.HOST, capacity, block_bytes, bandwidth)


def test_device_evictions_cascade_host_then_disk_then_drop_within_every_budget() -> None:
    """Locks: device LRU victim -> HOST, HOST victim -> DISK, DISK victim dropped; every move reported; budgets hold."""
    sink = TierSink()
    bm = BlockManager(4, BS, sink, tiers=tiers(2, 2))
    prompts = [one_block(i) for i in range(10)]
    for p in prompts:
        run_prompt(bm, p)
        check_consistent(bm, sink)
    hashes = [h(p) for p in prompts]
    assert set(bm._by_hash) == set(hashes[6:])
    assert bm.tiers[0].hashes() == hashes[4:6]  # HOST, next victim first
    assert bm.tiers[1].hashes() == hashes[2:4]  # DISK
    # P0 went device -> host -> disk -> gone, each step reported in order.
    trail = [(kind, tier) for kind, tier, hs in sink.events if hashes[0] in hs]
    assert trail == [
        ("stored", KvTier.DEVICE), ("removed", KvTier.DEVICE), ("stored", KvTier.HOST),
        ("removed", KvTier.HOST), ("stored", KvTier.DISK), ("removed", KvTier.DISK),
    ]  # fmt: skip


def test_without_tiers_evictions_are_only_removed_from_the_device() -> None:
    sink = TierSink()
    bm = BlockManager(2, BS, sink)
    for i in range(4):
        run_prompt(bm, one_block(i))
    assert {tier for _, tier, _ in sink.events} == {KvTier.DEVICE} and bm.tier_usage() == ()


def test_a_hit_in_a_lower_tier_is_restored_into_the_device_and_leaves_the_tier() -> None:
    """Locks: the prefix lookup reaches into DISK; allocate promotes the block (removed DISK, stored DEVICE)."""
    sink = TierSink()
    bm = BlockManager(4, BS, sink, tiers=tiers(2, 2))
    prompts = [one_block(i) for i in range(10)]
    for p in prompts:
        run_prompt(bm, p)
    target = prompts[2]  # on disk
    assert h(target) in bm.tiers[1]
    sink.events.clear()
    s, hit = run_prompt(bm, [*target, 7])
    assert hit == PrefixHit(1, 0, host=0, disk=1) and hit.restored == 1 and hit.device == 0
    assert s.num_cached_tokens == -1  # (set by the scheduler, not the block manager)
    assert sink.events[:2] == [("removed", KvTier.DISK, [h(target)]), ("stored", KvTier.DEVICE, [h(target)])]
    assert h(target) in bm._by_hash and h(target) not in bm.tiers[1]
    check_consistent(bm, sink)


def test_a_prefix_runs_from_device_into_host_and_disk_blocks_and_stops_at_a_miss() -> None:
    """Locks: contiguous prefix across tiers; restored blocks are re-announced as one chain after the device part."""
    sink = TierSink()
    bm = BlockManager(5, BS, sink, tiers=tiers(2, 4))
    long = list(range(1, 4 * BS + 1))  # 4 blocks
    run_prompt(bm, long)
    # 1-block prompts fill the free block, then evict the long prompt's tail first: block 3, then 2 go to
    # HOST; then block 1 goes to HOST and pushes block 3 on to DISK.
    for i in range(4):
        run_prompt(bm, one_block(i))
    ids = [h(long, i) for i in range(4)]
    assert ids[0] in bm._by_hash and bm.tiers[0].hashes() == [ids[2], ids[1]] and bm.tiers[1].hashes() == [ids[3]]
    sink.parents.clear()
    s = seq([*long, 99])
    hit = bm.cached_prefix(s, s.num_tokens - 1)
    assert hit == PrefixHit(4, 1, host=2, disk=1)
    assert bm.cached_prefix(s, s.num_tokens - 1, lower=False) == PrefixHit(1, 1)
    assert bm.can_allocate(hit, 1)
    bm.allocate(s, hit, 1)
    assert len(s.block_table) == 5 and s.num_computed == 4 * BS
    restored = [(hs, parent) for tier, hs, parent in sink.parents if tier == KvTier.DEVICE]
    assert restored == [(ids[1:], ids[0])]
    check_consistent(bm, sink)
    # A miss in the middle ends the prefix: a block never computed (another prompt) stops it at block 0.
    other = seq([*long[:BS], 5, 5, 5, 5, *long[2 * BS :]])
    assert bm.cached_prefix(other, other.num_tokens - 1).blocks == 1


def test_can_allocate_counts_restored_blocks_as_needing_device_room() -> None:
    """Locks: a hit from a lower tier needs fresh device blocks; with every device block in use it does not fit."""
    sink = TierSink()
    bm = BlockManager(2, BS, sink, tiers=tiers(4, 0))
    run_prompt(bm, one_block(0))
    run_prompt(bm, one_block(1))
    run_prompt(bm, one_block(2))  # block of prompt 0 -> HOST
    hogs = [seq(one_block(5)), seq(one_block(6))]
    for hog in hogs:  # every device block referenced
        bm.allocate(hog, PrefixHit(0, 0), BS)
    s = seq([*one_block(0), 1])
    hit = bm.cached_prefix(s, s.num_tokens - 1)
    assert hit == PrefixHit(1, 0, host=1) and not bm.can_allocate(hit, 1)


def test_clear_drops_every_tier() -> None:
    sink = TierSink()
    bm = BlockManager(2, BS, sink, tiers=tiers(2, 2))
    for i in range(6):
        run_prompt(bm, one_block(i))
    assert bm.clear() == 6 and all(len(t) == 0 for t in bm.tiers)
    check_consistent(bm, sink)


def test_a_restoring_sequence_waits_for_its_restore_then_prefills_the_rest() -> None:
    """Locks: the scheduler admits a lower-tier hit as cached, plans nothing for it until restore_time has
    passed, then computes only the uncached tail; stats count the hit per tier."""
    sink = TierSink()
    bm = BlockManager(4, BS, sink, tiers=tiers(4, 0))
    for i in range(6):
        run_prompt(bm, one_block(i))
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, restore_time=lambda hit: 2.0 * hit.restored)
    s = seq([*one_block(0), 1, 2])
    sched.add(s)
    plan = sched.schedule(now=10.0)
    assert plan.seqs == [] and s.restoring and s.ready_at == 12.0 and s.num_cached_tokens == BS
    assert sched.next_ready_at() == 12.0
    assert sched.schedule(now=11.9).seqs == []
    plan = sched.schedule(now=12.0)
    assert plan.seqs == [s] and plan.counts == [2] and plan.prefill_tokens == 2 and not s.restoring
    st = sched.stats
    assert (st.prompt_tokens, st.device_hit_tokens, st.host_hit_tokens, st.disk_hit_tokens, st.prefill_tokens) == (
        BS + 2, 0, BS, 0, 2,
    )  # fmt: skip
    assert st.cached_tokens == BS

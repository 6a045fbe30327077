"""Lower KV tiers (host, disk) in the router: the index, the restore cost, the kv cost terms.

Locks: lower-tier events and snapshots' `lower_tiers` fill a per-tier set per
(worker, dp rank) and never make a block device-resident; removal from one
tier keeps the others; "cleared" and a snapshot empty every tier; the prefix
a candidate serves continues from its device blocks through its lower
tiers, a device copy beating a host copy and host beating disk; the restore
ratio is the advertised restore time over the measured prefill time, or the
tier's default; and with small numbers: a lower-tier prefix beats a miss, a
device hit beats the lower tier, a restore slower than computing loses to a
miss, and evicting a reused block costs a restore on a worker that keeps
evicted blocks in a lower tier.
"""

from __future__ import annotations

import random

import pytest

from meshllm.router.config import RouterMode
from meshllm.router.kv.index import KvIndex, TierOverlap
from meshllm.router.policy.choice import REUSED_EVICT_COST, Candidate, make_policy, score
from meshllm.router.policy.timing import DEFAULT_RESTORE_RATIO, RestoreCost, evict_ratio, restore_cost, restore_costs
from meshllm.v1 import events_pb2, worker_pb2

HOST, DISK = events_pb2.KV_TIER_HOST, events_pb2.KV_TIER_DISK


def stored(event_id: int, hashes: list[int], tier: int = 0) -> events_pb2.KvEvent:
    ev = events_pb2.KvEvent(event_id=event_id)
    ev.stored.blocks.extend(events_pb2.StoredBlock(block_hash=h, tokens_hash=h) for h in hashes)
    ev.stored.tier = tier  # type: ignore[assignment]
    return ev


def removed(event_id: int, hashes: list[int], tier: int = 0) -> events_pb2.KvEvent:
    return events_pb2.KvEvent(event_id=event_id, removed=events_pb2.BlocksRemoved(block_hashes=hashes, tier=tier))  # type: ignore[arg-type]


def batch(worker: str, *events: events_pb2.KvEvent, dp: int = 0) -> events_pb2.KvEventBatch:
    return events_pb2.KvEventBatch(worker_id=worker, dp_rank=dp, events=events)


def snapshot(worker: str, last: int, device: list[int], lower: dict[int, list[int]], dp: int = 0) -> worker_pb2.KvSnapshot:
    snap = worker_pb2.KvSnapshot(worker_id=worker, last_event_id=last)
    rank = snap.ranks.add(dp_rank=dp, blocks=[events_pb2.StoredBlock(block_hash=h) for h in device])
    for tier, hashes in lower.items():
        rank.lower_tiers.add(tier=tier, blocks=[events_pb2.StoredBlock(block_hash=h) for h in hashes])  # type: ignore[arg-type]
    return snap


def synced(*workers: str) -> KvIndex:
    index = KvIndex()
    for w in workers:
        index.add_worker(w)
        index.apply_snapshot(worker_pb2.KvSnapshot(worker_id=w))
    return index


def served(index: KvIndex, prompt: list[int], keys: list[tuple[str, int]]) -> dict[tuple[str, int], tuple[int, dict[int, int]]]:
    """Per candidate: (device blocks, lower tier -> blocks) of the prefix it serves, as the router composes them."""
    device = index.overlaps(prompt, keys)
    tiers = index.tier_overlaps(prompt, keys, device)
    out = {}
    for k in keys:
        t = tiers.get(k, TierOverlap(0, {}))
        if device.get(k, 0) + t.device or t.lower:
            out[k] = (device.get(k, 0) + t.device, t.lower)
    return out


# ---------------------------------------------------------------- the index


def test_the_served_prefix_is_device_blocks_then_lower_tier_blocks_and_stops_at_the_first_miss() -> None:
    index = synced("a", "b")
    index.apply_batch(batch("a", stored(1, [1, 2]), stored(2, [3, 4], HOST), stored(3, [5], DISK), stored(4, [7], HOST)))
    index.apply_batch(batch("b", stored(1, [1, 2, 3, 4, 5])))
    keys = [("a", 0), ("b", 0)]
    assert served(index, [1, 2, 3, 4, 5, 6, 7], keys) == {("a", 0): (2, {HOST: 2, DISK: 1}), ("b", 0): (5, {})}
    assert index.overlaps([1, 2, 3], keys) == {("a", 0): 2, ("b", 0): 3}  # the device walk is unchanged
    # a prompt held only in a lower tier: no device blocks, all restored
    assert served(index, [3, 4], [("a", 0)]) == {("a", 0): (0, {HOST: 2})}
    assert index.lower_blocks("a", HOST) == 3 and index.lower_blocks("a", DISK) == 1 and index.lower_blocks("b", HOST) == 0


def test_a_device_copy_beats_a_host_copy_and_host_beats_disk() -> None:
    index = synced("a")
    # block 1 in device and host; 2 in host and disk; 3 on disk only; 4 on device again behind them
    index.apply_batch(batch("a", stored(1, [1, 4]), stored(2, [1, 2], HOST), stored(3, [2, 3], DISK)))
    assert served(index, [1, 2, 3, 4], [("a", 0)]) == {("a", 0): (2, {HOST: 1, DISK: 1})}
    # the walk of the lower tiers starts where the device prefix ends (or where in-flight prompts end)
    assert index.tier_overlaps([1, 2, 3, 4], [("a", 0)], {("a", 0): 3}) == {}
    assert index.tier_overlaps([1, 2, 3, 4], [("a", 0)], {("a", 0): 2}) == {("a", 0): TierOverlap(1, {DISK: 1})}


def test_removal_from_one_tier_keeps_the_others() -> None:
    index = synced("a")
    index.apply_batch(batch("a", stored(1, [1, 2]), stored(2, [1, 2], HOST), stored(3, [2], DISK)))
    index.apply_batch(batch("a", removed(4, [1, 2])))  # evicted from the device: host (and disk) keep them
    assert served(index, [1, 2], [("a", 0)]) == {("a", 0): (0, {HOST: 2})}
    index.apply_batch(batch("a", removed(5, [2], HOST)))  # the host copy of 2 left; disk still has it
    assert served(index, [1, 2], [("a", 0)]) == {("a", 0): (0, {HOST: 1, DISK: 1})}
    index.apply_batch(batch("a", removed(6, [1], DISK)))  # disk never held 1: nothing changes
    assert served(index, [1, 2], [("a", 0)]) == {("a", 0): (0, {HOST: 1, DISK: 1})}
    index.apply_batch(batch("a", stored(7, [1, 2])))  # restored into the device: device blocks again
    assert served(index, [1, 2], [("a", 0)]) == {("a", 0): (2, {})}
    assert index.applied == 2 + 2 + 1 + 2 + 1 + 1 + 2


def test_cleared_empties_every_tier_and_a_removed_worker_leaves_no_lower_blocks_for_the_next_slot() -> None:
    index = synced("a", "b")
    index.apply_batch(batch("a", stored(1, [1]), stored(2, [1, 2], HOST), stored(3, [3], DISK)))
    index.apply_batch(batch("a", events_pb2.KvEvent(event_id=4, cleared=events_pb2.AllCleared())))
    assert served(index, [1, 2, 3], [("a", 0)]) == {}
    index.apply_batch(batch("b", stored(1, [5, 6], HOST)))
    index.remove_worker("b")
    index.add_worker("c")  # takes b's freed slot
    index.apply_snapshot(worker_pb2.KvSnapshot(worker_id="c"))
    assert served(index, [5, 6], [("c", 0)]) == {} and index.lower_blocks("c", HOST) == 0


def test_a_snapshot_with_lower_tiers_repairs_the_index() -> None:
    index = synced("a")
    index.apply_batch(batch("a", stored(1, [1, 2], HOST), stored(2, [9], DISK)))
    # events 3 and 4 are lost; 5 reveals the gap
    assert index.apply_batch(batch("a", stored(5, [7], HOST)))
    assert index.syncing("a")
    # the worker's snapshot at event 4: 1 on the device, 1-2 in host, 2-3 on disk, 9 gone; then 5 is replayed
    assert not index.apply_snapshot(snapshot("a", 4, [1], {HOST: [1, 2], DISK: [2, 3]}))
    assert served(index, [1, 2, 3, 4], [("a", 0)]) == {("a", 0): (1, {HOST: 1, DISK: 1})}
    assert served(index, [9], [("a", 0)]) == {} and served(index, [7], [("a", 0)]) == {("a", 0): (0, {HOST: 1})}
    assert index.lower_blocks("a", HOST) == 3 and index.lower_blocks("a", DISK) == 2


def test_lower_tiers_of_dp_ranks_are_separate() -> None:
    index = synced("a")
    index.apply_batch(batch("a", stored(1, [1, 2], HOST), dp=1))
    assert served(index, [1, 2], [("a", 0), ("a", 1)]) == {("a", 1): (0, {HOST: 2})}


# ---------------------------------------------------------------- restore cost


def usage(tier: int, block_bytes: int, bytes_per_s: float, capacity: int = 1 << 30) -> events_pb2.KvTierUsage:
    return events_pb2.KvTierUsage(
        tier=tier,
        block_bytes=block_bytes,
        restore_bytes_per_s=bytes_per_s,
        bytes_capacity=capacity,  # type: ignore[arg-type]
    )


def test_the_restore_ratio_is_the_advertised_restore_time_over_the_measured_prefill_time() -> None:
    # 2 MB blocks at 1 GB/s: 2 ms per block; a prefill block takes 8 ms
    c = restore_cost(HOST, usage(HOST, 2_000_000, 1e9), block_ms=8.0)
    assert c.ms_per_block == pytest.approx(2.0) and c.ratio == pytest.approx(0.25)
    # the prefill time not measured yet, or nothing advertised: the tier's default
    assert restore_cost(HOST, usage(HOST, 2_000_000, 1e9), block_ms=0.0).ratio == DEFAULT_RESTORE_RATIO[HOST]
    assert restore_cost(DISK, None, block_ms=8.0) == restore_cost(DISK, usage(DISK, 0, 0.0), 8.0)
    assert restore_cost(DISK, None, block_ms=8.0).ratio == DEFAULT_RESTORE_RATIO[DISK] > DEFAULT_RESTORE_RATIO[HOST]
    both = restore_costs([DISK, HOST], [usage(HOST, 1000, 1e6)], block_ms=4.0)
    assert [(r.tier, r.ratio) for r in both] == [(DISK, DEFAULT_RESTORE_RATIO[DISK]), (HOST, pytest.approx(0.25))]


def test_the_evict_ratio_is_the_nearest_lower_tiers_restore_ratio_at_most_one() -> None:
    assert evict_ratio([], 8.0) == 1.0
    assert evict_ratio([usage(DISK, 2_000_000, 1e9), usage(HOST, 2_000_000, 4e9)], 8.0) == pytest.approx(0.0625)
    assert evict_ratio([usage(HOST, 2_000_000, 1e6)], 8.0) == 1.0  # slower than computing: a recompute at most
    assert evict_ratio([usage(HOST, 2_000_000, 1e9, capacity=0)], 8.0) == 1.0  # no budget: nothing is kept


# ---------------------------------------------------------------- the kv cost


def cand(worker: str, *, device: int, lower: dict[int, int], prompt_blocks: int, ratios: dict[int, float]) -> Candidate:
    served_blocks = device + sum(lower.values())
    return Candidate(
        worker_id=worker, dp_rank=0, address=f"{worker}:1", overlap_blocks=device,
        prefill_tokens=(prompt_blocks - served_blocks) * 16, decode_blocks=prompt_blocks - device,
        new_blocks=prompt_blocks - device, lower_blocks=lower,
        restore=[RestoreCost(t, 0.0, ratios.get(t, DEFAULT_RESTORE_RATIO[t])) for t in lower],
    )  # fmt: skip


def pick(cs: list[Candidate], **weights: float) -> str:
    score(cs, block_size=16, overlap_weight=weights.get("overlap", 1.0), capacity_weight=weights.get("capacity", 1.0))
    return make_policy(RouterMode.KV, temperature=0, rng=random.Random(0)).pick(cs, "m").worker_id


def test_a_prefix_held_in_a_lower_tier_beats_a_miss() -> None:
    # 40-block prompt: a holds it in host memory (restore ratio 0.1), b holds nothing
    a = cand("a", device=0, lower={HOST: 40}, prompt_blocks=40, ratios={})
    b = cand("b", device=0, lower={}, prompt_blocks=40, ratios={})
    assert pick([a, b]) == "a"
    assert a.restore_blocks == pytest.approx(4.0) and a.cost == pytest.approx(0 + 4.0 + 40)
    assert b.restore_blocks == 0 and b.cost == pytest.approx(40 + 40)


def test_a_device_hit_beats_the_same_prefix_in_a_lower_tier() -> None:
    a = cand("a", device=0, lower={HOST: 30, DISK: 10}, prompt_blocks=40, ratios={})
    b = cand("b", device=40, lower={}, prompt_blocks=40, ratios={})
    assert pick([a, b]) == "b"
    assert a.restore_blocks == pytest.approx(30 * 0.1 + 10 * 0.3)
    # and a device hit of part of the prefix plus host for the rest beats host for all of it
    c = cand("c", device=20, lower={HOST: 20}, prompt_blocks=40, ratios={})
    assert pick([a, c]) == "c"


def test_a_restore_slower_than_computing_makes_the_lower_tier_not_worth_it() -> None:
    # a's disk restores a block in 3 prefill blocks' time (ratio 3): computing the prompt on b is cheaper
    a = cand("a", device=0, lower={DISK: 40}, prompt_blocks=40, ratios={DISK: 3.0})
    b = cand("b", device=0, lower={}, prompt_blocks=40, ratios={})
    assert pick([a, b]) == "b"
    assert a.cost == pytest.approx(120 + 40) and b.cost == pytest.approx(40 + 40)
    a.restore[0] = RestoreCost(DISK, 0.0, 0.5)  # a fast disk: worth it again
    assert pick([a, b]) == "a"


def test_restored_blocks_need_device_room() -> None:
    # both caches are full of reused blocks; a holds the 40-block prompt in host and must evict 40 to restore it,
    # b holds nothing and must evict as many: the host copy saves the prefill, not the eviction
    a = cand("a", device=0, lower={HOST: 40}, prompt_blocks=40, ratios={})
    b = cand("b", device=0, lower={}, prompt_blocks=40, ratios={})
    for c in (a, b):
        c.cached_blocks, c.total_blocks, c.evicted_hot_blocks = 100, 100, 40
    assert pick([a, b]) == "a"
    assert a.new_blocks == 40 and a.cost == pytest.approx(4.0 + 40 + (40 + REUSED_EVICT_COST * 40))


def test_evicting_reused_blocks_costs_a_restore_on_a_worker_that_keeps_evicted_blocks() -> None:
    # equally full caches; each must evict 20 reused blocks to take the new prompt; b keeps what it evicts in host
    a = cand("a", device=0, lower={}, prompt_blocks=40, ratios={})
    b = cand("b", device=0, lower={}, prompt_blocks=40, ratios={})
    for c in (a, b):
        c.cached_blocks, c.total_blocks, c.evicted_hot_blocks = 80, 100, 20
    b.evict_ratio = 0.1
    assert pick([a, b]) == "b"
    assert a.cost - b.cost == pytest.approx(REUSED_EVICT_COST * 20 * 0.9)


def reference(prompt: list[int], start: int, device: set[int], tiers: dict[int, set[int]]) -> tuple[int, dict[int, int]] | None:
    """The served run after `start`, block by block: device first, then tiers nearest first."""
    dev, lower = 0, {}
    for h in prompt[start:]:
        if h in device:
            dev += 1
            continue
        t = next((t for t in sorted(tiers) if h in tiers[t]), None)
        if t is None:
            break
        lower[t] = lower.get(t, 0) + 1
    return (dev, lower) if lower else None


def test_the_tier_walk_agrees_with_a_block_by_block_reference() -> None:
    rng = random.Random(18)
    for trial in range(300):
        index = synced("a", "b", "c")
        state = {w: (set(), {HOST: set(), DISK: set(), 3: set()}) for w in "abc"}
        ids = dict.fromkeys("abc", 0)
        tiers_used = [HOST, DISK, 3] if trial % 5 == 0 else [HOST, DISK]  # now and then a tier this router does not know
        for _ in range(rng.randrange(1, 12)):
            w = rng.choice("abc")
            tier = rng.choice([0, *tiers_used])
            hashes = rng.sample(range(1, 25), rng.randrange(1, 8))
            ids[w] += 1
            if rng.random() < 0.7:
                index.apply_batch(batch(w, stored(ids[w], hashes, tier)))
                (state[w][0] if tier == 0 else state[w][1][tier]).update(hashes)
            else:
                index.apply_batch(batch(w, removed(ids[w], hashes, tier)))
                (state[w][0] if tier == 0 else state[w][1][tier]).difference_update(hashes)
        prompt = list(range(1, 25))
        keys = [(w, 0) for w in "abc"]
        device = index.overlaps(prompt, keys)
        starts = {k: device.get(k, 0) + rng.choice([0, 0, 0, 2]) for k in keys}  # sometimes in flight beyond it
        got = index.tier_overlaps(prompt, keys, starts)
        for w in "abc":
            ref = reference(prompt, starts[(w, 0)], state[w][0], state[w][1])
            assert (tuple(got[(w, 0)]) if (w, 0) in got else None) == ref, (trial, w)
        for w in "abc":
            assert index.lower_blocks(w, HOST) == len(state[w][1][HOST])
        # every hash in the any-tier mask is held by the slots it names, and only those
        for h, m in index.lower.any.items():
            holders = {w for w in "abc" if any(h in s for s in state[w][1].values())}
            slots = {w: index.map.slot_of.get((w, 0), -1) for w in "abc"}
            assert {w for w in "abc" if slots[w] >= 0 and m >> slots[w] & 1} == holders

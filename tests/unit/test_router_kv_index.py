"""The router's KV index: events in, overlaps out; gaps, new workers and removals.

Locks: stored/removed/cleared events change what each (worker, dp rank)
holds; the overlap of a prompt is its leading cached blocks and stops at the
first miss; a gap in event ids or a new worker buffers events until a
snapshot, after which only events newer than the snapshot are replayed; a
removed worker leaves the index at once.
"""

from __future__ import annotations

from meshllm.protocol.kv import block_hashes
from meshllm.router.kv.blocks import BlockMap, PyBlockMap
from meshllm.router.kv.capacity import Capacity
from meshllm.router.kv.index import KvIndex
from meshllm.v1 import events_pb2, worker_pb2


def stored(event_id: int, hashes: list[int], parent: int | None = None, *, packed: bool = True) -> events_pb2.KvEvent:
    """A stored event as workers publish it (packed hashes), or as workers before 2026-11-29 evening did."""
    ev = events_pb2.KvEvent(event_id=event_id)
    if packed:
        ev.stored.block_hashes.extend(hashes)
        ev.stored.tokens_hashes.extend(hashes)
    else:
        ev.stored.blocks.extend(events_pb2.StoredBlock(block_hash=h, tokens_hash=h) for h in hashes)
    if parent is not None:
        ev.stored.parent_hash = parent
    return ev


def removed(event_id: int, hashes: list[int]) -> events_pb2.KvEvent:
    return events_pb2.KvEvent(event_id=event_id, removed=events_pb2.BlocksRemoved(block_hashes=hashes))


def cleared(event_id: int) -> events_pb2.KvEvent:
    return events_pb2.KvEvent(event_id=event_id, cleared=events_pb2.AllCleared())


def batch(worker: str, *events: events_pb2.KvEvent, dp: int = 0) -> events_pb2.KvEventBatch:
    return events_pb2.KvEventBatch(worker_id=worker, dp_rank=dp, events=events)


def snapshot(worker: str, last: int, blocks: dict[int, list[int]]) -> worker_pb2.KvSnapshot:
    snap = worker_pb2.KvSnapshot(worker_id=worker, last_event_id=last)
    for dp, hashes in blocks.items():
        snap.ranks.add(dp_rank=dp, blocks=[events_pb2.StoredBlock(block_hash=h) for h in hashes])
    return snap


def synced_index(*workers: str) -> KvIndex:
    index = KvIndex()
    for w in workers:
        assert index.add_worker(w)
        assert not index.apply_snapshot(snapshot(w, 0, {}))
    return index


def test_stored_blocks_give_a_prefix_overlap_that_stops_at_the_first_miss() -> None:
    index = synced_index("a", "b")
    index.apply_batch(batch("a", stored(1, [1, 2, 3, 4])))
    index.apply_batch(batch("b", stored(1, [1, 2]), stored(2, [9])))
    prompt = [1, 2, 3, 4, 5]
    assert index.overlaps(prompt, [("a", 0), ("b", 0)]) == {("a", 0): 4, ("b", 0): 2}
    # b holds 9 but not at the prompt's position 2: the walk stopped before it
    assert index.overlaps([1, 2, 9], [("a", 0)]) == {("a", 0): 2}
    assert index.overlaps([7, 1, 2], [("a", 0), ("b", 0)]) == {}
    assert index.applied == 7


def test_removed_and_cleared_events_drop_blocks() -> None:
    index = synced_index("a")
    index.apply_batch(batch("a", stored(1, [1, 2, 3]), removed(2, [2])))
    assert index.overlaps([1, 2, 3], [("a", 0)]) == {("a", 0): 1}
    index.apply_batch(batch("a", cleared(3)))
    assert index.overlaps([1], [("a", 0)]) == {}
    assert index.worker_blocks("a") == 0 and index.size == 0


def test_dp_ranks_are_separate_slots() -> None:
    index = synced_index("a")
    index.apply_batch(batch("a", stored(1, [1, 2]), dp=0))
    index.apply_batch(batch("a", stored(2, [1]), dp=1))
    assert index.overlaps([1, 2], [("a", 0), ("a", 1)]) == {("a", 0): 2, ("a", 1): 1}
    assert index.worker_blocks("a") == 3


def test_a_new_worker_buffers_events_until_its_snapshot_then_replays_only_newer_ones() -> None:
    index = KvIndex()
    assert index.add_worker("a") is True
    assert index.add_worker("a") is False
    assert index.syncing("a")
    # events 5..7 arrive while the snapshot (taken at event 6) is in flight
    index.apply_batch(batch("a", stored(5, [10]), stored(6, [11])))
    index.apply_batch(batch("a", stored(7, [12])))
    assert index.overlaps([1], [("a", 0)]) == {}
    again = index.apply_snapshot(snapshot("a", 6, {0: [1, 2, 10, 11]}))
    assert again is False and not index.syncing("a")
    assert index.last_event_id("a") == 7
    assert index.overlaps([1, 2], [("a", 0)]) == {("a", 0): 2}
    assert index.overlaps([12], [("a", 0)]) == {("a", 0): 1}


def test_an_event_id_gap_asks_for_a_resync_and_the_snapshot_repairs_the_index() -> None:
    index = synced_index("a")
    assert index.apply_batch(batch("a", stored(1, [1]))) is False
    assert index.apply_batch(batch("a", stored(3, [3]))) is True  # event 2 was lost
    assert index.syncing("a")
    assert index.apply_batch(batch("a", stored(4, [4]))) is False  # buffered, no second request
    assert index.overlaps([3], [("a", 0)]) == {}
    assert index.apply_snapshot(snapshot("a", 3, {0: [1, 2, 3]})) is False
    assert index.overlaps([1, 2, 3], [("a", 0)]) == {("a", 0): 3}
    assert index.overlaps([4], [("a", 0)]) == {("a", 0): 1}
    assert index.last_event_id("a") == 4


def test_a_gap_inside_the_replayed_buffer_asks_for_another_snapshot() -> None:
    index = KvIndex()
    index.add_worker("a")
    index.apply_batch(batch("a", stored(5, [5])))
    index.apply_batch(batch("a", stored(8, [8])))
    assert index.apply_snapshot(snapshot("a", 4, {0: [4]})) is True
    assert index.syncing("a")


def test_a_restarted_worker_whose_ids_start_over_is_resynced() -> None:
    index = synced_index("a")
    index.apply_batch(batch("a", stored(1, [1]), stored(2, [2])))
    assert index.apply_batch(batch("a", stored(1, [7]))) is True


def test_removing_a_worker_drops_its_blocks_at_once_and_frees_its_slot() -> None:
    index = synced_index("a", "b")
    index.apply_batch(batch("a", stored(1, [1, 2])))
    index.apply_batch(batch("b", stored(1, [1])))
    index.remove_worker("a")
    assert "a" not in index
    assert index.overlaps([1, 2], [("a", 0), ("b", 0)]) == {("b", 0): 1}
    assert index.size == 1
    # a worker that reuses the freed slot starts empty
    index.add_worker("c")
    index.apply_snapshot(snapshot("c", 0, {0: [9]}))
    assert index.overlaps([1, 2], [("c", 0)]) == {}
    assert index.overlaps([9], [("c", 0), ("b", 0)]) == {("c", 0): 1}


def test_events_of_unknown_workers_are_dropped() -> None:
    index = KvIndex()
    assert index.apply_batch(batch("ghost", stored(1, [1]))) is False
    assert index.dropped_unknown == 1 and index.size == 0


def test_overlap_with_real_block_hashes_of_shared_prefixes() -> None:
    bs = 4
    prefix = list(range(100, 116))  # 4 blocks
    a_prompt = [*prefix, 1, 2, 3, 4]
    b_prompt = [*prefix[:8], 9, 9, 9, 9]
    index = synced_index("a", "b")
    index.apply_batch(batch("a", stored(1, block_hashes(a_prompt, bs))))
    index.apply_batch(batch("b", stored(1, block_hashes(b_prompt, bs))))
    query = block_hashes([*prefix, 5, 5, 5, 5], bs)
    assert index.overlaps(query, [("a", 0), ("b", 0)]) == {("a", 0): 4, ("b", 0): 2}


def test_block_map_counts_and_slot_reuse() -> None:
    m = BlockMap()
    s = m.slot(("w", 0))
    assert m.add(s, [1, 2, 2, 3]) == 3
    assert m.remove(s, [2, 4]) == 1
    assert m.count(("w", 0)) == 2
    m.drop(("w", 0))
    assert m.masks() == {} and len(m) == 0
    assert m.slot(("x", 0)) == s


def test_eviction_order_follows_events_and_routing_and_capacity_counts_hot_victims() -> None:
    index = synced_index("a")
    key = ("a", 0)
    index.apply_batch(batch("a", stored(1, [1, 2, 3]), stored(2, [7, 8], parent=3)))
    slot = index.map.slot_of[key]
    # stored blocks enter most recently used, each event's first block last (engines release tail first)
    assert list(index.map.blocks(slot)) == [3, 2, 1, 8, 7]
    index.touch(key, [1, 2], reused=True)  # a routed prompt reused 1, 2
    assert index.map.blocks(slot) == {3: 0, 8: 0, 7: 0, 2: 1, 1: 1}
    assert list(index.map.blocks(slot)) == [3, 8, 7, 2, 1]
    index.set_total(key, 6)
    # 5 resident + 2 pending (routed, not computed) in 6: 3 new blocks evict 4 — 3, 8, 7 (cold) and 2 (hot)
    assert index.capacity(key, set(), 3, pending=2) == Capacity(total=6, resident=7, evicted_hot=1)
    assert index.capacity(key, set(), 1) == Capacity(total=6, resident=5, evicted_hot=0)  # it fits
    index.apply_batch(batch("a", removed(3, [2])))
    assert index.capacity(key, set(), 5) == Capacity(total=6, resident=4, evicted_hot=0)  # 3, 8, 7: cold
    assert index.capacity(key, set(), 6) == Capacity(total=6, resident=4, evicted_hot=1)  # then 1: reused
    index.set_total(key, 0)
    assert index.capacity(key, set(), 50) == Capacity(total=0, resident=4, evicted_hot=0)
    index.remove_worker("a")
    assert index.totals == {}


def test_hot_victims_skips_the_prompts_own_blocks_and_counts_reused_ones_among_the_least_recently_used() -> None:
    m = BlockMap()
    s = m.slot(("a", 0))
    m.add(s, range(1, 11))  # 1 least recently used … 10 most
    m.touch(s, [2, 4, 9], reused=True)  # most recently used, the first last: 1 3 5 6 7 8 10 9 4 2; reused
    m.touch(s, [5, 6, 7, 8, 10], reused=False)
    assert list(m.blocks(s)) == [1, 3, 9, 4, 2, 10, 8, 7, 6, 5]
    assert m.hot_victims(s, 2) == 0  # 1, 3
    assert m.hot_victims(s, 4) == 2  # 1, 3, 9, 4
    assert m.hot_victims(s, 50) == 3  # all of them
    # the prompt's own blocks are never victims: the next ones in order are taken instead
    assert m.hot_victims(s, 2, keep={1}) == 1  # 3, 9
    assert m.hot_victims(s, 4, keep={9, 4}) == 1  # 1, 3, 2, 10
    assert m.hot_victims(s, 3, keep={7}) == 1  # 1, 3, 9 (7 is not among them)
    assert m.hot_victims(s, 0, keep={1}) == 0


def test_hot_victims_agrees_with_walking_the_eviction_order() -> None:
    import random

    rng = random.Random(5)
    for _ in range(300):
        m = BlockMap()
        s = m.slot(("a", 0))
        m.add(s, rng.sample(range(100), rng.randrange(0, 40)))
        held = list(m.blocks(s))
        if held:
            m.touch(s, rng.sample(held, rng.randrange(0, len(held))), reused=True)
        keep = set(rng.sample(range(100), rng.randrange(0, 30)))
        k = rng.randrange(0, 45)
        victims = [h for h in m.blocks(s) if h not in keep][:k]
        assert m.hot_victims(s, k, keep) == sum(1 for h in victims if m.blocks(s)[h]), (k, keep)


def test_lower_tier_events_do_not_make_blocks_device_resident() -> None:
    index = KvIndex()
    index.add_worker("w1")
    index.apply_snapshot(snapshot("w1", 0, {}))
    host = stored(1, [10, 11])
    host.stored.tier = events_pb2.KV_TIER_HOST
    gone = removed(3, [1])
    gone.removed.tier = events_pb2.KV_TIER_HOST  # the host copy left; the device copy stays
    assert not index.apply_batch(batch("w1", host, stored(2, [1, 2]), gone))
    assert index.last_event_id("w1") == 3
    assert index.overlaps([1, 2], [("w1", 0)]) == {("w1", 0): 2}
    assert index.overlaps([10, 11], [("w1", 0)]).get(("w1", 0), 0) == 0


def _state(m: PyBlockMap) -> tuple[object, ...]:
    return (m.masks(), [list(m.blocks(s).items()) for s in range(len(m.held))], list(m.hot), list(m.sizes))


def test_replace_leaves_the_state_clear_then_add_leaves_at_the_cost_of_the_difference() -> None:
    """Locks: a snapshot applied as a difference (the Python map's `replace`; the compiled one clears and adds) ends
    exactly where clearing the slot and adding the snapshot's blocks ends: the same masks, the same blocks in the same
    eviction order, no reuse counted."""
    import copy
    import random

    rng = random.Random(3)
    for _ in range(200):
        m = PyBlockMap()
        for s in range(rng.randrange(1, 6)):
            slot = m.slot((f"w{s}", 0))
            m.add(slot, [rng.randrange(40) for _ in range(rng.randrange(30))])
            held = list(m.blocks(slot))
            m.touch(slot, rng.sample(held, min(len(held), 5)), reused=rng.random() < 0.5)
        slot = rng.randrange(len(m.held))
        snapshot = [rng.randrange(40) for _ in range(rng.randrange(30))]  # duplicates too
        expected = copy.deepcopy(m)
        expected.clear_slot(slot)
        expected.add(slot, snapshot)
        assert m.replace(slot, snapshot) == len(set(snapshot))
        assert _state(m) == _state(expected)


def test_a_snapshot_of_a_worker_whose_blocks_did_not_change_keeps_the_index_and_resets_reuse() -> None:
    idx = synced_index("w")
    hashes = list(range(100, 110))
    idx.request_resync("w")
    assert not idx.apply_snapshot(snapshot("w", 0, {0: hashes}))
    idx.touch(("w", 0), hashes[:3], reused=True)
    assert idx.map.hot[0] == 3
    idx.request_resync("w")
    assert not idx.apply_snapshot(snapshot("w", 0, {0: hashes}))
    assert idx.overlaps(hashes, [("w", 0)]) == {("w", 0): 10}
    assert list(idx.map.blocks(0).items()) == [(h, 0) for h in hashes] and idx.map.hot[0] == 0


def test_a_snapshot_without_a_rank_clears_that_rank_and_a_rank_listed_twice_keeps_both_lists() -> None:
    idx = synced_index("w")
    idx.request_resync("w")
    assert not idx.apply_snapshot(snapshot("w", 0, {0: [1, 2], 1: [3]}))
    idx.request_resync("w")
    snap = snapshot("w", 0, {0: [1]})
    snap.ranks.add(dp_rank=0, blocks=[events_pb2.StoredBlock(block_hash=5)])
    assert not idx.apply_snapshot(snap)
    assert idx.overlaps([3], [("w", 1)]) == {} and idx.worker_blocks("w") == 2
    assert list(idx.map.blocks(idx.map.slot_of[("w", 0)])) == [1, 5]


def test_a_snapshot_s_packed_hashes_and_stored_blocks_are_both_read() -> None:
    """Locks: workers send `block_hashes` (packed); a worker older than that sends `blocks`; a router reads both."""
    idx = synced_index("new", "old")
    idx.request_resync("new")
    packed = worker_pb2.KvSnapshot(worker_id="new", last_event_id=0)
    packed.ranks.add(dp_rank=0, block_hashes=[7, 8, 9])
    assert not idx.apply_snapshot(packed)
    idx.request_resync("old")
    assert not idx.apply_snapshot(snapshot("old", 0, {0: [7, 8]}))
    assert idx.overlaps([7, 8, 9], [("new", 0), ("old", 0)]) == {("new", 0): 3, ("old", 0): 2}


def test_a_stored_event_s_packed_hashes_and_stored_blocks_are_both_read_in_order() -> None:
    """Locks: workers publish `BlocksStored.block_hashes` (packed); older workers publish `blocks`; a router reads
    both, the same blocks in the same eviction order (a mixed event: the packed ones first)."""
    idx = synced_index("new", "old", "mixed")
    idx.apply_batch(batch("new", stored(1, [1, 2, 3])))
    idx.apply_batch(batch("old", stored(1, [1, 2, 3], packed=False)))
    mixed = stored(1, [1])
    mixed.stored.blocks.extend(events_pb2.StoredBlock(block_hash=h) for h in [2, 3])
    idx.apply_batch(batch("mixed", mixed))
    keys = [("new", 0), ("old", 0), ("mixed", 0)]
    assert idx.overlaps([1, 2, 3, 4], keys) == dict.fromkeys(keys, 3)
    orders = {k: list(idx.map.blocks(idx.map.slot_of[k])) for k in keys}
    assert orders == {k: [3, 2, 1] for k in keys}  # the first block most recently used
    assert idx.applied == 9


def test_a_slot_s_dict_is_copied_compact_once_a_quarter_of_it_churned() -> None:
    """Locks: touches and removals leave holes in a slot's dict (a churning dict resizes to ~2.2x the memory of a
    compact one); once the popped entries pass a quarter of it, the slot gets a compact copy, same order and counts.
    (The Python map's; the compiled one's lists have no holes.)"""
    import sys

    m = PyBlockMap()
    s = m.slot(("w", 0))
    blocks = list(range(1, 2001))
    m.add(s, blocks)
    first = m.held[s]
    m.touch(s, blocks[:500], reused=True)  # 500 popped and re-inserted: under a quarter plus 64
    assert m.held[s] is first
    before = m.blocks(s)
    m.touch(s, blocks[500:600], reused=False)  # 600 > 2000 / 4 + 64: copied
    assert m.held[s] is not first
    assert list(m.blocks(s).items()) == [*[(h, n) for h, n in before.items() if h not in range(501, 601)],
                                         *[(h, before[h]) for h in reversed(blocks[500:600])]]  # fmt: skip
    assert sys.getsizeof(m.held[s]) == sys.getsizeof(dict(m.held[s]))  # compact
    second = m.held[s]
    m.remove(s, blocks[:300])  # evictions count too
    assert m.held[s] is second
    m.remove(s, blocks[300:700])
    assert m.held[s] is not second and m.count(("w", 0)) == 1300 and m.hot[s] == sum(1 for n in m.held[s].values() if n)

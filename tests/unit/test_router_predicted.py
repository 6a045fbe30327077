"""The router's predicted index: in-flight prompts (refcounted) and approximate mode (TTL)."""

from __future__ import annotations

from meshllm.router.kv.capacity import Capacity
from meshllm.router.kv.predicted import PredictedIndex, RoutedCache


def test_in_flight_entries_share_blocks_until_the_last_one_ends() -> None:
    idx = PredictedIndex()
    e1 = idx.add(("a", 0), [1, 2, 3], entry_id="r1")
    e2 = idx.add(("a", 0), [1, 2], entry_id="r2")
    assert idx.overlaps([1, 2, 3], [("a", 0)]) == {("a", 0): 3}
    idx.remove(e1)
    assert idx.overlaps([1, 2, 3], [("a", 0)]) == {("a", 0): 2}
    idx.remove(e2)
    assert idx.overlaps([1], [("a", 0)]) == {}
    assert len(idx) == 0


def test_duplicate_entry_ids_get_distinct_entries() -> None:
    idx = PredictedIndex()
    e1 = idx.add(("a", 0), [1], entry_id="r")
    e2 = idx.add(("a", 0), [1], entry_id="r")
    assert e1 != e2
    idx.remove(e1)
    assert idx.overlaps([1], [("a", 0)]) == {("a", 0): 1}


def test_approximate_blocks_expire_after_the_ttl_from_their_last_routing() -> None:
    cache = RoutedCache(ttl_s=120.0)
    cache.add(("a", 0), [1, 2], now=0.0)
    cache.add(("a", 0), [1], now=100.0)
    assert cache.expire(119.0) == 0
    assert cache.expire(120.0) == 1
    assert cache.overlaps([1, 2], [("a", 0)]) == {("a", 0): 1}  # the later routing keeps block 1
    assert cache.expire(220.0) == 1
    assert cache.overlaps([1], [("a", 0)]) == {}


def test_approximate_cache_evicts_least_recently_routed_blocks_beyond_its_capacity() -> None:
    cache = RoutedCache(ttl_s=1e9)
    cache.set_total(("a", 0), 4)
    cache.add(("a", 0), [1, 2, 3], now=0.0)
    cache.add(("a", 0), [7, 8], now=1.0)  # 5 blocks in a 4-block cache: one goes, the tail of [1, 2, 3] first
    assert cache.worker_blocks("a") == 4
    assert cache.overlaps([1, 2, 3], [("a", 0)]) == {("a", 0): 2}
    cache.add(("a", 0), [1, 2], now=2.0)  # routed again: reused, most recently used
    assert cache.map.blocks(cache.map.slot_of[("a", 0)]) == {8: 0, 7: 0, 2: 1, 1: 1}  # eviction order, reuses
    # two new blocks would evict 8 and 7 (never reused), then 2 (reused): hot victims counted
    assert cache.capacity(("a", 0), set(), 2) == Capacity(total=4, resident=4, evicted_hot=0)
    assert cache.capacity(("a", 0), set(), 3) == Capacity(total=4, resident=4, evicted_hot=1)
    assert cache.capacity(("a", 0), {8}, 2) == Capacity(total=4, resident=4, evicted_hot=1)  # the prompt's own stay
    assert cache.capacity(("b", 0), set(), 3) == Capacity(total=0, resident=0, evicted_hot=0)  # unknown capacity


def test_removing_a_worker_forgets_its_entries() -> None:
    idx = PredictedIndex()
    idx.add(("a", 0), [1], entry_id="r1")
    idx.add(("b", 0), [1], entry_id="r2")
    idx.remove_worker("a")
    assert idx.overlaps([1], [("a", 0), ("b", 0)]) == {("b", 0): 1}
    idx.remove("r1")  # already gone: no error
    assert idx.worker_blocks("a") == 0 and idx.worker_blocks("b") == 1

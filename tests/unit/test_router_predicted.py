"""The router's predicted index: in-flight prompts (refcounted) and approximate mode (TTL)."""

from __future__ import annotations

from meshllm.router.predicted import PredictedIndex


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


def test_approximate_entries_expire_after_the_ttl_from_their_last_routing() -> None:
    idx = PredictedIndex(ttl_s=120.0)
    idx.add(("a", 0), [1, 2], now=0.0)
    idx.add(("a", 0), [1], now=100.0)
    assert idx.expire(119.0) == 0
    assert idx.expire(120.0) == 1
    assert idx.overlaps([1, 2], [("a", 0)]) == {("a", 0): 1}  # the later routing keeps block 1
    assert idx.expire(220.0) == 1
    assert idx.overlaps([1], [("a", 0)]) == {}


def test_removing_a_worker_forgets_its_entries() -> None:
    idx = PredictedIndex()
    idx.add(("a", 0), [1], entry_id="r1")
    idx.add(("b", 0), [1], entry_id="r2")
    idx.remove_worker("a")
    assert idx.overlaps([1], [("a", 0), ("b", 0)]) == {("b", 0): 1}
    idx.remove("r1")  # already gone: no error
    assert idx.worker_blocks("a") == 0 and idx.worker_blocks("b") == 1

"""Routing policies: the kv cost formula, argmin with a deterministic tie-break, softmax, and the simple modes."""

from __future__ import annotations

import collections
import random

import pytest

from meshllm.router.config import RouterMode
from meshllm.router.policy.choice import REUSED_EVICT_COST, Candidate, KvPolicy, make_policy, score


def cands(*specs: tuple[str, int, int, int]) -> list[Candidate]:
    """(worker, overlap blocks, prefill tokens, decode blocks) each."""
    return [Candidate(worker_id=w, dp_rank=0, address=f"{w}:1", overlap_blocks=o, prefill_tokens=p, decode_blocks=d)
            for w, o, p, d in specs]  # fmt: skip


def test_cost_is_overlap_weight_times_prefill_blocks_plus_decode_blocks() -> None:
    cs = cands(("a", 0, 64, 10), ("b", 3, 16, 30))
    cs[1].queued_prefill_tokens = 32
    score(cs, block_size=16, overlap_weight=2.0)
    assert cs[0].cost == pytest.approx(2.0 * 4 + 10)
    assert cs[1].cost == pytest.approx(2.0 * (16 + 32) / 16 + 30)


def test_kv_at_temperature_zero_picks_the_lowest_cost() -> None:
    cs = cands(("a", 0, 64, 0), ("b", 4, 0, 1), ("c", 2, 32, 0))
    score(cs, block_size=16, overlap_weight=1.0)
    assert make_policy(RouterMode.KV, temperature=0, rng=random.Random(0)).pick(cs, "m").worker_id == "b"


def test_ties_break_by_decode_blocks_then_in_flight_then_worker_id_deterministically() -> None:
    policy = make_policy(RouterMode.KV, temperature=0, rng=random.Random(0))
    cs = cands(("c", 0, 16, 0), ("a", 0, 16, 0), ("b", 0, 16, 0))
    score(cs, block_size=16, overlap_weight=1.0)
    assert {policy.pick(cs, "m").worker_id for _ in range(10)} == {"a"}
    cs[1].in_flight = 1
    assert policy.pick(cs, "m").worker_id == "b"
    # equal cost, fewer decode blocks wins
    cs = cands(("a", 0, 32, 1), ("b", 1, 16, 2))
    score(cs, block_size=16, overlap_weight=1.0)
    assert cs[0].cost == cs[1].cost
    assert policy.pick(cs, "m").worker_id == "a"


def test_softmax_sampling_prefers_cheap_workers_but_visits_all() -> None:
    policy = KvPolicy("kv", temperature=0.5, rng=random.Random(7))
    cs = cands(("a", 0, 0, 0), ("b", 0, 0, 50), ("c", 0, 0, 100))
    score(cs, block_size=16, overlap_weight=1.0)
    counts = collections.Counter(policy.pick(cs, "m").worker_id for _ in range(3000))
    assert counts["a"] > counts["b"] > counts["c"] > 0
    # normalised costs 0, 0.5, 1 at T=0.5: weights 1, e^-1, e^-2
    assert counts["a"] / 3000 == pytest.approx(1 / (1 + 0.3679 + 0.1353), abs=0.04)


def test_softmax_with_equal_costs_is_uniform() -> None:
    policy = KvPolicy("kv", temperature=1.0, rng=random.Random(1))
    cs = cands(("a", 0, 0, 5), ("b", 0, 0, 5))
    score(cs, block_size=16, overlap_weight=1.0)
    counts = collections.Counter(policy.pick(cs, "m").worker_id for _ in range(2000))
    assert 800 < counts["a"] < 1200


def test_round_robin_cycles_per_pool_in_worker_order() -> None:
    policy = make_policy(RouterMode.ROUND_ROBIN, temperature=0, rng=random.Random(0))
    cs = cands(("b", 0, 0, 0), ("a", 0, 0, 0), ("c", 0, 0, 0))
    assert [policy.pick(cs, "m1").worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert policy.pick(cs, "m2").worker_id == "a"


def test_random_visits_every_worker() -> None:
    policy = make_policy(RouterMode.RANDOM, temperature=0, rng=random.Random(3))
    cs = cands(("a", 0, 0, 0), ("b", 0, 0, 0), ("c", 0, 0, 0))
    assert {policy.pick(cs, "m").worker_id for _ in range(100)} == {"a", "b", "c"}


def test_least_loaded_ignores_cache_and_picks_fewest_decode_blocks() -> None:
    policy = make_policy(RouterMode.LEAST_LOADED, temperature=0, rng=random.Random(0))
    cs = cands(("a", 10, 0, 5), ("b", 0, 640, 1))
    score(cs, block_size=16, overlap_weight=1.0)
    assert policy.pick(cs, "m").worker_id == "b"
    assert policy.name == "least-loaded"


def test_approximate_uses_the_kv_formula_under_its_own_name() -> None:
    policy = make_policy(RouterMode.APPROXIMATE, temperature=0, rng=random.Random(0))
    cs = cands(("a", 0, 64, 0), ("b", 4, 0, 0))
    score(cs, block_size=16, overlap_weight=1.0)
    assert policy.pick(cs, "m").worker_id == "b" and policy.name == "approximate"


def test_a_prefix_nobody_caches_goes_to_the_emptiest_cache_on_a_tie() -> None:
    policy = make_policy(RouterMode.KV, temperature=0, rng=random.Random(0))
    cs = cands(("a", 0, 64, 0), ("b", 0, 64, 0), ("c", 0, 64, 0))
    cs[0].cached_blocks, cs[1].cached_blocks, cs[2].cached_blocks = 150, 0, 80
    score(cs, block_size=16, overlap_weight=1.0)
    assert policy.pick(cs, "m").worker_id == "b"


def room(c: Candidate, *, new: int, resident: int, total: int, hot: int = 0) -> Candidate:
    c.new_blocks, c.cached_blocks, c.total_blocks, c.evicted_hot_blocks = new, resident, total, hot
    return c


def test_capacity_terms_are_pressure_and_evicted_hot_blocks_times_the_capacity_weight() -> None:
    (c,) = cands(("a", 2, 48 * 16, 10))
    room(c, new=48, resident=75, total=150, hot=3)
    score([c], block_size=16, overlap_weight=1.0, capacity_weight=2.0)
    assert c.pressure == pytest.approx(48 * 75 / 150)
    assert c.cost == pytest.approx(48 + 10 + 2.0 * (24 + REUSED_EVICT_COST * 3))
    room(c, new=48, resident=75, total=0, hot=3)  # capacity unknown: no capacity terms at all
    score([c], block_size=16, overlap_weight=1.0, capacity_weight=2.0)
    assert c.pressure == 0 and c.cost == pytest.approx(48 + 10)


def test_a_block_every_worker_could_compute_does_not_decide_where_a_new_document_goes() -> None:
    # a holds one 50-block document and the 2-block preamble every document starts with; b is empty
    a, b = cands(("a", 2, 48 * 16, 49), ("b", 0, 50 * 16, 51))
    room(a, new=48, resident=52, total=150)
    room(b, new=50, resident=0, total=150)
    policy = make_policy(RouterMode.KV, temperature=0, rng=random.Random(0))
    score([a, b], block_size=16, overlap_weight=1.0, capacity_weight=0.0)
    assert policy.pick([a, b], "m").worker_id == "a"  # overlap and load alone (Dynamo's cost): the preamble decides
    score([a, b], block_size=16, overlap_weight=1.0, capacity_weight=1.0)
    assert policy.pick([a, b], "m").worker_id == "b"  # the new blocks go where there is room


def test_a_mostly_cached_prompt_stays_on_its_worker_even_when_that_cache_is_full() -> None:
    a, b = cands(("a", 48, 2 * 16, 50), ("b", 0, 50 * 16, 50))
    room(a, new=2, resident=150, total=150, hot=2)
    room(b, new=50, resident=0, total=150)
    score([a, b], block_size=16, overlap_weight=1.0, capacity_weight=1.0)
    assert make_policy(RouterMode.KV, temperature=0, rng=random.Random(0)).pick([a, b], "m").worker_id == "a"


def test_evicting_reused_blocks_is_charged_and_evicting_never_reused_blocks_is_not() -> None:
    # equally full caches; to take 40 new blocks a must evict 10 blocks that were reused, b 10 that never were
    a, b = cands(("a", 0, 40 * 16, 40), ("b", 0, 40 * 16, 40))
    room(a, new=40, resident=110, total=120, hot=10)
    room(b, new=40, resident=110, total=120, hot=0)
    score([a, b], block_size=16, overlap_weight=1.0, capacity_weight=1.0)
    assert b.cost == pytest.approx(a.cost - REUSED_EVICT_COST * 10)
    assert make_policy(RouterMode.KV, temperature=0, rng=random.Random(0)).pick([a, b], "m").worker_id == "b"


def test_a_busy_worker_loses_despite_caching_the_prompt() -> None:
    a, b = cands(("a", 40, 10 * 16, 400), ("b", 0, 50 * 16, 50))
    a.queued_prefill_tokens = 2000
    room(a, new=10, resident=100, total=150)
    room(b, new=50, resident=0, total=150)
    score([a, b], block_size=16, overlap_weight=1.0, capacity_weight=1.0)
    assert make_policy(RouterMode.KV, temperature=0, rng=random.Random(0)).pick([a, b], "m").worker_id == "b"
    a.decode_blocks, a.queued_prefill_tokens = 50, 0  # idle again: the cached prompt wins
    score([a, b], block_size=16, overlap_weight=1.0, capacity_weight=1.0)
    assert make_policy(RouterMode.KV, temperature=0, rng=random.Random(0)).pick([a, b], "m").worker_id == "a"


def test_the_wait_behind_a_busy_worker_is_charged_times_the_wait_weight() -> None:
    a, b = cands(("a", 64, 16, 66), ("b", 0, 65 * 16, 65))
    a.wait_blocks = 150.0  # 1.5 steps of 25 ms at 0.25 ms per prefill block
    score([a, b], block_size=16, overlap_weight=1.0, capacity_weight=1.0, wait_weight=1.0)
    assert a.cost == pytest.approx(1 + 66 + 150) and b.cost == pytest.approx(65 + 65)
    score([a, b], block_size=16, overlap_weight=1.0, capacity_weight=1.0, wait_weight=0.5)
    assert a.cost == pytest.approx(1 + 66 + 75)


def test_a_cache_hit_on_a_busy_worker_loses_when_the_wait_costs_more_than_recomputing_elsewhere() -> None:
    # a caches 64 of 65 blocks but runs another request; b is idle and caches nothing.
    a, b = cands(("a", 64, 16, 66), ("b", 0, 65 * 16, 65))
    pick = make_policy(RouterMode.KV, temperature=0, rng=random.Random(0)).pick
    score([a, b], block_size=16, overlap_weight=1.0, capacity_weight=1.0, wait_weight=1.0)
    assert pick([a, b], "m").worker_id == "a"  # wait unknown (0): the hit wins, as without the term
    a.wait_blocks = 150.0  # waiting 37.5 ms costs more than 64 blocks of prefill (16 ms)
    score([a, b], block_size=16, overlap_weight=1.0, capacity_weight=1.0, wait_weight=1.0)
    assert pick([a, b], "m").worker_id == "b"
    score([a, b], block_size=16, overlap_weight=1.0, capacity_weight=1.0, wait_weight=0.0)
    assert pick([a, b], "m").worker_id == "a"
    a.wait_blocks = 40.0  # a short wait (10 ms) is worth the 64 blocks it saves
    score([a, b], block_size=16, overlap_weight=1.0, capacity_weight=1.0, wait_weight=1.0)
    assert pick([a, b], "m").worker_id == "a"


def test_a_busy_holder_keeps_its_request_when_moving_it_would_evict_enough_reused_blocks() -> None:
    # a caches 64 of the prompt's 65 blocks but runs another request (a wait of 150 blocks); b is idle,
    # holds nothing of the prompt and must evict 35 blocks to take its 65, some of them reused.
    assert REUSED_EVICT_COST == 2.5  # the recompute, plus 1.5 for the evictions storing it again sets off
    pick = make_policy(RouterMode.KV, temperature=0, rng=random.Random(0)).pick
    a, b = cands(("a", 64, 16, 66), ("b", 0, 65 * 16, 65))
    a.wait_blocks = 150.0
    room(a, new=1, resident=130, total=160)
    room(b, new=65, resident=130, total=160, hot=20)
    score([a, b], block_size=16, overlap_weight=1.0, capacity_weight=1.0, wait_weight=1.0)
    pressure = 65 * 130 / 160
    assert a.cost == pytest.approx(1 + 66 + 130 / 160 + 150)  # 217.8
    assert b.cost == pytest.approx(65 + 65 + pressure + 2.5 * 20)  # 232.8: 20 reused victims at 2.5 each
    assert pick([a, b], "m").worker_id == "a"  # at 1.5 blocks each (212.8) the request would have moved
    room(b, new=65, resident=130, total=160, hot=10)  # fewer reused victims: the wait is worth avoiding
    score([a, b], block_size=16, overlap_weight=1.0, capacity_weight=1.0, wait_weight=1.0)
    assert b.cost == pytest.approx(65 + 65 + pressure + 25) and pick([a, b], "m").worker_id == "b"


@pytest.mark.parametrize("mode", [RouterMode.KV, RouterMode.APPROXIMATE])
def test_a_candidate_without_room_loses_to_any_with_room_and_wins_only_when_none_has(mode: RouterMode) -> None:
    cs = cands(("a", 12, 128, 52), ("b", 0, 320, 120), ("c", 0, 320, 130))
    score(cs, block_size=16, overlap_weight=1.0)
    policy = make_policy(mode, temperature=0, rng=random.Random(0))
    assert policy.pick(cs, "m").worker_id == "a"  # the cheapest
    cs[0].no_room = True
    assert policy.pick(cs, "m").worker_id == "b"  # the cheapest with room
    for c in cs:
        c.no_room = True
    assert policy.pick(cs, "m").worker_id == "a"  # nobody has room: the cost decides


def test_softmax_sampling_never_picks_a_candidate_without_room_while_one_has_room() -> None:
    cs = cands(("a", 4, 0, 0), ("b", 0, 64, 10), ("c", 0, 64, 10))
    score(cs, block_size=16, overlap_weight=1.0)
    cs[0].no_room = True
    policy = KvPolicy("kv", temperature=10.0, rng=random.Random(1))
    picks = collections.Counter(policy.pick(cs, "m").worker_id for _ in range(300))
    assert picks["a"] == 0 and picks["b"] > 100 and picks["c"] > 100

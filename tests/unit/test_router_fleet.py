"""Fleet decisions (meshllm.router.policy.fleet) choose what scoring every candidate chooses.

Each scenario builds one RouterCore's state by hand — a pool, KV snapshots,
reuse touches, charges, LoadSnapshots, step and prefill times, in-flight
prefixes, lower tiers — then decides every prompt twice, with the fleet path
and with the exhaustive scorer (`core.candidates.fleet = False`), changing the load
between prompts so the tables' incremental state is what is tested. The
fleet path is exact: the same worker every time, not 99 %.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.plane.discovery.base import MemoryDiscovery, MemoryStore
from meshllm.plane.events.base import MemoryBroker, MemoryEventBus
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.kv import block_hashes
from meshllm.router.config import RouterConfig, RoutingTuning
from meshllm.router.core import RouterCore
from meshllm.router.kv.blocks import BlockMap
from meshllm.router.policy.fleet import bit_indices
from meshllm.router.workers import AGGREGATED, PoolWorker
from meshllm.v1 import discovery_pb2, events_pb2, worker_pb2

PLANE = PlaneConfig(discovery=DiscoveryKind.MEMORY, events=EventsKind.MEMORY)
BS = 16
MODEL = "m"


def make_core(**cfg: float) -> RouterCore:
    config = RouterConfig(plane=PLANE, tuning=RoutingTuning(**cfg))  # type: ignore[arg-type]
    return RouterCore(config, MemoryDiscovery(MemoryStore()), MemoryEventBus(MemoryBroker()), ChannelCache())


def card(total: int) -> discovery_pb2.ModelCard:
    c = discovery_pb2.ModelCard(name=MODEL, kv_block_size=BS)
    c.runtime_limits.total_kv_blocks = total
    return c


def add_workers(core: RouterCore, n: int, rng: random.Random, total: int) -> list[PoolWorker]:
    workers = {
        f"w{i:04d}": PoolWorker(
            f"w{i:04d}", f"127.0.0.1:{20000 + i}", AGGREGATED, MODEL, 2 if rng.random() < 0.15 else 1, card(total)
        )
        for i in range(n)
    }
    core.pool._update(workers)  # the pool as discovery would fill it
    for w in workers.values():
        core.index.add_worker(w.id)
    return list(workers.values())


def documents(rng: random.Random, n: int, tokens: int, groups: int) -> list[list[int]]:
    prefixes = [[rng.randrange(32000) for _ in range(tokens // 4)] for _ in range(groups)]
    return [prefixes[i % groups] + [rng.randrange(32000) for _ in range(tokens - tokens // 4)] for i in range(n)]


def fill(core: RouterCore, workers: list[PoolWorker], docs: list[list[int]], rng: random.Random, *, tiers: bool) -> None:
    """Snapshots: each (worker, rank) holds a few documents (some cut short), some a document in host memory."""
    for w in workers:
        snap = worker_pb2.KvSnapshot(worker_id=w.id, last_event_id=0)
        for r in range(w.dp_size):
            rank = snap.ranks.add(dp_rank=r)
            held = []
            for d in rng.sample(range(len(docs)), rng.randrange(0, 5)):
                hs = block_hashes(docs[d], BS)
                held.extend(hs[: rng.randrange(1, len(hs) + 1)])
            held = list(dict.fromkeys(held))
            rank.blocks.extend(events_pb2.StoredBlock(block_hash=h) for h in held)
            if tiers and rng.random() < 0.2:
                hs = block_hashes(docs[rng.randrange(len(docs))], BS)
                rank.lower_tiers.add(tier=events_pb2.KV_TIER_HOST).blocks.extend(events_pb2.StoredBlock(block_hash=h) for h in hs)
        core.index.apply_snapshot(snap)
        for r in range(w.dp_size):  # some prompts routed there again, as reuses
            for d in rng.sample(range(len(docs)), 2):
                core.index.touch((w.id, r), block_hashes(docs[d], BS), reused=rng.random() < 0.5)


def perturb(core: RouterCore, workers: list[PoolWorker], docs: list[list[int]], rng: random.Random, step: int) -> None:
    """Load changes between decisions: charges, first tokens, ends, snapshots, step times, in-flight prefixes."""
    now = time.time()
    for _ in range(rng.randrange(0, 6)):
        w = rng.choice(workers)
        key = (w.id, rng.randrange(w.dp_size))
        rid = f"r{step}-{rng.random()}"
        core.load.route("me", rid, key, prefill_tokens=rng.randrange(0, 2000), blocks=rng.randrange(1, 300), now=now)
        if rng.random() < 0.5:
            core.load.prefill_done("me", rid)
        if rng.random() < 0.3:
            core.inflight.add(key, block_hashes(docs[rng.randrange(len(docs))], BS)[: rng.randrange(1, 20)], entry_id=rid)
    charges = list(core.load._charges)
    for origin, rid in rng.sample(charges, min(len(charges), rng.randrange(0, 4))):
        core.load.complete(origin, rid)
    for _ in range(rng.randrange(0, 4)):
        w = rng.choice(workers)
        core.load.apply_snapshot(
            events_pb2.LoadSnapshot(
                worker_id=w.id, dp_rank=rng.randrange(w.dp_size), active_blocks=rng.randrange(0, 900),
                total_blocks=rng.choice([0, 600, 1000, 1000]), timestamp_ms=int(now * 1000),
            ),
            now=now,
        )  # fmt: skip
    for _ in range(rng.randrange(0, 3)):
        w = rng.choice(workers)
        core.times.step((w.id, rng.randrange(w.dp_size)), rng.uniform(5, 40))


def prompt(docs: list[list[int]], rng: random.Random) -> list[int]:
    d = docs[rng.randrange(len(docs))]
    kind = rng.randrange(4)
    if kind == 0:
        return d
    if kind == 1:
        return d[: len(d) // 2] + [rng.randrange(32000) for _ in range(rng.randrange(1, 400))]
    if kind == 2:
        return d[: len(d) // 4] + [rng.randrange(32000) for _ in range(300)]
    return [rng.randrange(32000) for _ in range(rng.randrange(16, 900))]


def both(core: RouterCore, tokens: list[int], **hints: object) -> tuple[tuple[str, int], tuple[str, int], int]:
    """(exhaustive choice, fleet choice, candidates the fleet path scored)."""
    hashes = block_hashes(tokens, BS)
    core.candidates.fleet = False
    ref = core.decide(MODEL, AGGREGATED, tokens, hashes, BS, hints, set())  # type: ignore[arg-type]
    core.candidates.fleet = True
    got = core.decide(MODEL, AGGREGATED, tokens, hashes, BS, hints, set())  # type: ignore[arg-type]
    return ref.chosen.key, got.chosen.key, len(got.candidates)


@pytest.mark.parametrize(
    ("seed", "weights", "tiers", "total"),
    [
        (1, {}, False, 1000),
        (2, {"capacity_weight": 0.0}, False, 600),
        (3, {"wait_weight": 0.0, "overlap_weight": 2.0}, True, 1000),
        (4, {}, True, 150),  # full caches: most new blocks evict, some of them reused ones
        (5, {"capacity_weight": 3.0, "wait_weight": 2.0}, False, 150),
        (6, {}, False, 0),  # no capacity known (no card limit) until a LoadSnapshot says
    ],
)
def test_fleet_choice_matches_exhaustive_scorer(seed: int, weights: dict[str, float], tiers: bool, total: int) -> None:
    rng = random.Random(seed)
    core = make_core(**weights)
    workers = add_workers(core, 80, rng, total=total)
    docs = documents(rng, 40, 1024, groups=6)
    fill(core, workers, docs, rng, tiers=tiers)
    core.times.prefill(MODEL, 1000, 80.0)
    core.times.prefill(MODEL, 2000, 150.0)
    scored = []
    for step in range(300):
        perturb(core, workers, docs, rng, step)
        ref, got, n = both(core, prompt(docs, rng))
        assert got == ref, f"decision {step}: fleet chose {got}, exhaustive {ref}"
        scored.append(n)
    slots = sum(w.dp_size for w in workers)
    assert statistics_median(scored) < slots / 4  # it prunes: most decisions score a few candidates, not the pool


def statistics_median(values: list[int]) -> float:
    return float(np.median(values))


def test_idle_fleet_with_room_scores_one_candidate_beside_the_holders() -> None:
    rng = random.Random(7)
    core = make_core()
    workers = add_workers(core, 64, rng, total=100_000)
    docs = documents(rng, 8, 512, groups=2)
    fill(core, workers, docs, rng, tiers=False)
    for step in range(50):
        ref, got, n = both(core, [rng.randrange(32000) for _ in range(700)])  # a miss everywhere
        assert got == ref
        assert n == 1, f"decision {step} scored {n}"


def test_hints_exclusions_and_pinned_rank_follow_the_same_rules() -> None:
    rng = random.Random(11)
    core = make_core()
    workers = add_workers(core, 48, rng, total=800)
    docs = documents(rng, 20, 640, groups=4)
    fill(core, workers, docs, rng, tiers=False)
    two_rank = [w.id for w in workers if w.dp_size == 2]
    for step in range(100):
        perturb(core, workers, docs, rng, step)
        tokens = prompt(docs, rng)
        allowed = [w.id for w in rng.sample(workers, 10)]
        ref, got, _ = both(core, tokens, allowed_worker_ids=allowed)
        assert got == ref and got[0] in allowed
        if two_rank:
            ref, got, _ = both(core, tokens, dp_rank=1)
            assert got == ref and got[1] == 1 and got[0] in two_rank
        if step % 10 == 0:
            core.pool.mark_failed(rng.choice(workers).id)  # cooling workers are left out by both paths
        ref, got, _ = both(core, tokens)
        assert got == ref


def test_table_follows_pool_changes() -> None:
    rng = random.Random(13)
    core = make_core()
    workers = add_workers(core, 40, rng, total=800)
    docs = documents(rng, 10, 640, groups=2)
    fill(core, workers, docs, rng, tiers=False)
    tokens = docs[0]
    ref, got, _ = both(core, tokens)
    assert got == ref
    # The chosen worker leaves: neither path may choose it, and the table is rebuilt.
    gone = got[0]
    kept = {w.id: w for w in workers if w.id != gone}
    core.pool._update(kept)
    core.index.remove_worker(gone)
    core.load.remove_worker(gone)
    ref, got, _ = both(core, tokens)
    assert got == ref and got[0] != gone


def test_bit_indices_and_overlap_groups_agree_with_overlaps() -> None:
    assert bit_indices(0).tolist() == []
    assert bit_indices(0b1011).tolist() == [0, 1, 3]
    big = (1 << 1023) | (1 << 500) | sum(1 << i for i in range(0, 40, 3))
    assert bit_indices(big).tolist() == sorted([1023, 500, *range(0, 40, 3)])
    rng = random.Random(3)
    bmap = BlockMap()
    chain = [rng.getrandbits(64) for _ in range(30)]
    for s in range(70):
        bmap.add(bmap.slot((f"w{s}", 0)), chain[: rng.randrange(0, 31)])
    keys = [(f"w{s}", 0) for s in range(70)]
    mask = sum(1 << bmap.slot_of[k] for k in keys)
    want = bmap.overlaps(chain, keys)
    got = {}
    for depth, bits in bmap.overlap_groups(chain, mask):
        for s in bit_indices(bits).tolist():
            got[(f"w{s}", 0)] = depth
    assert got == want


def test_hot_counts_follow_touches_removals_and_clears() -> None:
    bmap = BlockMap()
    s = bmap.slot(("w", 0))
    bmap.add(s, [1, 2, 3, 4])
    bmap.touch(s, [1, 2], reused=True)
    bmap.touch(s, [1], reused=True)  # a second reuse of a hot block does not count it twice
    assert bmap.hot[s] == 2
    bmap.remove(s, [1, 3])
    assert bmap.hot[s] == 1
    bmap.clear_slot(s)
    assert bmap.hot[s] == 0
    bmap.add(s, [5])
    bmap.touch(s, [5], reused=True)
    bmap.drop(("w", 0))
    t = bmap.slot(("v", 0))  # the freed slot, reused: no reused blocks carried over
    assert t == s and bmap.hot[t] == 0


def test_bounds_are_the_exact_costs_where_no_reused_block_can_go() -> None:
    """`lower_bounds` mirrors `score` bit for bit where it says `exact`, and never exceeds the cost elsewhere."""
    from meshllm.router.policy.fleet import lower_bounds

    rng = random.Random(17)
    core = make_core()
    workers = add_workers(core, 40, rng, total=120)  # caches fuller than that: reused blocks get evicted
    docs = documents(rng, 20, 800, groups=3)
    fill(core, workers, docs, rng, tiers=False)
    core.times.prefill(MODEL, 1000, 80.0)
    core.times.prefill(MODEL, 1800, 140.0)
    exact_seen = inexact_seen = 0
    for step in range(40):
        perturb(core, workers, docs, rng, step)
        core.inflight = type(core.inflight)()  # no pending prefixes: every slot goes through the bounds
        tokens = prompt(docs, rng)
        hashes = block_hashes(tokens, BS)
        core.candidates.fleet = False
        ref = core.decide(MODEL, AGGREGATED, tokens, hashes, BS, {}, set())
        table = core.candidates.table(MODEL, AGGREGATED)
        assert table is not None
        bmap = core.index.map
        counts = np.array([len(bmap.blocks(s)) for s in table.slot_list], dtype=np.int64)
        hot = np.array([bmap.hot[s] for s in table.slot_list], dtype=np.int64)
        ov = np.array([c.overlap_blocks for c in ref.candidates], dtype=np.int64)
        cfg = core.config.tuning
        b = lower_bounds(
            table, ov, counts, hot, tokens=len(tokens), hashes=len(hashes), block_size=BS,
            request_blocks=-(-len(tokens) // BS), block_ms=ref.block_ms, fixed_ms=ref.fixed_ms,
            overlap_weight=cfg.overlap_weight, capacity_weight=cfg.capacity_weight, wait_weight=cfg.wait_weight,
        )  # fmt: skip
        for i, c in enumerate(ref.candidates):  # the exhaustive candidates come in the table's (worker id, rank) order
            assert (c.worker_id, c.dp_rank) == table.skeys[i]
            assert (bool(b.no_room[i]), int(b.decode[i]), int(b.cached[i])) == (c.no_room, c.decode_blocks, c.cached_blocks)
            if b.exact[i]:
                assert float(b.cost[i]) == c.cost and c.evicted_hot_blocks == 0
                exact_seen += 1
            else:
                assert float(b.cost[i]) <= c.cost
                inexact_seen += 1
    assert exact_seen and inexact_seen


def test_policy_order_is_the_lexicographic_order_of_the_bounds() -> None:
    """The first slots one minimum at a time, then sorts in chunks: together the policy's order, ties included."""
    from meshllm.router.policy.fleet import SELECT_STEPS, SORT_CHUNK, Bounds, FleetTable, policy_order

    rng = np.random.default_rng(5)
    for n, no_room, ties in [(200, 0.2, True), (200, 0.9, True), (300, 0.05, False), (40, 0.2, True), (500, 1.0, False)]:
        base = [PoolWorker(f"w{i:03d}", "", AGGREGATED, MODEL) for i in range(n)]
        table = FleetTable.build(base, {(w.id, 0): i for i, w in enumerate(base)}, 0)
        table.in_flight[:] = rng.integers(0, 3, n)
        cost = rng.integers(0, 6, n).astype(np.float64) / 2 if ties else rng.random(n)  # many ties, or none
        b = Bounds(
            no_room=rng.random(n) < no_room, cost=cost, decode=rng.integers(0, 4, n), cached=rng.integers(0, 3, n),
            exact=np.ones(n, dtype=np.bool_),
        )  # fmt: skip
        alive = rng.random(n) < 0.9
        want = sorted(
            np.flatnonzero(alive).tolist(),
            key=lambda i, b=b, t=table: (bool(b.no_room[i]), float(b.cost[i]), int(b.decode[i]), int(t.in_flight[i]),
                                         int(b.cached[i]), i),
        )  # fmt: skip
        got = list(policy_order(b, table, alive))
        assert got == want and len(got) > SELECT_STEPS
        assert n < 200 or len(want) > SELECT_STEPS + SORT_CHUNK  # the chunked sort is what orders most of them


def test_sizes_follow_every_change_of_a_slot() -> None:
    bmap = BlockMap()
    s = bmap.slot(("w", 0))
    bmap.add(s, [1, 2, 3, 3])
    assert bmap.sizes[s] == 3
    bmap.remove(s, [2, 9])
    assert bmap.sizes[s] == 2 == len(list(bmap.iter_blocks(s))) == len(bmap.blocks(s))
    bmap.clear_slot(s)
    assert bmap.sizes[s] == 0

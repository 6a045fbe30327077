"""Locks: the id-keyed `BlockMap` answers exactly as the hash-keyed one it replaced (tests/unit/blockmap_reference.py):
the same masks, eviction orders, reuse counts, overlaps, depth groups and hot victims after any mix of operations."""

from __future__ import annotations

import random

from blockmap_reference import ReferenceBlockMap

from meshllm.router.kv.blocks import BlockMap

KEYS = [(f"w{i}", r) for i in range(9) for r in range(2)]


def _state(m: BlockMap) -> tuple[object, ...]:
    live = sorted(m.slot_of.items())
    return (m.masks(), [(k, list(m.blocks(s).items())) for k, s in live], list(m.hot), list(m.sizes), len(m), m.generation)


def _ref_state(r: ReferenceBlockMap) -> tuple[object, ...]:
    live = sorted(r.slot_of.items())
    return (dict(r.masks), [(k, list(r.blocks[s].items())) for k, s in live], r.hot, r.sizes, len(r.masks), r.generation)


def _chain(rng: random.Random, pool: list[int]) -> list[int]:
    start = rng.randrange(len(pool))
    return pool[start : start + rng.randrange(1, 12)]


def _step(rng: random.Random, m: BlockMap, r: ReferenceBlockMap, pool: list[int], prompt: frozenset[int]) -> None:
    """One random operation on both maps (the same arguments), checking what each returns."""
    key = rng.choice(KEYS)
    op = rng.randrange(10)
    if op == 9:
        m.drop(key), r.drop(key)
        return
    s, t = m.slot(key), r.slot(key)
    assert s == t
    hashes = [rng.choice(pool) for _ in range(rng.randrange(0, 6))] if rng.random() < 0.3 else _chain(rng, pool)
    if op <= 2:
        assert m.add(s, hashes) == r.add(s, hashes)
    elif op == 3:
        assert m.remove(s, hashes) == r.remove(s, hashes)
    elif op <= 5:
        reused = rng.random() < 0.5
        m.touch(s, hashes, reused=reused), r.touch(s, hashes, reused=reused)
    elif op == 6:
        snapshot = hashes * rng.randrange(1, 3)  # duplicates too
        if rng.random() < 0.5:  # the slot's blocks from some point on, then others: events lost at the end
            held = list(r.blocks[s])
            snapshot = held[rng.randrange(len(held) + 1) :] + hashes
        assert m.replace(s, snapshot) == r.replace(s, snapshot)
    elif op == 7 and rng.random() < 0.2:
        assert m.clear_slot(s) == r.clear_slot(s)
    else:
        keep = set(rng.sample(pool, rng.randrange(0, 8)))
        if rng.random() < 0.5:  # one frozenset asked again and again while blocks come and go: ids kept, then not
            keep = prompt
        k = rng.randrange(0, 30)
        assert m.hot_victims(s, k, keep) == r.hot_victims(s, k, keep)


def test_the_id_keyed_map_matches_the_hash_keyed_one_after_random_operations() -> None:
    rng = random.Random(39)
    for _ in range(60):
        m, r = BlockMap(), ReferenceBlockMap()
        pool = [rng.getrandbits(64) for _ in range(rng.choice([8, 40, 200]))]
        prompt = frozenset(rng.sample(pool, min(len(pool), 6)))
        for _ in range(300):
            _step(rng, m, r, pool, prompt)
            probe = _chain(rng, pool)
            keys = rng.sample(KEYS, rng.randrange(1, len(KEYS)))
            assert m.overlaps(probe, keys) == r.overlaps(probe, keys)
            mask = rng.getrandbits(len(KEYS))
            assert m.overlap_groups(probe, mask) == r.overlap_groups(probe, mask)
            assert m.mask(probe[0]) == r.masks.get(probe[0], 0)
        assert _state(m) == _ref_state(r)
        for s in range(len(m.held)):
            assert list(m.iter_blocks(s)) == list(r.blocks[s])
            assert m.holding(s, pool) == set(pool) & r.blocks[s].keys()
            assert all(m.holds(s, h) == (h in r.blocks[s]) for h in pool)


def test_ids_of_blocks_nobody_holds_are_reused_and_id_0_stays_empty() -> None:
    m = BlockMap()
    a, b = m.slot(("a", 0)), m.slot(("b", 0))
    m.add(a, [10, 11, 12])
    m.add(b, [11])
    m.remove(a, [10, 11])
    assert m.masks() == {11: 1 << b, 12: 1 << a}
    assert len(m.keys) == 4 and m.bits[0] == 0 and m.mask(10) == 0 and m.mask(99) == 0
    m.add(b, [13])  # takes the id 10 had
    assert len(m.keys) == 4 and m.masks() == {11: 1 << b, 12: 1 << a, 13: 1 << b}
    m.clear_slot(a), m.drop(("b", 0))
    assert m.masks() == {} and m.bits == [0, 0, 0, 0] and list(m.keys) == [0] * 4

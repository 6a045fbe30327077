"""Locks: both block maps, the Python one (id-keyed dicts) and the compiled one (C), answer exactly as the hash-keyed
one they replaced (tests/unit/blockmap_reference.py): the same masks, eviction orders, reuse counts, overlaps, depth
groups and hot victims after any mix of operations."""

from __future__ import annotations

import random

import pytest
from blockmap_reference import ReferenceBlockMap

from meshllm.router.kv.blocks import BlockMap, PyBlockMap

try:
    from meshllm.router.kv.compiled import CBlockMap
except ImportError as e:  # the tests below fail, saying why; the Python map is still checked
    CBlockMap = None  # type: ignore[assignment,misc]
    BUILD_ERROR = str(e)
else:
    BUILD_ERROR = ""

MAPS = [PyBlockMap, CBlockMap]

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


def test_the_compiled_map_is_built_and_serves_the_index() -> None:
    """`make test` builds the C extension (pip install -e .): a router falls back to the Python map only where
    no compiler was found at install time."""
    assert CBlockMap is not None, f"the compiled KV index did not build: {BUILD_ERROR}"
    assert BlockMap is CBlockMap


@pytest.mark.parametrize("impl", MAPS, ids=["python", "compiled"])
def test_the_map_matches_the_hash_keyed_one_after_random_operations(impl: type[BlockMap] | None) -> None:
    if impl is None:
        pytest.fail(f"the compiled KV index did not build: {BUILD_ERROR}")
    rng = random.Random(39)
    for _ in range(60):
        m, r = impl(), ReferenceBlockMap()
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
        for s in range(len(m.sizes)):
            assert list(m.iter_blocks(s)) == list(r.blocks[s])
            assert m.oldest(s, 3) == list(r.blocks[s])[:3] and m.oldest(s, -1) == []
            assert m.holding(s, pool) == set(pool) & r.blocks[s].keys()
            assert all(m.holds(s, h) == (h in r.blocks[s]) for h in pool)


def test_ids_of_blocks_nobody_holds_are_reused_and_id_0_stays_empty() -> None:
    m = PyBlockMap()
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


@pytest.mark.parametrize("impl", MAPS, ids=["python", "compiled"])
def test_a_wide_fleet_walks_the_same_with_few_candidates_and_with_all(impl: type[BlockMap] | None) -> None:
    """200 slots share a template prefix, some share documents after it: masks of a few candidates against blocks
    every slot holds (the compiled walk searches the holders then), and of every slot."""
    if impl is None:
        pytest.fail(f"the compiled KV index did not build: {BUILD_ERROR}")
    rng = random.Random(7)
    m, r = impl(), ReferenceBlockMap()
    template = [rng.getrandbits(64) for _ in range(4)]
    docs = [[rng.getrandbits(64) for _ in range(rng.randrange(1, 9))] for _ in range(12)]
    keys = [(f"w{i}", 0) for i in range(200)]
    for key in keys:
        chain = template + rng.choice(docs) + [rng.getrandbits(64) for _ in range(rng.randrange(0, 4))]
        chain = chain[: rng.randrange(1, len(chain) + 1)]
        assert m.add(m.slot(key), chain) == r.add(r.slot(key), chain)
    for _ in range(300):
        probe = template + rng.choice(docs) + [rng.getrandbits(64)]
        mask = 0
        for _ in range(rng.choice([1, 2, 3, 50, 200])):
            mask |= 1 << rng.randrange(200)
        assert m.overlap_groups(probe, mask) == r.overlap_groups(probe, mask)
        some = rng.sample(keys, rng.randrange(1, 200))
        assert m.overlaps(probe, some) == r.overlaps(probe, some)
    for key in rng.sample(keys, 100):
        m.drop(key), r.drop(key)
    assert _state(m) == _ref_state(r)


@pytest.mark.parametrize("impl", MAPS, ids=["python", "compiled"])
def test_hashes_span_64_bits_and_bad_ones_are_refused(impl: type[BlockMap] | None) -> None:
    if impl is None:
        pytest.fail(f"the compiled KV index did not build: {BUILD_ERROR}")
    m = impl()
    s = m.slot(("a", 0))
    assert m.add(s, [0, 1, 2**64 - 1, 2**63]) == 4
    assert list(m.iter_blocks(s)) == [0, 1, 2**64 - 1, 2**63] and m.mask(2**64 - 1) == 1
    if impl is CBlockMap:  # the Python map takes any int; the compiled one says what a hash is
        with pytest.raises(OverflowError, match="unsigned 64-bit"):
            m.add(s, [-1])
        with pytest.raises(OverflowError, match="unsigned 64-bit"):
            m.add(s, [2**64])
        with pytest.raises(TypeError):
            m.add(s, ["x"])  # type: ignore[list-item]
        with pytest.raises(OverflowError):
            m.add(s, [5, 6, -1])
        with pytest.raises(OverflowError):
            m.remove(s, [0, -1])
        assert m.count(("a", 0)) == 4 and len(m) == 4 and m.sizes[s] == 4  # a bad hash anywhere changes nothing


def test_the_compiled_walk_refuses_a_negative_or_non_int_mask() -> None:
    if CBlockMap is None:
        pytest.fail(f"the compiled KV index did not build: {BUILD_ERROR}")
    m = CBlockMap()
    m.add(m.slot(("a", 0)), [1, 2])
    with pytest.raises(ValueError, match="not negative"):
        m.overlap_groups([1, 2], -1)
    with pytest.raises(TypeError, match="is an int"):
        m.overlap_groups([1, 2], 1.0)  # type: ignore[arg-type]
    assert m.overlap_groups([1, 2], 1) == [(2, 1)] and m.overlap_groups([1, 2], 0) == []


def test_a_python_index_made_without_the_extension_says_why_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the extension was not built, the first index a process makes logs why (not every command's import)."""
    import meshllm.router.kv.blocks as blocks

    monkeypatch.setattr(blocks, "COMPILED_ERROR", "No module named 'meshllm.router.kv._blockcore'")
    monkeypatch.setattr(blocks, "_warned", False)
    monkeypatch.setattr(blocks, "BlockMap", PyBlockMap)
    with caplog.at_level("WARNING", logger="meshllm.router.kv.blocks"):
        assert isinstance(blocks.block_map(), PyBlockMap)
        assert isinstance(blocks.block_map(), PyBlockMap)
    said = [r.getMessage() for r in caplog.records if "compiled KV index is not built" in r.getMessage()]
    assert len(said) == 1 and "_blockcore" in said[0]

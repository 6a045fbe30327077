"""TierStore: the llamacpp engine's host and disk tiers — budgets, LRU order, events, files (no llama.cpp needed).

The state bytes here are opaque payloads: the store never interprets them, so
budgets, eviction order and file validation are checked without a model.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from meshllm.engine.base import KvTier
from meshllm.engine.llamacpp import kvfile
from meshllm.engine.llamacpp.slots import BlocksRemoved, BlocksStored
from meshllm.engine.llamacpp.tiers import TierStore
from meshllm.protocol.kv import stored_blocks

BS = 4
LAYOUT = "llamacpp-test/0000/1x1/k1v1/fa"


def prefix(first: int, n_blocks: int) -> tuple[list[int], list[tuple[int, int]]]:
    tokens = list(range(first, first + n_blocks * BS))
    return tokens, stored_blocks(tokens, BS)


def state(n: int, fill: int = 7) -> bytes:
    return bytes([fill]) * n


def held(store: TierStore, tier: KvTier) -> set[int]:
    """Block hashes `tier` holds according to its events so far."""
    blocks: set[int] = set()
    for ev in store.drain_events():
        if ev.tier is not tier:
            continue
        if isinstance(ev, BlocksStored):
            blocks |= {bh for bh, _ in ev.blocks}
        elif isinstance(ev, BlocksRemoved):
            blocks -= set(ev.block_hashes)
    return blocks


def test_the_host_tier_never_exceeds_its_budget_and_evicts_least_recently_used_first() -> None:
    """Locks: host bytes stay ≤ budget; eviction drops the LRU prefix; a hit (touch) protects a prefix."""
    store = TierStore(block_size=BS, layout=LAYOUT, host_bytes=3000)
    prefixes = [prefix(1000 * i, 2) for i in range(6)]
    assert store.host is not None
    for tokens, blocks in prefixes[:3]:
        store.save(tokens, blocks, state(1000))
        assert store.host.used <= 3000
    hit = store.lookup(prefixes[0][0] + [5])
    assert hit is not None and hit.tier is KvTier.HOST and hit.n_tokens == 2 * BS
    store.restored(hit, state(1000), 0.001)  # prefix 0 becomes the most recent
    for tokens, blocks in prefixes[3:5]:
        store.save(tokens, blocks, state(1000))
        assert store.host.used <= 3000
    kept = [p for p in range(5) if store.lookup(prefixes[p][0]) is not None]
    assert kept == [0, 3, 4]  # 1 and 2 were least recently used
    (usage,) = store.usage()
    assert (usage.tier, usage.bytes_used, usage.bytes_capacity, usage.blocks) == (KvTier.HOST, 3000, 3000, 6)
    assert usage.restore_bytes_per_s == pytest.approx(1000 / 0.001)


def test_a_prefix_bigger_than_the_budget_is_not_kept() -> None:
    """Locks: a single blob over the budget is refused rather than evicting everything for nothing."""
    store = TierStore(block_size=BS, layout=LAYOUT, host_bytes=500)
    tokens, blocks = prefix(0, 2)
    store.save(tokens, blocks, state(501))
    assert store.lookup(tokens) is None and store.usage()[0].bytes_used == 0


def test_events_carry_the_tier_and_the_chain_and_a_longer_prefix_replaces_the_one_it_extends() -> None:
    """Locks: a saved prefix is stored in HOST with chained hashes; an extension replaces it without re-storing shared blocks."""
    store = TierStore(block_size=BS, layout=LAYOUT, host_bytes=10_000)
    tokens, blocks = prefix(0, 4)
    store.save(tokens[: 2 * BS], blocks[:2], state(200))
    (ev,) = store.drain_events()
    assert ev == BlocksStored(blocks[:2], None, KvTier.HOST)
    store.save(tokens, blocks, state(400))
    assert store.drain_events() == [BlocksStored(blocks[2:], blocks[1][0], KvTier.HOST)]  # the shorter blob left silently
    assert store.host is not None and len(store.host) == 1 and store.host.used == 400
    store.save(tokens[: 3 * BS], blocks[:3], state(300))  # already covered: nothing new is kept
    assert store.drain_events() == [] and store.host.used == 400
    hit = store.lookup([*tokens[: 3 * BS], 999, 998, 997, 996])
    assert hit is not None and hit.n_blocks == 3 and hit.blob.key == blocks[-1][0]


def test_the_disk_tier_never_exceeds_its_budget_evicts_lru_files_and_keeps_one_file_per_prefix(tmp_path: Path) -> None:
    """Locks: disk bytes (file sizes) stay ≤ budget; evicted prefixes' files are deleted, oldest first."""
    store = TierStore(block_size=BS, layout=LAYOUT, disk_dir=tmp_path, disk_bytes=4000)
    assert store.disk is not None
    prefixes = [prefix(1000 * i, 2) for i in range(5)]
    for tokens, blocks in prefixes:
        store.save(tokens, blocks, state(1000))
        on_disk = sum(p.stat().st_size for p in tmp_path.iterdir())
        assert on_disk == store.disk.used <= 4000
    kept = [p for p in range(5) if store.lookup(prefixes[p][0]) is not None]
    assert kept == [2, 3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kvfile.file_name(prefixes[p][1][-1][0]) for p in kept)
    assert held(store, KvTier.DISK) == {bh for p in kept for bh, _ in prefixes[p][1]}


def test_a_restart_scans_valid_files_and_skips_corrupt_and_foreign_ones_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Locks: files survive; a new store advertises them as DISK blocks; garbage, truncated and other-layout files are skipped."""
    first = TierStore(block_size=BS, layout=LAYOUT, disk_dir=tmp_path, disk_bytes=1 << 20)
    a, b = prefix(0, 3), prefix(500, 2)
    first.save(*a, state(300, 1))
    first.save(*b, state(200, 2))
    (tmp_path / "garbage.mlkv").write_bytes(b"not a kv file at all")
    good = (tmp_path / kvfile.file_name(b[1][-1][0])).read_bytes()
    (tmp_path / "truncated.mlkv").write_bytes(good[:-10])
    other = TierStore(block_size=BS, layout="another-model", disk_dir=tmp_path / "o", disk_bytes=1 << 20)
    (tmp_path / "o").mkdir(exist_ok=True)
    other.save(*prefix(900, 2), state(100))
    (tmp_path / "o" / kvfile.file_name(prefix(900, 2)[1][-1][0])).rename(tmp_path / "foreign.mlkv")
    (tmp_path / ".tmp-1-x.mlkv").write_bytes(b"half")  # an interrupted write
    with caplog.at_level(logging.WARNING, logger="meshllm.engine.llamacpp"):
        again = TierStore(block_size=BS, layout=LAYOUT, disk_dir=tmp_path, disk_bytes=1 << 20)
        again.scan()
    skipped = {r.getMessage().split(": ")[1].rsplit("/", 1)[-1] for r in caplog.records if "skipping" in r.getMessage()}
    assert skipped == {"garbage.mlkv", "truncated.mlkv", "foreign.mlkv"}
    assert not (tmp_path / ".tmp-1-x.mlkv").exists()
    assert held(again, KvTier.DISK) == {bh for bh, _ in a[1] + b[1]}
    hit = again.lookup(a[0] + [1])
    assert hit is not None and hit.tier is KvTier.DISK and again.fetch(hit) == state(300, 1)
    again.close()


def test_a_file_corrupted_after_the_scan_is_dropped_at_restore_not_loaded(tmp_path: Path) -> None:
    """Locks: the state's hash is checked when read; a mismatch drops the prefix (DISK removed event) and returns None."""
    store = TierStore(block_size=BS, layout=LAYOUT, disk_dir=tmp_path, disk_bytes=1 << 20)
    tokens, blocks = prefix(0, 2)
    store.save(tokens, blocks, state(300))
    store.drain_events()
    path = tmp_path / kvfile.file_name(blocks[-1][0])
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    hit = store.lookup(tokens)
    assert hit is not None and store.fetch(hit) is None
    assert store.drain_events() == [BlocksRemoved([bh for bh, _ in blocks], KvTier.DISK)]
    assert store.lookup(tokens) is None and not path.exists()


def test_a_disk_hit_is_promoted_into_host_memory_and_clear_empties_every_tier(tmp_path: Path) -> None:
    """Locks: restoring from disk copies the prefix into the host tier; clear() drops both tiers and the files."""
    store = TierStore(block_size=BS, layout=LAYOUT, host_bytes=250, disk_dir=tmp_path, disk_bytes=1 << 20)
    a, b = prefix(0, 2), prefix(100, 2)
    store.save(*a, state(200, 1))
    store.save(*b, state(200, 2))  # pushes a out of the 250-byte host tier; disk keeps both
    hit = store.lookup(a[0])
    assert hit is not None and hit.tier is KvTier.DISK
    data = store.fetch(hit)
    assert data == state(200, 1)
    store.restored(hit, data, 0.01)
    again = store.lookup(a[0])
    assert again is not None and again.tier is KvTier.HOST
    store.drain_events()
    assert store.clear() == 2 + 4
    assert held(store, KvTier.HOST) == set() and list(tmp_path.iterdir()) == []


def test_a_disk_directory_serves_one_engine_at_a_time(tmp_path: Path) -> None:
    """Locks: a second store scanning a directory another one holds stops with a one-line ConfigError; close releases it."""
    from meshllm.config import ConfigError

    first = TierStore(block_size=BS, layout=LAYOUT, disk_dir=tmp_path, disk_bytes=1 << 20)
    first.scan()
    second = TierStore(block_size=BS, layout=LAYOUT, disk_dir=tmp_path, disk_bytes=1 << 20)
    with pytest.raises(ConfigError, match="in use by another worker") as info:
        second.scan()
    assert "\n" not in str(info.value)
    first.close()
    second.scan()
    second.close()

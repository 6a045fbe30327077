"""The peer prefix pull rule (router/kv/pull.py) with small numbers, and the prefix handle format.

Locks: pull_ms = Σ lower-tier blocks × restore ms + blocks × block_bytes / bandwidth,
recompute_ms = (blocks − local_blocks) × prefill ms per block; the pull is taken
only when strictly cheaper, the peer saving most wins, unknown figures never
pull, peers holding no more than the chosen worker are not considered; the
prefix handle round-trips and other handles are not taken for one.
"""

from __future__ import annotations

import pytest

from meshllm.protocol.kv import PREFIX_MAGIC, parse_prefix_handle, prefix_handle
from meshllm.router.kv.pull import PeerPrefix, decide_pull
from meshllm.router.policy.timing import RestoreCost
from meshllm.v1 import events_pb2

HOST, DISK = events_pb2.KV_TIER_HOST, events_pb2.KV_TIER_DISK
MB = 1_000_000


def peer(name: str, device: int, host: int = 0, *, restore_ms: float = 1.0, block_bytes: int = MB) -> PeerPrefix:
    lower = {HOST: host} if host else {}
    restore = (RestoreCost(HOST, restore_ms, restore_ms / 10.0),) if host else ()
    return PeerPrefix(name, f"{name}:1", device, lower, restore, block_bytes)


def test_pull_is_taken_when_restore_plus_transfer_beats_recompute() -> None:
    # 10 blocks (4 device, 6 host at 1 ms), 1 MB each over 1 GB/s: 6 + 10 = 16 ms; recompute (10 - 2) x 10 ms = 80 ms.
    d = decide_pull([peer("a", 4, 6)], local_blocks=2, block_ms=10.0, bytes_per_s=1e9)
    assert d is not None and d.chosen and d.reason == ""
    assert d.restore_ms == pytest.approx(6.0) and d.transfer_ms == pytest.approx(10.0)
    assert d.pull_ms == pytest.approx(16.0) and d.recompute_ms == pytest.approx(80.0)
    proto = d.to_proto()
    assert proto.chosen and proto.blocks == 10 and proto.device_blocks == 4 and proto.local_blocks == 2
    assert [(t.tier, t.blocks, t.restore_ms_per_block) for t in proto.lower_tiers] == [(HOST, 6, 1.0)]
    assert d.peer.tier == HOST


def test_recompute_wins_when_it_is_cheaper_or_equal() -> None:
    # The same peer over 0.1 GB/s: 6 + 100 = 106 ms against 80 ms.
    d = decide_pull([peer("a", 4, 6)], local_blocks=2, block_ms=10.0, bytes_per_s=1e8)
    assert d is not None and not d.chosen and d.reason == "recompute is cheaper"
    assert d.pull_ms == pytest.approx(106.0) and d.recompute_ms == pytest.approx(80.0)
    # Exactly equal: 10 device blocks over 1 GB/s = 10 ms; recompute 1 block x 10 ms = 10 ms -> no pull.
    d = decide_pull([peer("b", 10)], local_blocks=9, block_ms=10.0, bytes_per_s=1e9)
    assert d is not None and not d.chosen and d.transfer_ms == pytest.approx(10.0) and d.recompute_ms == pytest.approx(10.0)


def test_the_peer_saving_most_wins_and_shallower_peers_are_not_considered() -> None:
    deep_slow = peer("deep", 0, 20, restore_ms=3.0)  # 60 + 20 = 80 ms for 20 blocks: saves 200 - 80 = 120
    shallow_fast = peer("shallow", 12)  # 12 ms for 12 blocks: saves 120 - 12 = 108
    held = peer("held", 2)  # no more than the chosen worker serves
    d = decide_pull([shallow_fast, deep_slow, held], local_blocks=2, block_ms=10.0, bytes_per_s=1e9)
    assert d is not None and d.chosen and d.peer.worker_id == "deep"
    assert decide_pull([held], local_blocks=2, block_ms=10.0, bytes_per_s=1e9) is None


def test_unknown_figures_never_pull() -> None:
    d = decide_pull([peer("a", 10)], local_blocks=0, block_ms=0.0, bytes_per_s=1e9)
    assert d is not None and not d.chosen and d.reason == "prefill time per block not measured yet"
    d = decide_pull([peer("a", 10, block_bytes=0)], local_blocks=0, block_ms=10.0, bytes_per_s=1e9)
    assert d is not None and not d.chosen and d.reason == "peer advertises no KV block size"


def test_an_unadvertised_restore_time_falls_back_to_the_ratio_times_the_prefill_block() -> None:
    p = PeerPrefix("a", "a:1", 0, {DISK: 5}, (RestoreCost(DISK, 0.0, 0.3),), MB)
    d = decide_pull([p], local_blocks=0, block_ms=10.0, bytes_per_s=1e9)
    assert d is not None and d.restore_ms == pytest.approx(5 * 0.3 * 10.0) and d.peer.tier == DISK


def test_prefix_handles_round_trip_and_other_handles_are_not_prefix_handles() -> None:
    h = prefix_handle(16, [1, 2**64 - 1, 3])
    assert h.startswith(PREFIX_MAGIC) and parse_prefix_handle(h) == (16, [1, 2**64 - 1, 3])
    assert parse_prefix_handle(b"opaque-engine-handle") is None
    assert parse_prefix_handle(h[:-1]) is None  # not a whole number of hashes
    assert parse_prefix_handle(PREFIX_MAGIC + b"\0\0\0\0" + b"\1" * 8) is None  # block size 0
    with pytest.raises(ValueError):
        prefix_handle(16, [])

"""bench/fleet.py's pure parts: trace renaming, block chains, the simulated workers' event streams, verdicts."""

from __future__ import annotations

import random

import pytest
from bench_support import load_bench as load

from meshllm.protocol.kv import block_hashes
from meshllm.router.kv.index import KvIndex
from meshllm.v1 import events_pb2, worker_pb2

ROWS = [[0, 1, 2, 3], [0, 1, 4], [0, 5, 6, 7, 8], [0, 9], [0, 1, 2, 10, 11]]


def test_shared_ids_count_each_row_once() -> None:
    fleet = load("fleet")
    assert fleet.shared_ids(ROWS, 1.0) == {0}
    assert fleet.shared_ids(ROWS, 0.6) == {0, 1}  # in 3 of 5 rows
    assert fleet.shared_ids([[7, 7, 7], [8]], 0.6) == set()  # a repeated id in one row is one row


def test_renamed_ids_keep_shared_ones_and_separate_copies() -> None:
    fleet = load("fleet")
    shared = {0}
    a, b = fleet.renamed([0, 1, 2], 0, shared), fleet.renamed([0, 1, 2], 3, shared)
    assert a[0] == b[0] == 0
    stride = load("fleet_sim").COPY_STRIDE
    assert a[1:] == [1, 2] and b[1:] == [3 * stride + 1, 3 * stride + 2]
    assert not set(a[1:]) & set(b[1:])


def test_summary_uses_the_harness_percentiles() -> None:
    fleet = load("fleet")
    values = [float(v) for v in range(1, 101)]
    assert fleet.summary(values) == {"p50": 50.5, "p90": pytest.approx(90.1), "p99": pytest.approx(99.01)}


def test_chains_are_the_block_hashes_of_the_prompt_a_route_request_sends() -> None:
    fleet = load("fleet")
    chains = fleet.BlockChains(fleet.TraceScale(tokens_per_block=fleet.BLOCK_SIZE))
    ids = [0, 12, 7, 12]
    tokens = chains.tokens(ids)
    assert len(tokens) == 4 * fleet.BLOCK_SIZE
    assert [bh for bh, _ in chains.chain(ids)] == block_hashes(tokens, fleet.BLOCK_SIZE)
    assert chains.chain([0, 12])[1] != chains.chain([7, 12])[1]  # chained: the same id after another prefix differs


def test_a_filled_worker_holds_exactly_its_capacity_and_its_events_rebuild_it() -> None:
    fleet = load("fleet")
    chains = fleet.BlockChains(fleet.TraceScale(tokens_per_block=fleet.BLOCK_SIZE))
    rng = random.Random(1)
    rows = [[0, *(rng.randrange(1, 400) for _ in range(rng.randrange(1, 30)))] for _ in range(200)]
    w = fleet.SimWorker("w1", copy=2)
    w.fill(rows, {0}, chains, 300, random.Random(5))
    assert len(w.cache) == 300 and w.block_events == 300
    index = KvIndex()
    index.add_worker("w1")
    index.apply_snapshot(worker_pb2.KvSnapshot(worker_id="w1", last_event_id=0))
    for data, n in w.batches:
        batch = events_pb2.KvEventBatch.FromString(data)
        assert 1 <= len(batch.events) <= load("fleet_sim").EVENTS_PER_BATCH
        assert n == sum(len(ev.stored.block_hashes) for ev in batch.events)
        assert not index.apply_batch(batch)  # ids contiguous: no gap
    assert index.last_event_id("w1") == w.event_id
    assert set(index.map.blocks(index.map.slot_of[("w1", 0)])) == set(w.cache)
    # churn: n out (oldest), n in, one removed and one stored event; the snapshot says the same
    oldest = list(w.cache)[:5]
    w.batches = []
    w.churn(5, chains.chain([load("fleet_sim").COPY_STRIDE * 50 + k for k in range(5)]))
    ((data, n),) = w.batches
    assert n == 10 and not index.apply_batch(events_pb2.KvEventBatch.FromString(data))
    assert not set(oldest) & set(w.cache) and len(w.cache) == 300
    w.build_snapshot()
    snap = worker_pb2.KvSnapshot.FromString(w.snapshot)
    assert snap.last_event_id == w.event_id and list(snap.ranks[0].block_hashes) == list(w.cache)


def test_interleave_keeps_each_workers_order() -> None:
    fleet = load("fleet")
    a, b = fleet.SimWorker("a", 0), fleet.SimWorker("b", 0)
    a.batches = [(b"a1", 1), (b"a2", 1), (b"a3", 1)]
    b.batches = [(b"b1", 1)]
    assert [d for d, _ in fleet.interleave([a, b])] == [b"a1", b"b1", b"a2", b"a3"]


def test_verdicts_and_render() -> None:
    fleet = load("fleet")
    r = {
        "workers": 1024, "blocks_per_worker": 16384, "decision_ms": {"p50": 0.4, "p90": 0.6, "p99": 0.9},
        "route_rpc_ms": {"p50": 1.5, "p90": 2.0, "p99": 3.0}, "exhaustive_ms": {"p50": 80.0, "p90": 90.0, "p99": 95.0},
        "walk_ms": {"p50": 0.1, "p90": 0.1, "p99": 0.2}, "candidates_scored_median": 1, "events_per_s": 400_000.0,
        "in_process_events_per_s": 500_000.0, "resubscribed_s": 1.0, "load": [1.0, 2.0],
        "bytes_per_pair": 150.0, "resync_one_s": 0.02, "resync_all_s": 12.0, "replica_agreement": 1.0,
        "replica_same_index": True, "exhaustive_agreement": 1.0, "dynamo": "dynamo._core.RadixTree not importable",
    }  # fmt: skip
    r["targets"] = fleet.verdicts(r)
    assert r["targets"] == {"decision_p99_ms": True, "events_per_s": False, "bytes_per_pair": False, "resync_all_s": False}
    text = fleet.render([r])
    assert text.startswith("## Fleet routing")
    assert "1,024 × 16,384" in text and "not importable" in text and "1.0 s of it reconnecting" in text
    assert "1,024 workers: 1-minute load average 1.0–2.0" in text and "Dynamo" in text
    figures = [line for line in text.splitlines() if line.startswith("|") and "p50" in line]
    assert figures and all("p90" in line and "p99" in line for line in figures)
    dynamo = {"walk_ms": {"p50": 0.1, "p90": 0.2, "p99": 0.3}, "find_matches_ms": {"p50": 0.1, "p90": 0.2, "p99": 0.25}}
    r["dynamo"] = {**dynamo, "walk_dict_ms": {"p50": 0.4, "p90": 0.5, "p99": 0.6}, "same_overlaps": 1.0}
    row = fleet.render([r]).splitlines()[-1]
    assert "0.100 / 0.200 / 0.300 (0.400 / 0.500 / 0.600 as a dict)" in row and "**missed** (p99)" in row
    reuse = {"workers": 256, "blocks_per_worker": 16384, "decision_ms": r["decision_ms"], "targets": {}}
    reuse["reused"] = {
        "hot_share": 0.5, "scored": {"p50": 1, "p90": 2, "p99": 6}, "decision_ms": {"p50": 0.2, "p90": 0.3, "p99": 1.1},
        "exhaustive_ms": {"p50": 5.0, "p90": 12.0, "p99": 32.0}, "exhaustive_agreement": 1.0,
    }  # fmt: skip
    text = fleet.render([r, reuse])  # an in-process-only run adds the reuse table and no row of the process table
    assert text.count("| 256 × 16,384 |") == 1 and "| 256 × 16,384 | 50 % | 0.20 / 0.30 / 1.10 (**missed**) | 1 / 2 / 6 |" in text

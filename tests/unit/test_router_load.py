"""Load accounting: charges added on route, released on prefill/completion, corrected by LoadSnapshots, shared by replicas."""

from __future__ import annotations

import time

from meshllm.router.policy.load import LoadTracker
from meshllm.router.sync import ReplicaSync
from meshllm.v1 import events_pb2


def test_route_charges_blocks_and_prefill_tokens_until_released() -> None:
    t = LoadTracker()
    t.route("r", "q1", ("a", 0), prefill_tokens=100, blocks=8, now=0)
    t.route("r", "q2", ("a", 0), prefill_tokens=50, blocks=4, now=0)
    load = t.get(("a", 0))
    assert (load.active_blocks, load.queued_prefill_tokens, load.in_flight, load.prefilling) == (12, 150, 2, 2)
    t.prefill_done("r", "q1")
    t.prefill_done("r", "q1")  # idempotent
    assert (t.get(("a", 0)).queued_prefill_tokens, t.get(("a", 0)).prefilling) == (50, 1)
    t.complete("r", "q1")
    t.complete("r", "q2")
    t.complete("r", "q2")  # idempotent
    load = t.get(("a", 0))
    assert (load.active_blocks, load.queued_prefill_tokens, load.in_flight, load.prefilling) == (0, 0, 0, 0)


def test_a_cancelled_request_releases_its_prefill_tokens_too() -> None:
    t = LoadTracker()
    t.route("r", "q", ("a", 0), prefill_tokens=100, blocks=8, now=0)
    t.complete("r", "q")
    assert t.get(("a", 0)).queued_prefill_tokens == 0 and t.get(("a", 0)).prefilling == 0


def test_a_load_snapshot_becomes_the_base_and_later_charges_adjust_it() -> None:
    t = LoadTracker()
    t.route("r", "q1", ("a", 0), prefill_tokens=0, blocks=10, now=0)
    t.route("r", "q2", ("a", 0), prefill_tokens=0, blocks=10, now=0)
    assert t.get(("a", 0)).active_blocks == 20
    # the worker shares prefix blocks: it reports 12 where the router guessed 20
    t.apply_snapshot(events_pb2.LoadSnapshot(worker_id="a", active_blocks=12, total_blocks=100, waiting=1, running=2), now=10)
    assert t.get(("a", 0)).active_blocks == 12
    t.route("r", "q3", ("a", 0), prefill_tokens=0, blocks=3, now=0)
    assert t.get(("a", 0)).active_blocks == 15
    t.complete("r", "q1")
    assert t.get(("a", 0)).active_blocks == 5
    t.complete("r", "q2")
    assert t.get(("a", 0)).active_blocks == 0  # never negative
    w = t.worker("a")
    assert w.reported is not None and (w.reported.total_blocks, w.reported.waiting, w.reported.running) == (100, 1, 2)


def test_charges_made_after_a_snapshot_was_taken_stay_on_top_of_it_whatever_the_arrival_order() -> None:
    """Locks: replica agreement — the view does not depend on whether a charge or the snapshot arrived first."""
    snap = events_pb2.LoadSnapshot(worker_id="a", active_blocks=30, total_blocks=100, timestamp_ms=10_000)
    views = []
    for charge_first in (True, False):
        t = LoadTracker()
        t.route("r", "old", ("a", 0), prefill_tokens=0, blocks=30, now=9.5)  # reflected in the snapshot
        if charge_first:
            t.route("r2", "new", ("a", 0), prefill_tokens=0, blocks=7, now=10.01)
            t.apply_snapshot(snap, now=10.02)
        else:
            t.apply_snapshot(snap, now=10.02)
            t.route("r2", "new", ("a", 0), prefill_tokens=0, blocks=7, now=10.01)
        views.append(t.get(("a", 0)).active_blocks)
    assert views == [37, 37]


def test_a_snapshot_from_a_skewed_clock_counts_as_taken_on_arrival() -> None:
    t = LoadTracker()
    t.route("r", "q", ("a", 0), prefill_tokens=0, blocks=5, now=99.0)
    t.apply_snapshot(events_pb2.LoadSnapshot(worker_id="a", active_blocks=40, total_blocks=100, timestamp_ms=5_000), now=100.0)
    assert t.get(("a", 0)).active_blocks == 40


def test_a_snapshot_stops_counting_once_every_request_on_the_worker_ended() -> None:
    t = LoadTracker()
    t.route("r", "q", ("a", 0), prefill_tokens=0, blocks=10, now=0.0)
    t.apply_snapshot(events_pb2.LoadSnapshot(worker_id="a", active_blocks=80, total_blocks=100), now=1.0)
    assert t.get(("a", 0)).active_blocks == 80
    t.complete("r", "q")
    assert t.get(("a", 0)).active_blocks == 0


def test_a_snapshot_taken_before_the_last_request_ended_but_arriving_after_counts_nothing() -> None:
    """Locks: a late snapshot does not resurrect the blocks of a finished request (kv routing would avoid the worker
    that just cached the prompt until the next snapshot)."""
    t = LoadTracker()
    t.route("r", "q", ("a", 0), prefill_tokens=0, blocks=4, now=100.0)
    t.complete("r", "q", now=100.05)
    t.apply_snapshot(events_pb2.LoadSnapshot(worker_id="a", active_blocks=4, total_blocks=100, timestamp_ms=100_040), now=100.06)
    assert t.get(("a", 0)).active_blocks == 0
    # A snapshot taken after the end counts again: what it reports is the worker's own view.
    t.apply_snapshot(events_pb2.LoadSnapshot(worker_id="a", active_blocks=2, total_blocks=100, timestamp_ms=100_070), now=100.08)
    assert t.get(("a", 0)).active_blocks == 2


def test_a_late_snapshot_loses_the_blocks_of_requests_that_ended_after_it_was_taken() -> None:
    t = LoadTracker()
    t.route("r", "long", ("a", 0), prefill_tokens=0, blocks=10, now=100.0)
    t.route("r", "short", ("a", 0), prefill_tokens=0, blocks=4, now=100.0)
    t.complete("r", "short", now=100.5)
    t.apply_snapshot(events_pb2.LoadSnapshot(worker_id="a", active_blocks=13, total_blocks=100, timestamp_ms=100_400), now=100.6)
    assert t.get(("a", 0)).active_blocks == 9  # the worker's 13 shared blocks, less the 4 freed since
    t.complete("r", "long", now=100.7)
    assert t.get(("a", 0)).active_blocks == 0


def test_stale_charges_expire_and_removed_workers_are_forgotten() -> None:
    t = LoadTracker()
    t.route("other", "q1", ("a", 0), prefill_tokens=5, blocks=5, now=0)
    t.route("r", "q2", ("b", 0), prefill_tokens=5, blocks=5, now=500)
    assert t.expire(now=700, max_age_s=600) == 1
    assert t.get(("a", 0)).active_blocks == 0
    t.remove_worker("b")
    assert t.charges() == 0 and t.get(("b", 0)).in_flight == 0


def test_a_replica_applies_another_replicas_events_and_ignores_none() -> None:
    t = LoadTracker()
    sync = ReplicaSync.__new__(ReplicaSync)
    sync.load = t
    kind = events_pb2.RouterSyncEvent
    sync.apply("r2", kind(request_id="q", kind=kind.KIND_ROUTED, worker_id="a", prefill_tokens=64, blocks=6))
    assert (t.get(("a", 0)).active_blocks, t.get(("a", 0)).queued_prefill_tokens) == (6, 64)
    sync.apply("r2", kind(request_id="q", kind=kind.KIND_PREFILL_DONE, worker_id="a"))
    assert t.get(("a", 0)).queued_prefill_tokens == 0
    sync.apply("r2", kind(request_id="q", kind=kind.KIND_COMPLETED, worker_id="a"))
    assert t.get(("a", 0)).active_blocks == 0
    sync.apply("r2", kind(request_id="x", kind=kind.KIND_UNSPECIFIED, worker_id="a"))
    assert t.charges() == 0


def test_a_replica_charges_a_routed_event_at_its_origins_time_not_at_its_arrival() -> None:
    """Locks: replica agreement across a batch's delay — both replicas compare the same charge time with a snapshot's."""
    kind = events_pb2.RouterSyncEvent
    at_ms = int((time.time() - 0.010) * 1000)  # routed 10 ms ago: the batch arrives now
    origin, other = LoadTracker(), LoadTracker()
    origin.route("r1", "q", ("a", 0), prefill_tokens=0, blocks=7, now=at_ms / 1000.0)
    sync = ReplicaSync.__new__(ReplicaSync)
    sync.load = other
    sync.apply("r1", kind(request_id="q", kind=kind.KIND_ROUTED, worker_id="a", blocks=7, routed_at_ms=at_ms))
    # Taken 23 ms after the charge: with ADMISSION_S (20 ms) the snapshot already counts the request.
    snap = events_pb2.LoadSnapshot(worker_id="a", active_blocks=30, total_blocks=100, timestamp_ms=at_ms + 23)
    for tracker in (origin, other):
        tracker.apply_snapshot(snap, now=at_ms / 1000.0 + 0.024)
    assert origin.get(("a", 0)).active_blocks == other.get(("a", 0)).active_blocks == 30

    # A time from a clock an hour off counts as the arrival time: the charge is not an hour old.
    sync.apply("r1", kind(request_id="skewed", kind=kind.KIND_ROUTED, worker_id="b", blocks=5, routed_at_ms=at_ms - 3_600_000))
    assert other.expire(time.time(), max_age_s=60.0) == 0 and other.get(("b", 0)).active_blocks == 5


def test_a_replica_releases_a_completed_event_at_its_origins_time_whatever_the_arrival_order() -> None:
    """Locks: replica agreement — the origin released a request before a snapshot was taken, the other replica hears
    of it after the snapshot arrived; both see the snapshot alone (it freed those blocks already), none twice."""
    kind = events_pb2.RouterSyncEvent
    now = time.time()
    snap = events_pb2.LoadSnapshot(worker_id="a", active_blocks=12, total_blocks=100, timestamp_ms=int(now * 1000))
    ended_ms = int(now * 1000) - 30  # 30 ms before the snapshot was taken
    origin, other = LoadTracker(), LoadTracker()
    sync = ReplicaSync.__new__(ReplicaSync)
    sync.load = other
    for tracker in (origin, other):
        tracker.route("r1", "q", ("a", 0), prefill_tokens=0, blocks=9, now=now - 1.0)
        tracker.route("r1", "keep", ("a", 0), prefill_tokens=0, blocks=12, now=now - 1.0)
    origin.complete("r1", "q", now=ended_ms / 1000.0)
    origin.apply_snapshot(snap, now=now + 0.001)
    other.apply_snapshot(snap, now=now + 0.001)
    sync.apply("r1", kind(request_id="q", kind=kind.KIND_COMPLETED, worker_id="a", ended_at_ms=ended_ms))
    assert origin.get(("a", 0)).active_blocks == other.get(("a", 0)).active_blocks == 12
    # Ended after the snapshot was taken: both release it from the snapshot's count, whatever the order.
    late_ms = int(now * 1000) + 40
    origin.complete("r1", "keep", now=late_ms / 1000.0)
    sync.apply("r1", kind(request_id="keep", kind=kind.KIND_COMPLETED, worker_id="a", ended_at_ms=late_ms))
    a, b = origin.get(("a", 0)), other.get(("a", 0))
    assert (a.active_blocks, a.stale) == (b.active_blocks, b.stale) == (0, True)


def test_a_sample_taken_while_a_short_request_ran_stops_counting_when_it_ends_whatever_the_order() -> None:
    """Locks: a request shorter than ADMISSION_S is in the worker's sample though charged after the sample's cutoff;
    once it ended nothing is in flight, so the sample goes stale in both arrival orders (a `kv` decision would
    otherwise see the worker that just cached the prompt as busy until its next sample)."""
    snap = events_pb2.LoadSnapshot(worker_id="a", active_blocks=4, total_blocks=100, timestamp_ms=100_010)
    for snapshot_first in (True, False):
        t = LoadTracker()
        t.route("r", "q", ("a", 0), prefill_tokens=0, blocks=4, now=100.0)
        if snapshot_first:
            t.apply_snapshot(snap, now=100.012)
            t.complete("r", "q", now=100.015)
        else:
            t.complete("r", "q", now=100.015)
            t.apply_snapshot(snap, now=100.016)
        load = t.get(("a", 0))
        assert (load.active_blocks, load.stale) == (0, True), snapshot_first

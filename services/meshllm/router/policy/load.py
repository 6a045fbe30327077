"""Per-worker load as the router sees it: routed work, corrected by the workers' LoadSnapshots.

Each routed request *charges* one (worker, dp rank): the KV blocks it will
occupy there and the prompt tokens the worker must still compute. Prefill
tokens are released at the first token (`prefill_done`), blocks when the
request ends (`complete`, whatever the reason: finish, error, cancel).
Requests routed by other router replicas arrive as RouterSyncEvents and are
charged the same way, keyed by (router id, request id), so every replica
holds the same charges.

Decode load (`active_blocks`) before any snapshot is the sum of charges.
Once a worker has published a LoadSnapshot it is the snapshot's
`active_blocks` plus the blocks of requests charged after the snapshot was
taken (its `timestamp_ms`, less `ADMISSION_S` for the request to reach the
worker) — whether they were charged before or after the snapshot arrived —
minus the blocks of requests that ended after it was taken (a snapshot can
arrive after the end of a request it counts): the worker's own count (which
shares prefix blocks between requests) corrects the router's estimate every
time it reports. Deciding by the snapshot's time rather than by arrival
order keeps replicas in agreement: a sync event and a snapshot that reach
two replicas in opposite orders still give both the same view. Times are
wall-clock seconds; a snapshot whose timestamp is implausible (clocks
apart) counts as taken when it arrived. Snapshots of
engines that do not page their cache (`total_blocks` 0) correct nothing, and
a snapshot stops counting once no request is in flight on the worker and one
ended after the snapshot was taken (the worker reports again within 100 ms,
but short requests end sooner: a sample taken while one ran still counts it).
Releases too go by their time (a replica's COMPLETED carries it): whichever
order a release and a snapshot arrive in, every replica ends with the same view.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from meshllm.router.kv.blocks import SlotKey
from meshllm.v1 import events_pb2

__all__ = ["Charge", "LoadTracker", "SlotLoad", "plausible_time"]

STALE_CHARGE_S = 600.0  # a charge nobody released after this long is dropped (a lost COMPLETED event)
ADMISSION_S = 0.02  # a request routed this long before a snapshot was taken is assumed reflected in it
MAX_SNAPSHOT_AGE_S = 1.0  # timestamps outside [arrival - this, arrival + CLOCK_SLACK_S] mean skewed clocks
CLOCK_SLACK_S = 0.05


def plausible_time(timestamp_ms: int, now: float) -> float:
    """Another process's wall-clock ms as seconds; `now` when 0 (not said) or outside what clock skew explains."""
    at = timestamp_ms / 1000.0
    return at if timestamp_ms and now - MAX_SNAPSHOT_AGE_S <= at <= now + CLOCK_SLACK_S else now


@dataclass(slots=True)
class Charge:
    """What one routed request costs its worker."""

    key: SlotKey
    prefill_tokens: int
    blocks: int
    at: float  # wall-clock seconds when charged
    prefill_done: bool = False


@dataclass(slots=True)
class Release:
    """A charge that ended: kept while a snapshot taken before its end can still arrive."""

    at: float  # wall-clock seconds when released
    charged_at: float
    blocks: int


@dataclass(slots=True)
class SlotLoad:
    """The load of one (worker, dp rank)."""

    charged_blocks: int = 0  # sum over in-flight charges
    queued_prefill_tokens: int = 0  # sum over charges not yet prefilled
    in_flight: int = 0
    prefilling: int = 0  # in-flight charges not yet prefilled (no first token yet)
    reported: events_pb2.LoadSnapshot | None = None
    delta_blocks: int = 0  # charged − released since `reported` arrived
    stale: bool = False  # `reported` stopped counting: nothing in flight and a request ended after it (until the next)
    taken: float = -math.inf  # wall-clock seconds `reported` was taken at
    ended_since: int = 0  # requests that ended after `reported` was taken (whenever charged)
    released: deque[Release] = field(default_factory=deque)  # the last MAX_SNAPSHOT_AGE_S of releases

    @property
    def active_blocks(self) -> int:
        if self.reported is None or not self.reported.total_blocks or self.stale:
            return self.charged_blocks  # no (usable) snapshot: the charges alone
        return max(0, self.reported.active_blocks + self.delta_blocks)


class LoadTracker:
    """Charges of in-flight requests per slot, plus the latest LoadSnapshot of each slot."""

    def __init__(self) -> None:
        self._slots: dict[SlotKey, SlotLoad] = {}
        self._charges: dict[tuple[str, str], Charge] = {}
        self._by_slot: dict[SlotKey, set[tuple[str, str]]] = {}
        self.changed: set[SlotKey] = set()  # slots whose load changed since a fleet table last read them (core.py)

    def slot(self, key: SlotKey) -> SlotLoad:
        load = self._slots.get(key)
        if load is None:
            load = self._slots[key] = SlotLoad()
        return load

    def get(self, key: SlotKey) -> SlotLoad:
        """The load of `key` (an empty one when nothing is known)."""
        return self._slots.get(key) or SlotLoad()

    def charges(self) -> int:
        return len(self._charges)

    # ------------------------------------------------------------ charges
    def route(self, origin: str, request_id: str, key: SlotKey, *, prefill_tokens: int, blocks: int, now: float) -> None:
        """Charge `key` for one request (replaces an earlier charge of the same request)."""
        self.complete(origin, request_id)
        self._charges[(origin, request_id)] = Charge(key, prefill_tokens, blocks, now)
        self._by_slot.setdefault(key, set()).add((origin, request_id))
        self.changed.add(key)
        load = self.slot(key)
        load.charged_blocks += blocks
        load.delta_blocks += blocks
        load.queued_prefill_tokens += prefill_tokens
        load.in_flight += 1
        load.prefilling += 1

    def prefill_done(self, origin: str, request_id: str) -> None:
        """The request's prompt is computed: release its queued prefill tokens."""
        c = self._charges.get((origin, request_id))
        if c is None or c.prefill_done:
            return
        c.prefill_done = True
        self.changed.add(c.key)
        load = self.slot(c.key)
        load.queued_prefill_tokens = max(0, load.queued_prefill_tokens - c.prefill_tokens)
        load.prefilling = max(0, load.prefilling - 1)

    def complete(self, origin: str, request_id: str, *, now: float | None = None) -> None:
        """The request ended (at wall time `now`, by default the present): release everything it was charged."""
        c = self._charges.pop((origin, request_id), None)
        if c is None:
            return
        self._by_slot.get(c.key, set()).discard((origin, request_id))
        self.changed.add(c.key)
        load = self._slots.get(c.key)
        if load is None:
            return
        if not c.prefill_done:
            load.queued_prefill_tokens = max(0, load.queued_prefill_tokens - c.prefill_tokens)
            load.prefilling = max(0, load.prefilling - 1)
        load.charged_blocks = max(0, load.charged_blocks - c.blocks)
        load.in_flight = max(0, load.in_flight - 1)
        at = time.time() if now is None else now
        # By the times, not the order of arrival, as in apply_snapshot: a replica that hears of the end after
        # a snapshot taken later than it must not release the blocks twice.
        if c.at > load.taken - ADMISSION_S or at > load.taken:
            load.delta_blocks -= c.blocks  # charged after the snapshot (on top of it until now), or counted and ended since
        if at > load.taken:
            load.ended_since += 1
        load.stale = load.in_flight == 0 and (load.reported is None or load.ended_since > 0)
        _forget_releases(load.released, at)
        load.released.append(Release(at, c.at, c.blocks))

    def expire(self, now: float, max_age_s: float = STALE_CHARGE_S) -> int:
        """Release charges older than `max_age_s` (their COMPLETED event was lost); returns how many."""
        stale = [k for k, c in self._charges.items() if now - c.at > max_age_s]
        for origin, rid in stale:
            self.complete(origin, rid, now=now)
        return len(stale)

    # ------------------------------------------------------------ snapshots and workers
    def apply_snapshot(self, snap: events_pb2.LoadSnapshot, *, now: float) -> None:
        """A worker reported its load (arriving at wall time `now`): the base, with later charges on top."""
        key = (snap.worker_id, snap.dp_rank)
        self.changed.add(key)
        load = self.slot(key)
        load.reported = snap
        load.taken = taken = plausible_time(snap.timestamp_ms, now)
        cutoff = taken - ADMISSION_S
        charges = self._charges
        added = sum(c.blocks for c in (charges[k] for k in self._by_slot.get(key, ())) if c.at > cutoff)
        _forget_releases(load.released, now)
        # Requests the snapshot counts that ended after it was taken: their blocks are free already.
        ended = [r for r in load.released if r.at > taken and r.charged_at <= cutoff]
        load.delta_blocks = added - sum(r.blocks for r in ended)
        load.ended_since = sum(1 for r in load.released if r.at > taken)
        load.stale = load.in_flight == 0 and load.ended_since > 0

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker's load and the charges on it."""
        for key in [k for k in self._slots if k[0] == worker_id]:
            del self._slots[key]
            self._by_slot.pop(key, None)
            self.changed.add(key)
        for ck in [k for k, c in self._charges.items() if c.key[0] == worker_id]:
            del self._charges[ck]

    def worker(self, worker_id: str) -> SlotLoad:
        """The sum over a worker's dp ranks (for ListWorkers)."""
        total = SlotLoad()
        agg = events_pb2.LoadSnapshot(worker_id=worker_id)
        seen = False
        for key, load in self._slots.items():
            if key[0] != worker_id:
                continue
            total.charged_blocks += load.active_blocks
            total.queued_prefill_tokens += load.queued_prefill_tokens
            total.in_flight += load.in_flight
            if load.reported is not None:
                seen = True
                agg.total_blocks += load.reported.total_blocks
                agg.waiting += load.reported.waiting
                agg.running += load.reported.running
        if seen:
            agg.active_blocks = total.charged_blocks
            total.reported = agg
        return total


def _forget_releases(released: deque[Release], now: float) -> None:
    """Drop releases no plausible snapshot can predate (an older timestamp counts as taken on arrival)."""
    while released and released[0].at < now - MAX_SNAPSHOT_AGE_S - CLOCK_SLACK_S:
        released.popleft()

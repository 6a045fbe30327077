"""A routing decision's candidates: every eligible (worker, dp rank), or at fleet scale only those that can win.

    candidates = Candidates(core)            # reads the core's views at each call
    ask = candidates.ask(model, tokens, hashes, block_size)
    cands = candidates.build(model, role, workers, pin_rank, hashes, ask)   # unscored or scored; score() them all

A candidate is priced from the router's views of its worker: the KV index
(device prefix and lower tiers), the prompts in flight there (shared prefill),
its load and its measured step times. `exhaustive` builds one per eligible
slot, the reference. `fleet` (kv mode, temperature 0, pools of
`FLEET_MIN_SLOTS` slots or more) scores exactly the slots whose cost has terms
the bounds do not see (in-flight prefixes, lower tiers) and then walks the
rest in order of a lower bound of their cost (`meshllm.router.policy.fleet`),
stopping at the first bound above the best candidate: the same choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from meshllm.errors import Unavailable
from meshllm.router.config import RouterConfig, RouterMode
from meshllm.router.kv.blocks import SlotKey
from meshllm.router.kv.capacity import SlotCapacities
from meshllm.router.kv.index import KvIndex, TierOverlap
from meshllm.router.kv.predicted import PredictedIndex, RoutedCache
from meshllm.router.policy.choice import Candidate, KvPolicy, Policy, score
from meshllm.router.policy.fleet import FLEET_MIN_SLOTS, FleetTable, bit_indices, lower_bounds, policy_order
from meshllm.router.policy.load import LoadTracker, SlotLoad
from meshllm.router.policy.timing import WorkerTimes, evict_ratio, restore_costs, wait_blocks
from meshllm.router.workers import PoolWorker, WorkerPool, role_name

__all__ = ["Ask", "Candidates", "RouterViews", "total_blocks"]

Order = tuple[bool, float, int, int, int, str, int]


class RouterViews(Protocol):
    """What candidates are priced from: a routing core's views (`RouterCore` satisfies it)."""

    config: RouterConfig
    mode: RouterMode
    policy: Policy
    pool: WorkerPool
    index: KvIndex
    load: LoadTracker
    inflight: PredictedIndex
    approx: RoutedCache
    times: WorkerTimes


@dataclass(slots=True)
class Ask:
    """What one decision asks of every candidate: the prompt's sizes and the model's measured times."""

    tokens: int
    hashes: int
    block_size: int
    request_blocks: int
    prompt: frozenset[int]  # immutable: BlockMap.hot_victims keeps its block ids for the decision's candidates
    block_ms: float
    fixed_ms: float
    cache: SlotCapacities


def order(c: Candidate) -> Order:
    """`KvPolicy`'s order at temperature 0: candidates with room first, then its tie key."""
    return (c.no_room, c.cost, c.decode_blocks, c.in_flight, c.cached_blocks, c.worker_id, c.dp_rank)


def total_blocks(w: PoolWorker, load: SlotLoad) -> int:
    """A slot's capacity: its last LoadSnapshot's, else its model card's (per dp rank)."""
    if load.reported is not None and load.reported.total_blocks:
        return int(load.reported.total_blocks)
    return int(w.card.runtime_limits.total_kv_blocks) if w.card is not None else 0


class Candidates:
    """Builds a decision's candidates from a routing core's views (see the module docstring).

    `fleet` False scores every candidate whatever the pool's size (the
    reference the fleet path agrees with); `fleet_min_slots` is the pool size
    from which the fleet path is taken.
    """

    def __init__(self, views: RouterViews) -> None:
        self.views = views
        self.fleet = True
        self.fleet_min_slots = FLEET_MIN_SLOTS
        self._tables: dict[tuple[str, int], FleetTable] = {}

    def ask(self, model: str, tokens: list[int], hashes: list[int], block_size: int) -> Ask:
        v = self.views
        return Ask(
            tokens=len(tokens), hashes=len(hashes), block_size=block_size,
            request_blocks=-(-len(tokens) // block_size), prompt=frozenset(hashes),
            block_ms=v.times.block_ms(model, block_size), fixed_ms=v.times.fixed_ms(model),
            cache=v.approx if v.mode is RouterMode.APPROXIMATE else v.index,
        )  # fmt: skip

    def build(
        self, model: str, role: int, workers: list[PoolWorker], pin_rank: int | None, hashes: list[int], ask: Ask
    ) -> list[Candidate]:
        """The candidates to score: those that can win at fleet scale, else every eligible one."""
        cands = self.fleet_candidates(model, role, workers, pin_rank, hashes, ask) if self.fleet else None
        return self.exhaustive(role, workers, pin_rank, hashes, ask) if cands is None else cands

    def exhaustive(
        self, role: int, workers: list[PoolWorker], pin_rank: int | None, hashes: list[int], ask: Ask
    ) -> list[Candidate]:
        """Every eligible (worker, dp rank) as a candidate (unscored): the reference the fleet path agrees with."""
        keys: list[tuple[PoolWorker, int]] = [
            (w, r) for w in workers for r in range(w.dp_size) if pin_rank is None or r == pin_rank
        ]
        if not keys:
            raise Unavailable(f"no {role_name(role)} worker of model {workers[0].model!r} has dp rank {pin_rank}")
        slots = [(w.id, r) for w, r in keys]
        overlaps, pending = self.overlaps(hashes, slots)
        # Where the device prefix ends, lower tiers (host, disk) may continue it (kv mode: events tell).
        v = self.views
        tiers = v.index.tier_overlaps(hashes, slots, overlaps) if v.mode is RouterMode.KV and hashes else {}
        cands = []
        for w, r in keys:
            key = (w.id, r)
            ov = overlaps.get(key, 0)
            lower: dict[int, int] = {}
            if (t := tiers.get(key)) is not None:
                ov, lower = ov + t.device, t.lower
            cands.append(self.candidate(w, r, ov, lower, pending.get(key, 0), ask))
        return cands

    def candidate(self, w: PoolWorker, r: int, ov: int, lower: dict[int, int], shared: int, ask: Ask) -> Candidate:
        """One (worker, dp rank) with `ov` device prefix blocks, `lower` restored ones, `shared` with its in-flight requests."""
        v = self.views
        key = (w.id, r)
        bs = ask.block_size
        served = ov + sum(lower.values())
        load = v.load.get(key)
        advertised = load.reported.tiers if load.reported is not None else ()
        # Queued prefill of in-flight requests that share this prompt's prefix is work this
        # request shares (the prefix is being computed for both), not a backlog it waits behind.
        queued = max(0, load.queued_prefill_tokens - shared * bs)
        cache = ask.cache
        cache.set_total(key, total_blocks(w, load))
        new = max(0, ask.hashes - ov)  # restored blocks take device room as computed ones do
        room = cache.capacity(key, ask.prompt, new, pending=-(-load.queued_prefill_tokens // bs))
        step_ms = v.times.step_ms(key)
        # Decode load once this request runs there: the engine shares blocks only between running
        # sequences, so every prompt block but those its in-flight requests share becomes active
        # (a block cached there but idle is made active again, not saved).
        decode = load.active_blocks + ask.request_blocks - shared
        total = room.total if v.config.tuning.capacity_weight > 0 else 0
        no_room = total > 0 and decode > total
        wait = wait_blocks(load.in_flight, step_ms, ask.block_ms, prefilling=load.prefilling, fixed_ms=ask.fixed_ms)
        return Candidate(
            worker_id=w.id, dp_rank=r, address=w.address, overlap_blocks=ov,
            prefill_tokens=max(0, ask.tokens - served * bs), decode_blocks=decode,
            queued_prefill_tokens=queued, in_flight=load.in_flight, prefilling=load.prefilling,
            cached_blocks=room.resident, total_blocks=room.total, new_blocks=new, evicted_hot_blocks=room.evicted_hot,
            evict_ratio=evict_ratio(advertised, ask.block_ms), step_ms=step_ms, wait_blocks=wait, no_room=no_room,
            lower_blocks=lower, restore=restore_costs(lower, advertised, ask.block_ms) if lower else [],
        )  # fmt: skip

    def overlaps(self, hashes: list[int], keys: list[SlotKey]) -> tuple[dict[SlotKey, int], dict[SlotKey, int]]:
        """Cached leading blocks per candidate, and how many leading blocks in-flight requests on it share.

        In `kv` mode the shared ones count as cached (they are being computed there); in both
        modes they are work this request shares, not backlog, and take no room of their own.
        """
        v = self.views
        pending: dict[SlotKey, int] = {}
        if not hashes:
            return {}, pending
        if v.mode is RouterMode.APPROXIMATE:
            v.approx.expire(time.monotonic())
            return v.approx.overlaps(hashes, keys), v.inflight.overlaps(hashes, keys)
        seen = v.index.overlaps(hashes, keys)
        if v.mode is RouterMode.KV:
            pending = v.inflight.overlaps(hashes, keys)
            for k, n in pending.items():
                if n > seen.get(k, 0):
                    seen[k] = n
        return seen, pending

    # ------------------------------------------------------------ fleet scale (meshllm.router.policy.fleet)
    def table(self, model: str, role: int) -> FleetTable | None:
        """The pool's table, rebuilt when the pool or the slot numbering changed; None below `fleet_min_slots`."""
        v = self.views
        base = v.pool.workers(model, role, include_cooling=True)
        t = self._tables.get((model, role))
        bmap = v.index.map
        if t is None or t.base is not base or t.generation != bmap.generation:
            if sum(w.dp_size for w in base) < self.fleet_min_slots:
                self._tables.pop((model, role), None)
                return None
            for w in base:
                for r in range(w.dp_size):
                    bmap.slot((w.id, r))
            t = self._tables[(model, role)] = FleetTable.build(base, bmap.slot_of, bmap.generation)
        changed = v.load.changed | v.times.changed
        if changed:
            v.load.changed.clear()
            v.times.changed.clear()
            for other in self._tables.values():
                other.mark(changed)
        if t.dirty:
            for i in t.dirty:
                w, r = t.keys[i]
                key = (w.id, r)
                load = v.load.get(key)
                total = total_blocks(w, load)
                v.index.set_total(key, total)
                t.set(
                    i, active=load.active_blocks, queued=load.queued_prefill_tokens, in_flight=load.in_flight,
                    prefilling=load.prefilling, total=total if total > 0 else 0, step=v.times.step_ms(key),
                )  # fmt: skip
            t.dirty.clear()
        return t

    def fleet_candidates(
        self, model: str, role: int, workers: list[PoolWorker], pin_rank: int | None, hashes: list[int], ask: Ask
    ) -> list[Candidate] | None:
        """The candidates that can win, scored, or None to score every one."""
        v = self.views
        if v.mode is not RouterMode.KV or not isinstance(v.policy, KvPolicy) or v.policy.temperature > 0:
            return None
        t = self.table(model, role)
        if t is None:
            return None
        eligible = _eligible_mask(t, workers, pin_rank)
        if eligible is not None and not eligible.any():
            return None  # the exhaustive path says why
        ov = np.zeros(len(t.keys), dtype=np.int64)
        if hashes:
            for depth, bits in v.index.map.overlap_groups(hashes, t.mask):
                ov[t.pos_of_slot[bit_indices(bits)]] = depth
        cands, special = self._exact(t, ov, eligible, hashes, ask)
        rest = ~special if eligible is None else eligible & ~special
        self._walk_bounds(t, ov, rest, cands, ask)
        return cands

    def _exact(
        self, t: FleetTable, ov: npt.NDArray[np.int64], eligible: npt.NDArray[np.bool_] | None, hashes: list[int], ask: Ask
    ) -> tuple[list[Candidate], npt.NDArray[np.bool_]]:
        """Scored exactly, as by the exhaustive path: slots with in-flight requests sharing the prefix, or lower tiers.

        Returns them (eligible ones only) and the mask of every such slot.
        """
        v = self.views
        pmap = v.inflight.map
        pending = pmap.overlaps(hashes, [k for k in pmap.slot_of if k in t.pos]) if hashes and pmap.slot_of else {}
        tiers: dict[SlotKey, TierOverlap] = {}
        if hashes and v.index.lower:
            starts = {t.skeys[i]: int(ov[i]) for i in np.flatnonzero(ov)}
            for k, d in pending.items():
                starts[k] = max(starts.get(k, 0), d)
            tiers = v.index.tier_overlaps(hashes, t.skeys, starts)
        cands: list[Candidate] = []
        special = np.zeros(len(t.keys), dtype=np.bool_)
        for key in pending.keys() | tiers.keys():
            i = t.pos[key]
            special[i] = True
            if eligible is not None and not eligible[i]:
                continue
            w, r = t.keys[i]
            dev, shared, lower = max(int(ov[i]), pending.get(key, 0)), pending.get(key, 0), {}
            if (tov := tiers.get(key)) is not None:
                dev, lower = dev + tov.device, tov.lower
            cands.append(self.candidate(w, r, dev, lower, shared, ask))
        self._score(cands, ask)
        return cands, special

    def _walk_bounds(
        self, t: FleetTable, ov: npt.NDArray[np.int64], rest: npt.NDArray[np.bool_], cands: list[Candidate], ask: Ask
    ) -> None:
        """Add the `rest` slots in order of their cost's lower bound until a bound exceeds the best candidate."""
        cfg = self.views.config.tuning
        bmap = self.views.index.map
        counts = np.frombuffer(bmap.sizes, dtype=np.int64)[t.slots]  # a copy: the buffer is let go at once
        hot = np.frombuffer(bmap.hot, dtype=np.int64)[t.slots]
        best = min((order(c) for c in cands), default=None)
        b = lower_bounds(
            t, ov, counts, hot, tokens=ask.tokens, hashes=ask.hashes, block_size=ask.block_size,
            request_blocks=ask.request_blocks, block_ms=ask.block_ms, fixed_ms=ask.fixed_ms,
            overlap_weight=cfg.overlap_weight, capacity_weight=cfg.capacity_weight, wait_weight=cfg.wait_weight,
        )  # fmt: skip
        for i in policy_order(b, t, rest):
            w, r = t.keys[i]
            if best is not None:
                bound = (bool(b.no_room[i]), float(b.cost[i]), int(b.decode[i]), int(t.in_flight[i]), int(b.cached[i]), w.id, r)
                if bound > best:
                    break
            c = self.candidate(w, r, int(ov[i]), {}, 0, ask)
            self._score([c], ask)
            cands.append(c)
            ordered = order(c)
            if best is None or ordered < best:
                best = ordered

    def _score(self, cands: list[Candidate], ask: Ask) -> None:
        cfg = self.views.config.tuning
        score(
            cands, block_size=ask.block_size, overlap_weight=cfg.overlap_weight, capacity_weight=cfg.capacity_weight,
            wait_weight=cfg.wait_weight,
        )  # fmt: skip


def _eligible_mask(t: FleetTable, workers: list[PoolWorker], pin_rank: int | None) -> npt.NDArray[np.bool_] | None:
    """Which of the table's slots may be chosen; None when all of them."""
    if workers is t.base and pin_rank is None:
        return None
    eligible = np.zeros(len(t.keys), dtype=np.bool_)
    for w in workers:
        eligible[t.wpos.get(w.id, [])] = True
    if pin_rank is not None:
        eligible &= t.dp == pin_rank
    return eligible

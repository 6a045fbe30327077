"""Fleet-scale `kv` decisions: score only the candidates that can win, with the same choice as scoring all.

`RouterCore.decide` scores every eligible (worker, dp rank) of a pool — a
`Candidate` and a capacity query each — which is linear in the fleet with a
large constant (at 256 workers ~20 ms a decision, ISSUE 39). For a pool of
`FLEET_MIN_SLOTS` slots or more, in `kv` mode at temperature 0, the core
decides through a `FleetTable` instead, and picks the same candidate:

1. The table holds, per slot of the pool, the load terms of the cost
   (active blocks, queued prefill tokens, requests in flight and
   prefilling, step time, capacity) in arrays. They change only where a
   request is charged or released, a LoadSnapshot arrives or a step time
   is measured: `LoadTracker.changed` and `WorkerTimes.changed` name those
   slots and only they are read again (`refresh`), not the fleet.
   `BlockMap` keeps each slot's count of reused blocks as blocks come and
   go, so no decision counts them.
2. One walk of the prompt over the pool's slot bitmask gives each slot's
   cached prefix (`BlockMap.overlap_groups`: one group per depth, so a
   block the whole fleet holds costs one group, not a thousand keys).
3. Slots with in-flight requests sharing the prompt's prefix, or with
   lower-tier blocks of it, are scored exactly as today (a few, bounded by
   in-flight requests). For every other slot `lower_bounds` computes, in
   arrays, the cost `policy.score` gives it with no reused block evicted —
   the same operations in the same order on IEEE doubles, so where no
   reused block can be evicted (its cache has room for the new blocks, or
   holds no reused block) it *is* the cost, bit for bit — and a lower bound
   elsewhere (evicted reused blocks only add to the cost).
4. In the order of (no room, bound, decode blocks, in flight, resident
   blocks, worker id, dp rank) — the policy's own order — slots are scored
   exactly until the next one's bound exceeds the best exact key: none
   after it can win. With room and idle caches that is one slot.

The result is exact (the same choice as scoring every slot;
tests/unit/test_router_fleet.py runs both side by side); what it changes is
the decision's candidate list: it holds the candidates scored, not every
slot of the pool. Temperature > 0 (sampling over all costs), other modes
and small pools score every candidate as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from meshllm.router.kv.blocks import SlotKey
from meshllm.router.policy.timing import BUSY_STEPS
from meshllm.router.workers import PoolWorker

__all__ = ["FLEET_MIN_SLOTS", "Bounds", "FleetTable", "bit_indices", "lower_bounds", "policy_order"]

FLEET_MIN_SLOTS = 32  # pools of fewer slots are scored whole: every candidate in Router.Route's answer

Ints = npt.NDArray[np.int64]
Floats = npt.NDArray[np.float64]
Bools = npt.NDArray[np.bool_]


def bit_indices(bits: int) -> npt.NDArray[np.intp]:
    """The positions of the set bits of `bits`, ascending."""
    if bits.bit_count() <= 8:
        out = []
        while bits:
            low = bits & -bits
            out.append(low.bit_length() - 1)
            bits ^= low
        return np.array(out, dtype=np.intp)
    raw = np.frombuffer(bits.to_bytes((bits.bit_length() + 7) // 8, "little"), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little"))


@dataclass(slots=True)
class FleetTable:
    """One pool's (model, role) slots in (worker id, dp rank) order, with their load terms in arrays."""

    base: list[PoolWorker]  # the pool's list this table was built from (identity: rebuilt when it changes)
    generation: int  # the BlockMap generation its slot numbers belong to
    keys: list[tuple[PoolWorker, int]]
    skeys: list[SlotKey]
    slot_list: list[int]
    slots: npt.NDArray[np.intp]
    pos: dict[SlotKey, int]
    wpos: dict[str, list[int]]
    pos_of_slot: npt.NDArray[np.intp]
    dp: Ints
    mask: int  # bits of the table's slots
    active: Ints
    queued: Ints
    in_flight: Ints
    prefilling: Ints
    total: Ints
    step: Floats
    dirty: set[int] = field(default_factory=set)

    @classmethod
    def build(cls, base: list[PoolWorker], slot_of: dict[SlotKey, int], generation: int) -> FleetTable:
        """A table over `base`'s slots (`slot_of`: every key's BlockMap slot, allocated by the caller)."""
        keys = [(w, r) for w in base for r in range(w.dp_size)]
        skeys = [(w.id, r) for w, r in keys]
        slot_list = [slot_of[k] for k in skeys]
        n = len(keys)
        wpos: dict[str, list[int]] = {}
        for i, (w, _) in enumerate(keys):
            wpos.setdefault(w.id, []).append(i)
        pos_of_slot = np.full(max(slot_list, default=-1) + 1, -1, dtype=np.intp)
        pos_of_slot[slot_list] = np.arange(n)
        mask = 0
        for s in slot_list:
            mask |= 1 << s
        zeros = np.zeros(n, dtype=np.int64)
        return cls(
            base, generation, keys, skeys, slot_list, np.array(slot_list, dtype=np.intp), {k: i for i, k in enumerate(skeys)},
            wpos, pos_of_slot,
            np.array([r for _, r in keys], dtype=np.int64), mask, zeros.copy(), zeros.copy(), zeros.copy(),
            zeros.copy(), zeros.copy(), np.zeros(n, dtype=np.float64), set(range(n)),
        )  # fmt: skip

    def mark(self, changed: Iterable[SlotKey]) -> None:
        """Slots whose load or step time changed: read again before the next decision."""
        pos = self.pos
        self.dirty.update(p for k in changed if (p := pos.get(k)) is not None)

    def set(self, i: int, *, active: int, queued: int, in_flight: int, prefilling: int, total: int, step: float) -> None:
        self.active[i], self.queued[i], self.in_flight[i], self.prefilling[i] = active, queued, in_flight, prefilling
        self.total[i], self.step[i] = total, step


@dataclass(slots=True)
class Bounds:
    """Per slot of a table: the policy's order key with the cost's lower bound (`exact`: it is the cost)."""

    no_room: Bools
    cost: Floats
    decode: Ints
    cached: Ints
    exact: Bools


def lower_bounds(
    t: FleetTable,
    ov: Ints,
    counts: Ints,
    hot: Ints,
    *,
    tokens: int,
    hashes: int,
    block_size: int,
    request_blocks: int,
    block_ms: float,
    fixed_ms: float,
    overlap_weight: float,
    capacity_weight: float,
    wait_weight: float,
) -> Bounds:
    """`policy.score`'s cost of every slot with no lower-tier blocks and no pending prefix, bar evicted reused blocks.

    Mirrors `RouterCore._candidate` and `policy.score` operation for
    operation (see the module docstring): `ov` cached prefix blocks,
    `counts` resident blocks, `hot` reused resident blocks per slot.
    """
    bs = max(block_size, 1)
    prefill_tokens = np.maximum(0, tokens - ov * block_size)
    new = np.maximum(0, hashes - ov)
    resident = counts + np.maximum(0, -(-t.queued // block_size))
    total = np.where(t.total > 0, t.total, 0)
    decode = t.active + request_blocks
    room_total = total if capacity_weight > 0 else np.zeros_like(total)
    no_room = (room_total > 0) & (decode > room_total)
    if block_ms > 0:
        ms = np.where(t.step > 0, BUSY_STEPS * t.step, 0.0)
        if fixed_ms > 0:
            ms = np.where(t.prefilling > 0, ms + fixed_ms, ms)
        wait = np.where(t.in_flight > 0, ms / block_ms, 0.0)
    else:
        wait = np.zeros(len(ov), dtype=np.float64)
    prefill_blocks = (prefill_tokens + t.queued) / bs + 0.0
    capped = total > 0
    safe_total = np.where(capped, total, 1)
    pressure = np.where(capped, (new * np.minimum(resident, total)) / safe_total, 0.0)
    capacity = np.where(capped, capacity_weight * pressure, 0.0)
    cost = overlap_weight * prefill_blocks + decode + capacity + wait_weight * wait
    evict = new + resident - total
    exact = ~capped | (evict <= 0) | (hot <= 0)
    return Bounds(no_room, cost, decode, resident, exact)


SELECT_STEPS = 4  # slots taken one minimum at a time before sorting the rest (a sort costs ~40 selections)
SORT_CHUNK = 32  # then sorted in chunks of at least this many (all ties of the last included)
_INT_MAX = np.iinfo(np.int64).max


def policy_order(b: Bounds, t: FleetTable, alive: Bools) -> Iterator[int]:
    """The `alive` slots in the policy's order of their bounds: (no room, cost, decode, in flight, resident, position).

    Position is (worker id, dp rank) order. The first `SELECT_STEPS` come one
    minimum at a time (a few array passes each: a decision usually needs one
    or two), the rest from one lexicographic sort.
    """
    alive = alive.copy()
    for _ in range(SELECT_STEPS):
        if not alive.any():
            return
        m = alive & ~b.no_room
        if not m.any():
            m = alive
        m = m & (b.cost == np.where(m, b.cost, np.inf).min())
        for arr in (b.decode, t.in_flight, b.cached):
            m = m & (arr == np.where(m, arr, _INT_MAX).min())
        i = int(np.flatnonzero(m)[0])
        alive[i] = False
        yield i
    idx = np.flatnonzero(alive)
    if len(idx) > SORT_CHUNK:
        # The SORT_CHUNK least by (no room, cost) and every slot tied with them sort first, the rest only when
        # asked for: a decision rarely needs more than a few dozen, and a sort of a whole fleet costs ~50 µs.
        primary = np.where(b.no_room[idx], np.inf, b.cost[idx])
        bound = primary[np.argpartition(primary, SORT_CHUNK - 1)[:SORT_CHUNK]].max()
        if bound < np.inf:  # else (slots with no room among them) one sort of them all
            yield from _sorted(b, t, idx[primary <= bound])
            idx = idx[primary > bound]
    yield from _sorted(b, t, idx)


def _sorted(b: Bounds, t: FleetTable, idx: npt.NDArray[np.intp]) -> list[int]:
    """`idx` in the order of `policy_order`."""
    return idx[np.lexsort((idx, b.cached[idx], t.in_flight[idx], b.decode[idx], b.cost[idx], b.no_room[idx]))].tolist()

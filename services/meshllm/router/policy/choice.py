"""Routing policies: given scored candidates, pick one.

Every candidate is a (worker, dp rank) scored the same way whatever the
policy, so `Router.Route` can always explain a decision:

    prefill_blocks = (prompt tokens it must compute + its queued prefill tokens) / block size
    restore_blocks = Σ over lower tiers: blocks restored from the tier × its restore ratio
    pressure       = new_blocks × resident_blocks / total_blocks
    wait_blocks    = (1.5 × step_ms [+ fixed_ms if one of them is prefilling]) / block_ms
                     if requests are in flight on it, else 0
    cost           = overlap_weight × (prefill_blocks + restore_blocks) + decode_blocks
                     + capacity_weight × (pressure + 2.5 × evict_ratio × evicted_hot_blocks)
                     + wait_weight × wait_blocks

- `new_blocks`: prompt blocks the worker would add to its cache (those it
  does not hold); `resident_blocks`: what its cache holds now, counting the
  blocks of prompts routed to it and not yet computed; `total_blocks`: its
  capacity (0 = unknown, and then both capacity terms are 0).
- `pressure` charges a fuller cache for every block a request adds to it, so
  a new prefix goes where there is room instead of onto the worker that
  happens to hold its first block or two (a chat template, a shared system
  preamble). A prompt mostly cached somewhere adds few blocks there, so this
  hardly touches it; a long unique suffix is decided by room, not by a block
  every worker could compute in a step. A block held by *every* candidate
  shifts every cost equally and never decides (argmin is invariant to it).
- `evicted_hot_blocks`: of the blocks the worker would have to evict to make
  room (`new + resident − total`, least recently used first, as the engine
  does), those reused since they were stored — each would have to be
  computed again when its prefix comes back (one prefill block), and
  storing it again evicts a block of that cache in turn, often one of the
  other reused prefixes it holds, whose return evicts another:
  `REUSED_EVICT_COST` = 2.5 prefill blocks each, the recompute plus 1.5
  for that chain. Blocks never reused (unique suffixes, one-off prompts)
  go for free. The price is measured, not derived: it is what keeps a
  request whose prefix worker is busy from copying the prefix onto a cache
  full of other reused prefixes for a small saving in wait (with distinct
  prefixes and tight caches, one run each, hit rate 81.2 % at 1.5, 86.3 %
  at 2, 90.5 % at 2.5 with TTFT p90 35.5 ms against round-robin's 35.9,
  93.9 % at 3 with p90 36.4 ms, over it — docs/routing.md).
- `restore_blocks`: the prompt prefix a worker can serve is its device
  blocks (`overlap_blocks`, free) followed by blocks it keeps in a lower
  tier (host memory, disk: `lower_blocks`, restored into the device cache
  before use, each from the nearest tier holding it). A restored block is
  not computed — it leaves `prefill_blocks` — but costs its tier's *restore
  ratio* (`meshllm.router.policy.timing.restore_cost`: the worker's advertised
  restore time per block over the model's measured prefill time per block,
  or the tier's default while either is unknown). So a lower-tier hit
  beats a miss when the ratio is below 1, loses to a device hit always,
  and a worker whose tier restores slower than it computes is charged more
  than a miss (it restores what it holds). Restored blocks need device room
  like computed ones: they count in `new_blocks`.
- `evict_ratio`: an evicted reused block costs a recompute (1) on a worker
  without lower tiers; on one that keeps evicted blocks in a lower tier it
  comes back at that tier's restore ratio (the nearest tier's, capped at 1).
- `decode_blocks` (active KV blocks once the request runs there: its
  active blocks plus the prompt's, less the prefix blocks it shares with the
  requests running there — a block the cache holds but no running request
  uses becomes active again, it is not saved) and the queued prefill tokens
  are load: a busy worker loses even when it holds the prefix, as soon as
  its backlog outweighs the blocks it would save. (Until 2026-11-25 every
  cached prompt block was subtracted, so a hit counted twice, as prefill
  and as decode load, and `kv` stacked requests on a busy prefix holder
  where an idle worker would have answered sooner.)
- `wait_blocks`: the time a request waits on a worker that is running
  others, in the unit of the prefill terms (`meshllm.router.policy.timing`): the
  rest of the step in progress plus the step it shares with the running
  sequences (1.5 steps), and when one of those requests has no first token
  yet, the fixed time of the prefill step it is in (`fixed_ms`, the
  intercept of the router's prefill fit: no per-token term counts it), over
  the time of one prefill block. `step_ms` is
  the worker's step time and `block_ms` the model's prefill time per block,
  both measured by the router from the streams it proxies; 0 while `block_ms`
  is unknown (each part 0 while its own time is). A cache hit saves `overlap` blocks of prefill; it is worth
  waiting for only when that saving exceeds the wait (plus what the other
  worker would pay in cache capacity).

Where the peers stop: Dynamo's selector is the first line alone (overlap and
load, no capacity), so a shared first block decides where new prefixes go;
SGLang's cache-aware router takes the longest match above a match-rate
threshold, else the smallest tree, and switches to shortest-queue past a
load imbalance threshold — capacity enters only through the fallback and
never as a price on evicting reused prefixes; llm-d adds weighted scores of
prefix match, queue and cache utilisation, where utilisation is a fraction
that does not depend on how many blocks this request would add or evict.

- `no_room`: the request's blocks do not fit beside those of the requests
  running on the worker (its active blocks + the prompt's blocks − the
  prefix blocks it shares with them > total_blocks). The engine would keep
  it waiting until a running request finishes — a wait of whole requests,
  not steps, that no term above prices (with tight caches and 8 concurrent
  callers, stacking a third request on a prefix holder put `kv`'s TTFT p99
  at 2.4× round-robin's). `kv` and `approximate` pick among the candidates
  with room while there is one; `no_room` is never set when capacity_weight
  is 0 or the capacity is unknown.

- `kv` / `approximate`: lowest cost among the candidates with room (all of
  them if none has). Temperature 0 → argmin, ties broken by fewer decode
  blocks, then fewer requests in flight, then fewer resident blocks (the
  emptiest cache), then worker id and dp rank (deterministic).
  Temperature T > 0 → sample with probability ∝ exp(−x / T) where x is the
  cost normalised to [0, 1] over the candidates (T = 0.1 strongly prefers
  the cheapest, T = 10 is nearly uniform). The two modes differ only in
  where overlap, residency and eviction order come from (KV events plus
  routed prompts, vs routed prompts alone), which the core computes.
- `round-robin`: the next candidate in (worker id, dp rank) order, per pool.
- `random`: uniformly at random.
- `least-loaded`: fewest decode blocks, then fewest queued prefill tokens,
  then fewest in flight, then worker id.
"""

from __future__ import annotations

import abc
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshllm.router.config import RouterMode
from meshllm.router.policy.timing import DEFAULT_RESTORE_RATIO, UNKNOWN_TIER_RESTORE_RATIO, RestoreCost

__all__ = [
    "REUSED_EVICT_COST",
    "Candidate",
    "KvPolicy",
    "LeastLoadedPolicy",
    "Policy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "make_policy",
    "score",
]

# Prefill blocks one evicted reused block costs (before `evict_ratio`): its recompute when its prefix
# returns (1), plus 1.5 for the chain of evictions storing it again sets off on a cache full of reused
# prefixes (measured; see the module docstring).
REUSED_EVICT_COST = 2.5


@dataclass(slots=True)
class Candidate:
    """One (worker, dp rank) that could serve a request, with what its cost is made of."""

    worker_id: str
    dp_rank: int
    address: str
    overlap_blocks: int = 0
    prefill_tokens: int = 0  # prompt tokens it would compute
    decode_blocks: int = 0  # KV blocks active on it
    queued_prefill_tokens: int = 0  # prompt tokens routed to it and not yet computed
    in_flight: int = 0
    prefilling: int = 0  # of in_flight, those without a first token yet (their prefill is queued or running)
    cached_blocks: int = 0  # resident blocks: cached, plus routed and not yet computed
    total_blocks: int = 0  # capacity; 0 = unknown (no capacity terms)
    new_blocks: int = 0  # prompt blocks it would add to its cache
    evicted_hot_blocks: int = 0  # reused blocks it would evict to make room
    evict_ratio: float = 1.0  # prefill blocks an evicted reused block costs (< 1: it goes to a lower tier)
    lower_blocks: dict[int, int] = field(default_factory=dict)  # lower tier -> prompt blocks restored from it
    restore: list[RestoreCost] = field(default_factory=list)  # the cost of each tier in `lower_blocks`
    restore_blocks: float = 0.0  # Σ lower_blocks[tier] × its restore ratio (filled in by `score`)
    step_ms: float = 0.0  # its measured step time (0 = not measured yet)
    wait_blocks: float = 0.0  # expected wait behind its running requests, in prefill blocks
    pressure: float = 0.0  # new_blocks × cached_blocks / total_blocks (filled in by `score`)
    no_room: bool = False  # its running requests leave no room for this one's blocks (it would wait for one to end)
    cost: float = 0.0

    @property
    def key(self) -> tuple[str, int]:
        return (self.worker_id, self.dp_rank)

    @property
    def served_blocks(self) -> int:
        """Leading prompt blocks it has in some tier: the device ones plus the restored ones."""
        return self.overlap_blocks + sum(self.lower_blocks.values())


def score(
    candidates: Sequence[Candidate],
    *,
    block_size: int,
    overlap_weight: float,
    capacity_weight: float = 0.0,
    wait_weight: float = 0.0,
) -> None:
    """Fill in each candidate's restore blocks, pressure and cost (the formula of the module docstring).

    `wait_blocks` is given; so are `lower_blocks` and, for each of its
    tiers, a `RestoreCost` in `restore` (a tier without one costs its
    default ratio).
    """
    bs = max(block_size, 1)
    for c in candidates:
        if c.lower_blocks:
            ratios = {r.tier: r.ratio for r in c.restore}
            c.restore_blocks = sum(
                n * ratios.get(t, DEFAULT_RESTORE_RATIO.get(t, UNKNOWN_TIER_RESTORE_RATIO)) for t, n in c.lower_blocks.items()
            )
        else:
            c.restore_blocks = 0.0
        prefill_blocks = (c.prefill_tokens + c.queued_prefill_tokens) / bs + c.restore_blocks
        c.pressure = c.new_blocks * min(c.cached_blocks, c.total_blocks) / c.total_blocks if c.total_blocks > 0 else 0.0
        evicted = REUSED_EVICT_COST * c.evict_ratio * c.evicted_hot_blocks
        capacity = capacity_weight * (c.pressure + evicted) if c.total_blocks > 0 else 0.0
        c.cost = overlap_weight * prefill_blocks + c.decode_blocks + capacity + wait_weight * c.wait_blocks


def _tie_key(c: Candidate) -> tuple[float, int, int, int, str, int]:
    return (c.cost, c.decode_blocks, c.in_flight, c.cached_blocks, c.worker_id, c.dp_rank)


class Policy(abc.ABC):
    """Picks one of a non-empty list of scored candidates."""

    name: str

    @abc.abstractmethod
    def pick(self, candidates: Sequence[Candidate], pool: str) -> Candidate:
        """Choose; `pool` names the candidate set (model and role) for stateful policies."""


class KvPolicy(Policy):
    """Lowest cost, or softmax sampling over normalised costs when temperature > 0."""

    def __init__(self, name: str, temperature: float, rng: random.Random) -> None:
        self.name = name
        self.temperature = temperature
        self.rng = rng

    def pick(self, candidates: Sequence[Candidate], pool: str) -> Candidate:
        roomy = [c for c in candidates if not c.no_room]
        if roomy:
            candidates = roomy
        if self.temperature <= 0 or len(candidates) == 1:
            return min(candidates, key=_tie_key)
        ordered = sorted(candidates, key=_tie_key)
        lo, hi = ordered[0].cost, ordered[-1].cost
        spread = hi - lo
        weights = [math.exp(-((c.cost - lo) / spread if spread > 0 else 0.0) / self.temperature) for c in ordered]
        return self.rng.choices(ordered, weights=weights, k=1)[0]


class RoundRobinPolicy(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def pick(self, candidates: Sequence[Candidate], pool: str) -> Candidate:
        ordered = sorted(candidates, key=lambda c: (c.worker_id, c.dp_rank))
        i = self._next.get(pool, 0)
        self._next[pool] = i + 1
        return ordered[i % len(ordered)]


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, candidates: Sequence[Candidate], pool: str) -> Candidate:
        return self.rng.choice(sorted(candidates, key=lambda c: (c.worker_id, c.dp_rank)))


class LeastLoadedPolicy(Policy):
    name = "least-loaded"

    def pick(self, candidates: Sequence[Candidate], pool: str) -> Candidate:
        return min(candidates, key=lambda c: (c.decode_blocks, c.queued_prefill_tokens, c.in_flight, c.worker_id, c.dp_rank))


def make_policy(mode: RouterMode, *, temperature: float, rng: random.Random) -> Policy:
    """The policy object of a `--router-mode`."""
    if mode is RouterMode.KV:
        return KvPolicy("kv", temperature, rng)
    if mode is RouterMode.APPROXIMATE:
        return KvPolicy("approximate", temperature, rng)
    if mode is RouterMode.ROUND_ROBIN:
        return RoundRobinPolicy()
    if mode is RouterMode.RANDOM:
        return RandomPolicy(rng)
    return LeastLoadedPolicy()

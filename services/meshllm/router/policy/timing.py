"""How long workers take, as the router measures it from the streams it proxies.

A cache hit saves prefill time; joining a busy worker costs waiting time.
The `kv` cost counts the first in prefill blocks, so the second must be
priced in the same unit. Two figures, both measured from the legs the
router runs (no engine cooperation, any engine):

- **step time** of a worker: the time between its streams' tokens after
  the first (a continuous-batching engine emits one token per running
  sequence per step). Each finished leg with tokens after its first chunk
  gives one sample: (last chunk − first chunk) / tokens after the first
  chunk (a coalesced chunk of n tokens covers n steps); kept as an
  exponential moving average per (worker, dp rank).
- **prefill time per block** of a model: the slope of time to first token
  against prompt tokens computed, over legs that started on an idle worker
  (nothing in flight there: nothing to wait for, so their time to first
  token is prefill plus a constant overhead). An exponentially weighted
  least-squares fit; unknown until enough samples of different lengths
  were seen (a constant prompt length gives no slope). Its intercept is the
  **fixed time of a prefill step** (the engine's per-step cost plus the
  leg's constant overhead; the mocker's model: 16.5 ms a step).

`wait_blocks(...)`: a request sent to a worker that is running others
waits for the step in progress (half a step on average) and then shares its
first step with the running sequences (one more step's time on top of its
own prefill): 1.5 steps. While one of them is still waiting for its first
token, the step in progress is (or the next one will be) that request's
prefill, and a request arriving after it started waits for all of it: its
fixed part too — the intercept of the prefill fit (`fixed_ms`: a step's
fixed cost plus the constant overhead of a leg), which the prefill terms,
priced per token, never count. The wait is divided by the time of one
prefill block; 0 when the prefill time per block is unknown or nothing is
in flight there (each part is 0 while its own figure is unknown). With 8
callers over 4 workers and roomy caches, leaving the fixed part out put
`kv`'s TTFT p90 over round-robin's (docs/routing.md).

`restore_cost(tier, usage, block_ms)`: what bringing one block back from a
lower KV tier (host memory, disk) costs, in the same unit. The worker
advertises each tier in its LoadSnapshots (`KvTierUsage`): `block_bytes /
restore_bytes_per_s` is the restore time of a block, and over the model's
measured prefill time per block it is the *restore ratio* — the prefill
blocks one restored block is worth (0.02: fifty times cheaper than
computing it; above 1: slower than computing it). While the worker
advertises no bandwidth for the tier, or the prefill time is not measured
yet, the ratio is the tier's default (`DEFAULT_RESTORE_RATIO`: host 0.1,
disk 0.3 — a restore is assumed well worth it, disk less so, as on every
engine the peers and this mesh ship: PCIe and NVMe move a block faster than
a GPU computes it, and llama.cpp on a CPU restores a 500-token prompt in
tens of milliseconds where computing it takes seconds).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meshllm.router.kv.blocks import SlotKey
from meshllm.v1 import events_pb2

__all__ = [
    "BUSY_STEPS",
    "DEFAULT_RESTORE_RATIO",
    "PrefillFit",
    "RestoreCost",
    "WorkerTimes",
    "evict_ratio",
    "restore_cost",
    "restore_costs",
    "wait_blocks",
]

BUSY_STEPS = 1.5  # the rest of the step in progress (half on average) + the step the request shares
STEP_ALPHA = 0.2  # weight of a new step-time sample
FIT_DECAY = 0.98  # weight kept by older prefill samples per new one (about the last 50 count)
MIN_FIT_SAMPLES = 4  # samples before the prefill slope is trusted
MIN_FIT_SPREAD_TOKENS = 16.0  # standard deviation of the prompt lengths fitted, in tokens
DEFAULT_RESTORE_RATIO: dict[int, float] = {events_pb2.KV_TIER_HOST: 0.1, events_pb2.KV_TIER_DISK: 0.3}
UNKNOWN_TIER_RESTORE_RATIO = 0.5  # a tier value this router does not know (a newer engine's)


@dataclass(slots=True)
class PrefillFit:
    """Exponentially weighted least squares of time to first token (ms) against prefill tokens."""

    n: int = 0
    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, tokens: int, ttft_ms: float) -> None:
        d = FIT_DECAY
        self.n += 1
        self.w = self.w * d + 1.0
        self.x = self.x * d + tokens
        self.y = self.y * d + ttft_ms
        self.xx = self.xx * d + tokens * tokens
        self.xy = self.xy * d + tokens * ttft_ms

    @property
    def ms_per_token(self) -> float:
        """The fitted slope; 0 while unknown (too few samples, too little spread, or not positive)."""
        if self.n < MIN_FIT_SAMPLES:
            return 0.0
        var = self.xx / self.w - (self.x / self.w) ** 2
        if var < MIN_FIT_SPREAD_TOKENS**2:
            return 0.0
        slope = (self.xy / self.w - (self.x / self.w) * (self.y / self.w)) / var
        return slope if slope > 0 else 0.0

    @property
    def fixed_ms(self) -> float:
        """The fitted intercept: time to first token of a prompt with nothing to compute; 0 while unknown."""
        slope = self.ms_per_token
        if slope <= 0:
            return 0.0
        return max(0.0, self.y / self.w - slope * self.x / self.w)


class WorkerTimes:
    """Step time per (worker, dp rank) and prefill time per token per model (see the module docstring)."""

    def __init__(self) -> None:
        self._step_ms: dict[SlotKey, float] = {}
        self._prefill: dict[str, PrefillFit] = {}
        self.changed: set[SlotKey] = set()  # slots whose step time changed since a fleet table last read them

    def step(self, key: SlotKey, ms_per_token: float) -> None:
        """One leg's mean time between tokens after its first chunk."""
        old = self._step_ms.get(key)
        self.changed.add(key)
        self._step_ms[key] = ms_per_token if old is None else old + STEP_ALPHA * (ms_per_token - old)

    def prefill(self, model: str, tokens: int, ttft_ms: float) -> None:
        """One leg that started on an idle worker: `tokens` computed, first token after `ttft_ms`."""
        fit = self._prefill.get(model)
        if fit is None:
            fit = self._prefill[model] = PrefillFit()
        fit.add(tokens, ttft_ms)

    def step_ms(self, key: SlotKey) -> float:
        """The worker's measured step time (0 = not measured yet)."""
        return self._step_ms.get(key, 0.0)

    def block_ms(self, model: str, block_size: int) -> float:
        """Prefill time of one block of `model` (0 = not known yet)."""
        fit = self._prefill.get(model)
        return fit.ms_per_token * block_size if fit is not None else 0.0

    def fixed_ms(self, model: str) -> float:
        """Time to first token of `model` beside the prompt's prefill (the fit's intercept; 0 = not known yet)."""
        fit = self._prefill.get(model)
        return fit.fixed_ms if fit is not None else 0.0

    def remove_worker(self, worker_id: str) -> None:
        for key in [k for k in self._step_ms if k[0] == worker_id]:
            del self._step_ms[key]
            self.changed.add(key)


def wait_blocks(in_flight: int, step_ms: float, block_ms: float, *, prefilling: int = 0, fixed_ms: float = 0.0) -> float:
    """The expected wait on a worker running `in_flight` requests, in prefill blocks (see the module docstring).

    `BUSY_STEPS` of its steps (0 while `step_ms` is unknown), plus a prefill
    step's fixed time `fixed_ms` when `prefilling` of them have no first
    token yet; 0 when it is idle or `block_ms` is unknown.
    """
    if in_flight <= 0 or block_ms <= 0:
        return 0.0
    ms = BUSY_STEPS * step_ms if step_ms > 0 else 0.0
    if prefilling > 0 and fixed_ms > 0:
        ms += fixed_ms
    return ms / block_ms


@dataclass(frozen=True, slots=True)
class RestoreCost:
    """The cost of restoring one block from a lower tier of one worker."""

    tier: int  # KV_TIER_HOST, KV_TIER_DISK
    ms_per_block: float  # block_bytes / restore_bytes_per_s as the worker advertises it (0 = not advertised)
    ratio: float  # prefill blocks one restored block costs (the advertised time over prefill_ms_per_block, or the default)


def restore_cost(tier: int, usage: events_pb2.KvTierUsage | None, block_ms: float) -> RestoreCost:
    """Restore cost of `tier` from the worker's advertised `usage` and the model's prefill time per block."""
    ms = 0.0
    if usage is not None and usage.block_bytes > 0 and usage.restore_bytes_per_s > 0:
        ms = usage.block_bytes / usage.restore_bytes_per_s * 1000.0
    if ms > 0 and block_ms > 0:
        return RestoreCost(tier, ms, ms / block_ms)
    return RestoreCost(tier, ms, DEFAULT_RESTORE_RATIO.get(tier, UNKNOWN_TIER_RESTORE_RATIO))


def restore_costs(tiers: Iterable[int], usages: Iterable[events_pb2.KvTierUsage], block_ms: float) -> list[RestoreCost]:
    """`restore_cost` of each of `tiers`, from a LoadSnapshot's `tiers` list (`usages`)."""
    by_tier: dict[int, events_pb2.KvTierUsage] = {int(u.tier): u for u in usages}
    return [restore_cost(t, by_tier.get(t), block_ms) for t in tiers]


def evict_ratio(usages: Iterable[events_pb2.KvTierUsage], block_ms: float) -> float:
    """Prefill blocks an evicted reused block costs: 1 without lower tiers, else the nearest tier's ratio (≤ 1).

    An engine with lower tiers moves the blocks it evicts from the device
    cache into the nearest one, so a reused prefix it evicts comes back at
    that tier's restore cost instead of being computed again.
    """
    nearest = min((u for u in usages if u.tier and u.bytes_capacity > 0), key=lambda u: u.tier, default=None)
    if nearest is None:
        return 1.0
    return min(1.0, restore_cost(nearest.tier, nearest, block_ms).ratio)

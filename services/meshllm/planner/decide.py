"""The scaling decision: workers the predicted load needs (`needed`), how far the mesh is off its profile
(`corrections`), and the per-role hysteresis and cooldowns that turn a need into a replica count (`Scaler`).

After NVIDIA Dynamo's SLA planner: prefill workers = predicted prefill tokens/s / one worker's capacity at
the TTFT target; decode workers = predicted output tokens/s / one worker's best throughput at the ITL target.

A correction (observed latency / what the profile predicts) scales the profile's latencies: the capacity is
read where the corrected latency meets the target, as Dynamo divides the ITL target by the decode
correction. Unlike Dynamo's row lookup, the decode capacity is continuous between the profile's
concurrencies (Profile.decode_capacity): with an ITL nearly flat in concurrency (a batch-bound engine), a
row lookup can fall from the 16-stream row to the 1-stream row on a correction of 1.2 and ask for ten times
the workers. As in Dynamo, the prefill correction only ever loosens (min(1, correction)): a TTFT above the
profile's can come from elsewhere (decode admission, the KV handoff), where more prefill workers do not help.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from meshllm.planner.model import Decision, Load, Observation
from meshllm.planner.profile import MAX_UTILISATION, Capacity, Profile

__all__ = ["AS_PROFILED", "CORRECTION_RANGE", "MODES", "Corrections", "Scaler", "corrections", "decode_saturated", "needed"]

CORRECTION_RANGE = (0.5, 4.0)  # one bad interval (a cold cache, a GC pause) must not scale the mesh 10x
MODES = ("disagg", "agg")  # `--mode`: prefill and decode pools, or one pool of aggregated workers


class Corrections(NamedTuple):
    """Observed latency / what the profile predicts for the observed load (1.0 = as profiled)."""

    prefill: float
    decode: float


AS_PROFILED = Corrections(1.0, 1.0)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


def _prefill_need(load: Load, profile: Profile, target_s: float, correction: float) -> tuple[float, str]:
    if load.prefill_tokens_per_s <= 0:
        return 0.0, "no prefill predicted"
    correction = min(1.0, correction)
    cap = profile.prefill_capacity(load.isl, target_s, correction=correction)
    detail = f"ISL {load.isl:,.0f}{_corrected(correction)}"
    return _need("prefill", load.prefill_tokens_per_s, cap, f"TTFT p90 ≤ {_ms(target_s)} ({detail})",
                 f"TTFT {_ms(cap.latency_s)} idle")  # fmt: skip


def _decode_need(load: Load, profile: Profile, target_s: float, correction: float) -> tuple[float, str]:
    if load.decode_tokens_per_s <= 0:
        return 0.0, "no decode predicted"
    context = load.isl + load.osl / 2
    cap = profile.decode_capacity(context, target_s, correction=correction)
    detail = f"context {context:,.0f}, {_streams(cap.load)}{_corrected(correction)}"
    return _need("decode", load.decode_tokens_per_s, cap, f"ITL ≤ {_ms(target_s)} ({detail})",
                 f"ITL {_ms(cap.latency_s)} at {_streams(cap.load)}")  # fmt: skip


def _need(role: str, tokens_per_s: float, cap: Capacity, at: str, floor: str) -> tuple[float, str]:
    """Workers `role` needs for `tokens_per_s` at one worker's capacity `cap`, and the reason in numbers."""
    need = tokens_per_s / cap.tokens_per_s
    reason = f"{role} {tokens_per_s:,.0f} tok/s predicted / {cap.tokens_per_s:,.0f} tok/s per worker at {at} → {need:.1f}"
    if not cap.reachable:
        reason += f"; target below the profile's floor ({floor})"
    return need, reason


def _streams(n: float) -> str:
    return f"{n:.0f} stream" + ("" if n == 1 else "s")


def _corrected(correction: float) -> str:
    return f", correction {correction:.2f}" if abs(correction - 1.0) >= 0.005 else ""


def needed(
    load: Load,
    profile: Profile,
    ttft_target_s: float,
    itl_target_s: float,
    *,
    prefill_correction: float = 1.0,
    decode_correction: float = 1.0,
    mode: str = "disagg",
) -> dict[str, tuple[float, str]]:
    """Workers each role needs for `load` (fractional: the Scaler rounds), with the reason in numbers.

    Prefill: the predicted prefill tokens/s over one worker's capacity at the TTFT target, with service times
    stretched by the prefill correction. Decode: the predicted output tokens/s over one worker's best
    throughput whose ITL meets itl_target_s / decode_correction. Aggregated: one pool, whose need is the sum of
    the two (each worker's time split between prefill and decode).
    """
    if mode not in MODES:
        raise ValueError(f"unknown planner mode {mode!r}; choose one of: {', '.join(MODES)}")
    if load.prefill_tokens_per_s <= 0 and load.decode_tokens_per_s <= 0:
        roles = ("agg",) if mode == "agg" else ("prefill", "decode")
        return {role: (0.0, "no load predicted") for role in roles}
    p_need, p_reason = _prefill_need(load, profile, ttft_target_s, prefill_correction)
    d_need, d_reason = _decode_need(load, profile, itl_target_s, decode_correction)
    if mode == "agg":
        return {"agg": (p_need + d_need, f"{p_reason} + {d_reason} = {p_need + d_need:.1f}")}
    return {"prefill": (p_need, p_reason), "decode": (d_need, d_reason)}


def _clamp_correction(value: float) -> float:
    lo, hi = CORRECTION_RANGE
    return min(max(value, lo), hi) if math.isfinite(value) else 1.0


def _pool(obs: Observation, role: str) -> int:
    return max(obs.workers.get(role) or obs.workers.get("agg") or 1, 1)


def corrections(obs: Observation, profile: Profile, last: Corrections = AS_PROFILED) -> Corrections:
    """How far the mesh is off its profile in one interval, each clamped to CORRECTION_RANGE; `last`'s value
    where the interval says nothing of it (no sample; for decode, a saturated pool).

    Prefill: observed TTFT p90 / the profile's TTFT p90 at the observed ISL and at the utilisation the
    observed prefill tokens/s put on the live prefill workers (queueing is in the model, so it is not counted
    as the mesh being slow; a backlog beyond MAX_UTILISATION still is). Decode: observed ITL p90 / the
    profile's ITL at context isl + osl/2 and the streams per decode worker, by Little's law on tokens:
    output tokens/s per worker × ITL (each stream sends one token per ITL). Not measured when each decode
    worker streamed at least the most one worker delivered in the profile (`decode_saturated`): its sequences
    were waiting for a batch slot, so the ITL grew with the backlog, beyond what the profile covers, not
    because the mesh runs slower than profiled. Measured there, one late interval read as a correction of 2.2
    and asked for 2.6× the workers the load needed (bench/planner.py's first runs).
    """
    prefill, decode = last
    if obs.isl is not None and obs.isl > 0 and obs.ttft_p90_s is not None:
        workers = _pool(obs, "prefill")
        utilisation = obs.request_rate * obs.isl / workers / profile.prefill_rate(obs.isl)
        expected = profile.prefill_ttft_p90(obs.isl, min(utilisation, MAX_UTILISATION))
        prefill = _clamp_correction(obs.ttft_p90_s / expected)
    rate = obs.output_rate
    if obs.isl is not None and obs.osl is not None and rate is not None and obs.itl_p90_s is not None and obs.itl_p90_s > 0:
        context = obs.isl + obs.osl / 2
        per_worker = rate / _pool(obs, "decode")
        if not decode_saturated(per_worker, context, profile):
            expected = profile.decode_itl(context, max(per_worker * obs.itl_p90_s, 1.0))
            decode = _clamp_correction(obs.itl_p90_s / expected)
    return Corrections(prefill, decode)


def decode_saturated(tokens_per_s: float, context: float, profile: Profile) -> bool:
    """Whether one decode worker streaming `tokens_per_s` at `context` ran at (or past) the most the profile saw
    one worker deliver there: a full batch with a queue behind it."""
    return tokens_per_s >= profile.decode_peak_rate(context)


def _ceil(x: float) -> int:
    return math.ceil(x - 1e-9)  # 3.0000000001 from float arithmetic is 3 workers, not 4


@dataclass(slots=True)
class _RoleState:
    last_up: float | None = None  # when the last scale-up was decided
    last_change: float | None = None  # when the last change of either direction was decided
    below: int = 0  # consecutive intervals in which a scale-down was wanted
    peak: float = 0.0  # the largest need of those intervals: a scale-down goes no lower than it covers


class Scaler:
    """Per role: a need (fractional workers) and the current count in, a `Decision` out.

    - min/max win over everything; a current count outside them is brought inside at once.
    - Up at once to ceil(need) when it exceeds the current count, unless the last scale-up was less than
      `up_cooldown_s` ago (started workers are still coming up; the need may be counting their absence).
    - Down only while ceil(need + down_margin) < current (the need fits one worker fewer with a margin
      spare: the hysteresis band that keeps a need hovering at a boundary from flapping) for `down_intervals`
      consecutive intervals, and no change of the role in `down_cooldown_s`; then to what the largest need of
      those intervals asks for (with the margin), at most `max_step_down` workers at a time (None: no limit).
      One worker at a time would hold a fallen load's workers for a cooldown each.

    Time comes in (`now`); `decide` assumes its decision is carried out. `state()`/`restore()` round-trip
    through a plain JSON dict.
    """

    def __init__(
        self,
        limits: Mapping[str, tuple[int, int]],
        *,
        down_margin: float = 0.2,
        down_intervals: int = 3,
        up_cooldown_s: float = 30.0,
        down_cooldown_s: float = 300.0,
        max_step_down: int | None = None,
    ) -> None:
        for role, (lo, hi) in limits.items():
            if lo < 0 or hi < lo:
                raise ValueError(f"{role}: replicas min {lo} and max {hi} need 0 ≤ min ≤ max")
        if down_intervals < 1 or (max_step_down is not None and max_step_down < 1) or down_margin < 0:
            raise ValueError("down_intervals and max_step_down must be ≥ 1, down_margin ≥ 0")
        self.limits = dict(limits)
        self.down_margin = down_margin
        self.down_intervals = down_intervals
        self.up_cooldown_s = up_cooldown_s
        self.down_cooldown_s = down_cooldown_s
        self.max_step_down = max_step_down
        self._roles: dict[str, _RoleState] = {role: _RoleState() for role in limits}

    def decide(self, role: str, need: float, current: int, now: float, *, why: str = "") -> Decision:
        """The decision for `role` given its `need` (workers, fractional) and `current` live count at `now`;
        `why` (needed()'s reason) is appended to the rule that held."""
        if role not in self.limits:
            raise ValueError(f"no replica limits for role {role!r} (have {', '.join(self.limits)})")
        st = self._roles[role]
        need = max(need, 0.0) if math.isfinite(need) else float("nan")
        wanted = _ceil(need) if math.isfinite(need) else current
        target, rule = self._rule(role, st, need, wanted, current, now)
        if target != current:
            st.last_change = now
            st.below, st.peak = 0, 0.0
            if target > current:
                st.last_up = now
        return Decision(
            at=now, role=role, current=current, target=target, wanted=wanted, reason=f"{rule}; {why}" if why else rule
        )

    def _rule(self, role: str, st: _RoleState, need: float, wanted: int, current: int, now: float) -> tuple[int, str]:
        lo, hi = self.limits[role]
        if current < lo:
            return lo, f"up: below min {lo}"
        if current > hi:
            return hi, f"down: above max {hi}"
        if not math.isfinite(need):
            st.below = 0
            return current, "hold: need unknown"
        if wanted > current:
            st.below = 0
            return self._up(st, need, wanted, current, hi, now)
        down_to = self._fits(need, lo)
        if down_to >= current:
            st.below, st.peak = 0, 0.0
            return current, f"at min {lo}" if current == lo and wanted < lo else f"hold: need {need:.1f} fits {current}"
        st.below += 1
        st.peak = max(st.peak, need)
        if st.below < self.down_intervals:
            return current, f"hold: need {need:.1f} below {current} for {st.below} of {self.down_intervals} intervals"
        left = self._left(st.last_change, self.down_cooldown_s, now)
        if left > 0:
            return current, f"hold: down cooldown {left:.0f} s left (need {need:.1f})"
        target = self._fits(st.peak, lo)
        if self.max_step_down is not None:
            target = max(target, current - self.max_step_down)
        return target, f"down: need ≤ {st.peak:.1f} for {st.below} intervals"

    def _fits(self, need: float, lo: int) -> int:
        """Workers that carry `need` with the down margin to spare, at least `lo` (no load at all: `lo`)."""
        return max(_ceil(need + self.down_margin) if need > 0 else 0, lo)

    def _up(self, st: _RoleState, need: float, wanted: int, current: int, hi: int, now: float) -> tuple[int, str]:
        if current >= hi:
            return current, f"at max {hi} (need {need:.1f})"
        left = self._left(st.last_up, self.up_cooldown_s, now)
        if left > 0:
            return current, f"hold: up cooldown {left:.0f} s left (need {need:.1f})"
        target = min(wanted, hi)
        return target, f"up: need {need:.1f}" + (f", at max {hi}" if target < wanted else "")

    @staticmethod
    def _left(since: float | None, cooldown_s: float, now: float) -> float:
        return 0.0 if since is None else max(since + cooldown_s - now, 0.0)

    def state(self) -> dict[str, Any]:
        """The per-role memory as a plain JSON dict."""
        return {
            "version": 1,
            "roles": {
                role: {"last_up": st.last_up, "last_change": st.last_change, "below": st.below, "peak": st.peak}
                for role, st in self._roles.items()
            },
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back a `state()`; roles it does not know start fresh, unknown ones are ignored. A malformed
        dict raises ValueError and leaves the scaler as it was."""
        if state.get("version") != 1 or not isinstance(state.get("roles"), Mapping):
            raise ValueError(f"scaler state: unknown version or no roles: {state!r:.200}")
        roles: dict[str, _RoleState] = {}
        for role in self.limits:
            saved = state["roles"].get(role) or {}
            try:
                roles[role] = _RoleState(
                    last_up=_time(saved.get("last_up")),
                    last_change=_time(saved.get("last_change")),
                    below=int(saved.get("below", 0)),
                    peak=float(saved.get("peak", 0.0)),
                )
            except (TypeError, ValueError) as e:
                raise ValueError(f"scaler state for {role!r}: {e}") from None
        self._roles = roles


def _time(value: Any) -> float | None:
    return None if value is None else float(value)

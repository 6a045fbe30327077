"""The scaling decision: needed(), corrections() and the Scaler's hysteresis, cooldowns and limits."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import pytest
from planner_support import itl, make_profile

from meshllm.planner.decide import AS_PROFILED, Corrections, Scaler, corrections, decode_saturated, needed
from meshllm.planner.model import Decision, Load, Observation
from meshllm.planner.profile import Profile


@pytest.fixture
def profile() -> Profile:
    return make_profile()


def test_needed_disaggregated_follows_the_capacities(profile: Profile) -> None:
    load = Load(request_rate=10.0, isl=730.0, osl=200.0)
    need = needed(load, profile, ttft_target_s=0.5, itl_target_s=0.02)
    prefill_cap = profile.prefill_capacity(730, 0.5).tokens_per_s
    decode_cap = profile.decode_capacity(830, 0.02).tokens_per_s
    assert need["prefill"][0] == pytest.approx(7300 / prefill_cap)
    assert need["decode"][0] == pytest.approx(2000 / decode_cap)
    reason = need["prefill"][1]
    assert reason.startswith("prefill 7,300 tok/s predicted / ") and "TTFT p90 ≤ 500 ms (ISL 730)" in reason
    assert reason.endswith(f"→ {need['prefill'][0]:.1f}")
    assert f"ITL ≤ 20 ms (context 830, {profile.decode_capacity(830, 0.02).load:.0f} streams)" in need["decode"][1]


def test_needed_scales_with_the_load_and_the_corrections(profile: Profile) -> None:
    base = needed(Load(10.0, 730.0, 200.0), profile, 0.5, 0.02)
    double = needed(Load(20.0, 730.0, 200.0), profile, 0.5, 0.02)
    assert double["prefill"][0] == pytest.approx(2 * base["prefill"][0])
    slow = needed(Load(10.0, 730.0, 200.0), profile, 0.5, 0.02, prefill_correction=1.5, decode_correction=1.5)
    assert slow["decode"][0] > base["decode"][0]  # a slower decode meets the ITL target at fewer streams
    assert "correction 1.50" in slow["decode"][1]
    assert slow["prefill"][0] == pytest.approx(base["prefill"][0])  # a TTFT above the profile's adds no prefill
    fast = needed(Load(10.0, 730.0, 200.0), profile, 0.5, 0.02, prefill_correction=0.8, decode_correction=0.8)
    assert fast["prefill"][0] < base["prefill"][0] and fast["decode"][0] < base["decode"][0]
    assert "correction 0.80" in fast["prefill"][1]


def test_needed_aggregated_is_one_pool_summing_both(profile: Profile) -> None:
    load = Load(10.0, 730.0, 200.0)
    split = needed(load, profile, 0.5, 0.02)
    agg = needed(load, profile, 0.5, 0.02, mode="agg")
    assert list(agg) == ["agg"]
    assert agg["agg"][0] == pytest.approx(split["prefill"][0] + split["decode"][0])


def test_needed_reports_an_unreachable_target(profile: Profile) -> None:
    need = needed(Load(10.0, 2048.0, 200.0), profile, ttft_target_s=0.05, itl_target_s=0.005)
    assert "target below the profile's floor (TTFT 122 ms idle)" in need["prefill"][1]
    assert need["prefill"][0] == pytest.approx(10 * 2048 / (2048 / profile.prefill_ttft(2048)))
    assert "target below the profile's floor (ITL" in need["decode"][1]


def test_needed_rejects_an_unknown_mode(profile: Profile) -> None:
    with pytest.raises(ValueError, match="choose one of: disagg, agg"):
        needed(Load(1.0, 100.0, 10.0), profile, 0.5, 0.02, mode="split")


def test_needed_without_load(profile: Profile) -> None:
    assert needed(Load(0.0, 0.0, 0.0), profile, 0.5, 0.02) == {
        "prefill": (0.0, "no load predicted"),
        "decode": (0.0, "no load predicted"),
    }


BASE = Observation(at=0.0, interval_s=10.0, requests=20.0, isl=730.0, osl=200.0, ttft_p90_s=None, itl_p90_s=None)


def observation(**changes: Any) -> Observation:
    return dataclasses.replace(BASE, **({"workers": {"prefill": 2, "decode": 2}} | changes))


def test_corrections_compare_with_the_profile_at_the_observed_load(profile: Profile) -> None:
    assert corrections(observation(), profile) == (1.0, 1.0)  # no latency samples
    # 2 requests/s of 730 tokens over 2 workers: utilisation ~0.05, so the profile expects the bare TTFT
    expected_ttft = profile.prefill_ttft(730)
    assert corrections(observation(ttft_p90_s=2 * expected_ttft), profile).prefill == pytest.approx(2.0)
    # decode: 1 request/s per worker x 200 tokens x 20 ms = 4 streams at context 830
    expected_itl = profile.decode_itl(830, 1.0 * 200 * 0.02)
    assert corrections(observation(itl_p90_s=0.02), profile).decode == pytest.approx(0.02 / expected_itl)
    # a mesh as fast as profiled: the ITL of 4 streams, at a rate that keeps 4 streams on each worker
    as_profiled = observation(itl_p90_s=itl(830, 4), requests=10 * 2 * 4 / (200 * itl(830, 4)))
    assert corrections(as_profiled, profile).decode == pytest.approx(1.0)


def test_corrections_count_queueing_as_expected_not_as_slowness(profile: Profile) -> None:
    requests = 10 * 0.8 * profile.prefill_rate(730) / 730  # one prefill worker 80 % busy
    queued = profile.prefill_ttft_p90(730, 0.8)
    assert queued > 2 * profile.prefill_ttft(730)
    busy = observation(requests=requests, ttft_p90_s=queued, workers={"prefill": 1, "decode": 1})
    assert corrections(busy, profile).prefill == pytest.approx(1.0)


def test_a_saturated_decode_pool_keeps_the_last_decode_correction(profile: Profile) -> None:
    peak = profile.decode_peak_rate(830)
    assert profile.decode_peak_rate(512) == pytest.approx(64 / itl(512, 64))  # the most streams deliver the most
    assert 64 / itl(2048, 64) < peak < 64 / itl(512, 64)  # linear in context between the rows
    # 2 decode workers, each streaming at the profile's peak with ITLs 5x the profile's: a backlog, not slowness
    tokens = 10 * 2 * peak  # over the 10-s interval
    saturated = observation(output_tokens=tokens, itl_p90_s=5 * itl(830, 16))
    assert decode_saturated(peak, 830, profile) and not decode_saturated(0.9 * peak, 830, profile)
    last = Corrections(0.8, 1.3)
    assert corrections(saturated, profile, last).decode == 1.3
    assert corrections(saturated, profile).decode == AS_PROFILED.decode
    # the same ITLs at 90 % of the peak are measured (and clamped)
    busy = observation(output_tokens=0.9 * tokens, itl_p90_s=5 * itl(830, 16))
    assert corrections(busy, profile, last).decode > 1.3


def test_an_interval_without_latency_samples_keeps_the_last_corrections(profile: Profile) -> None:
    last = Corrections(0.7, 1.4)
    assert corrections(observation(), profile, last) == last


def test_corrections_are_clamped(profile: Profile) -> None:
    c = corrections(observation(ttft_p90_s=100.0, itl_p90_s=1e-6), profile)
    assert c == (4.0, 0.5)


# --- Scaler ---


def scaler(**kw: float) -> Scaler:
    opts: dict[str, float] = dict(down_intervals=2, up_cooldown_s=30.0, down_cooldown_s=120.0) | kw
    return Scaler({"prefill": (1, 8), "decode": (0, 4)}, **opts)  # type: ignore[arg-type]


def test_scales_up_at_once_to_the_ceiling() -> None:
    d = scaler().decide("prefill", 3.2, 1, now=0.0, why="prefill …")
    assert (d.target, d.wanted, d.direction) == (4, 4, "up")
    assert d.reason == "up: need 3.2; prefill …"
    assert scaler().decide("prefill", 3.0000000001, 1, now=0.0).target == 3  # float dust is not a worker


def test_up_cooldown_after_an_up() -> None:
    s = scaler()
    s.decide("prefill", 2.5, 1, now=0.0)
    d = s.decide("prefill", 5.0, 3, now=12.0)
    assert d.target == 3 and d.reason == "hold: up cooldown 18 s left (need 5.0)"
    assert s.decide("prefill", 5.0, 3, now=30.0).target == 5


def test_down_only_after_n_intervals_and_the_cooldown() -> None:
    s = scaler()
    s.decide("prefill", 4.0, 2, now=0.0)  # up to 4 at t=0
    d1 = s.decide("prefill", 1.4, 4, now=60.0)
    assert d1.target == 4 and d1.reason == "hold: need 1.4 below 4 for 1 of 2 intervals"
    d2 = s.decide("prefill", 1.4, 4, now=90.0)
    assert d2.target == 4 and d2.reason == "hold: down cooldown 30 s left (need 1.4)"
    d3 = s.decide("prefill", 1.4, 4, now=120.0)
    assert (d3.target, d3.reason) == (2, "down: need ≤ 1.4 for 3 intervals")  # to what the need asks for
    assert s.decide("prefill", 1.0, 2, now=130.0).target == 2  # 1.0 + 0.2 does not fit one worker


def test_down_goes_to_the_largest_need_of_the_intervals_it_waited() -> None:
    s = scaler(down_intervals=3, down_cooldown_s=0.0)
    for now, need in ((0.0, 1.1), (10.0, 2.6), (20.0, 0.4)):
        d = s.decide("prefill", need, 6, now=now)
    assert (d.target, d.reason) == (3, "down: need ≤ 2.6 for 3 intervals")  # ceil(2.6 + 0.2), not ceil(0.4)


def test_max_step_down_bounds_a_scale_down() -> None:
    s = scaler(down_intervals=1, down_cooldown_s=0.0, max_step_down=1)
    assert s.decide("prefill", 0.5, 4, now=0.0).target == 3
    assert s.decide("prefill", 0.5, 3, now=10.0).target == 2


def test_a_need_back_above_resets_the_down_count() -> None:
    s = scaler(down_intervals=3)
    for now, need in ((0.0, 1.0), (10.0, 1.0), (20.0, 2.9), (30.0, 1.0), (40.0, 1.0)):
        d = s.decide("prefill", need, 3, now=now)
        assert d.target == 3
    assert s.decide("prefill", 1.0, 3, now=50.0).target == 2


def test_hysteresis_band() -> None:
    s = scaler(down_intervals=1, down_cooldown_s=0.0)
    assert s.decide("prefill", 1.81, 3, now=0.0).reason == "hold: need 1.8 fits 3"  # 1.81 + 0.2 does not fit 2
    assert s.decide("prefill", 1.8, 3, now=1.0).target == 2


def test_limits_win_over_everything() -> None:
    s = scaler()
    d = s.decide("prefill", 20.0, 8, now=0.0)
    assert (d.target, d.wanted, d.reason) == (8, 20, "at max 8 (need 20.0)")
    assert s.decide("prefill", 20.0, 5, now=0.0).reason == "up: need 20.0, at max 8"
    assert s.decide("prefill", 20.0, 10, now=0.0).target == 8  # above max: down at once, no cooldown
    assert s.decide("prefill", 0.0, 0, now=1.0).target == 1  # below min: up at once
    assert s.decide("prefill", 0.0, 1, now=2.0).reason == "at min 1"
    zero = scaler(down_intervals=1, down_cooldown_s=0.0)
    assert zero.decide("decode", 0.0, 1, now=0.0).target == 0  # decode's min is 0
    with pytest.raises(ValueError, match="no replica limits for role 'agg'"):
        zero.decide("agg", 1.0, 1, now=0.0)


def test_roles_are_independent() -> None:
    s = scaler()
    s.decide("prefill", 3.0, 1, now=0.0)
    assert s.decide("decode", 3.0, 1, now=1.0).target == 3  # no up cooldown from prefill's change


def run(s: Scaler, needs: list[float], start: int, t0: float = 0.0) -> list[Decision]:
    current, out = start, []
    for i, need in enumerate(needs):
        d = s.decide("prefill", need, current, now=t0 + 10.0 * i)
        current = d.target
        out.append(d)
    return out


def test_state_round_trip_continues_identically() -> None:
    rng = random.Random(7)
    needs = [max(0.0, 3 + 2.5 * rng.uniform(-1, 1)) for _ in range(60)]
    a = scaler()
    first = run(a, needs[:30], start=2)
    b = scaler()
    b.restore(json.loads(json.dumps(a.state())))
    rest_a = run(a, needs[30:], start=first[-1].target, t0=300.0)
    rest_b = run(b, needs[30:], start=first[-1].target, t0=300.0)
    assert rest_a == rest_b
    assert len({d.target for d in first + rest_a}) > 1  # the series did make it scale


def test_restore_rejects_a_malformed_state() -> None:
    s = scaler()
    with pytest.raises(ValueError, match="unknown version"):
        s.restore({"roles": {}})
    with pytest.raises(ValueError, match="scaler state for 'prefill'"):
        s.restore({"version": 1, "roles": {"prefill": {"last_up": "soon"}}})
    s.restore({"version": 1, "roles": {}})  # roles it does not know start fresh
    assert s.state()["roles"]["prefill"] == {"last_up": None, "last_change": None, "below": 0, "peak": 0.0}


def test_no_flapping_on_a_noisy_constant_load() -> None:
    rng = random.Random(1234)
    needs = [2.5 + rng.uniform(-0.45, 0.45) for _ in range(500)]
    decisions = run(scaler(down_intervals=3, up_cooldown_s=0.0, down_cooldown_s=0.0), needs, start=2)
    changes = [d for d in decisions if d.target != d.current]
    assert len(changes) == 1 and changes[0].target == 3

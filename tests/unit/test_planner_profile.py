"""The engine profile: its file (round trip, atomic save, validation) and the capacities it gives."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest
from planner_support import itl, make_profile

from meshllm.errors import ConfigError
from meshllm.planner.profile import MAX_UTILISATION, PrefillPoint, Profile, ttft_p90


def test_round_trip_through_the_file(tmp_path: Path) -> None:
    profile = make_profile()
    path = tmp_path / "profile.json"
    profile.save(path)
    assert Profile.load(path) == profile
    assert json.loads(path.read_text())["version"] == 1
    assert Profile.from_json(profile.to_json()) == profile
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]  # no temporary file left behind


def test_save_replaces_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "profile.json"
    make_profile().save(path)
    before = path.read_text()

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", broken_replace)
    changed = make_profile()
    changed.engine = "vllm"
    with pytest.raises(OSError, match="disk gone"):
        changed.save(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]


def good() -> dict[str, Any]:
    return make_profile().to_json()


def edited(path: str, value: Any) -> dict[str, Any]:
    """good() with one field set (a dotted path with list indexes); value ... deletes it."""
    data = good()
    *parents, last = path.split(".")
    node: Any = data
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("version", 2, "version must be 1, got 2"),
        ("engine", ..., "engine is missing"),
        ("engine_args", "--x", "engine_args must be a list"),
        ("measured_at", "yesterday", "measured_at is not an ISO 8601 time"),
        ("prefill", [], "prefill has no rows"),
        ("decode", ..., "decode is missing"),
        ("prefill.1.ttft_s", -0.5, r"prefill\[1\].ttft_s must be positive, got -0.5"),
        ("prefill.0.isl", 12.5, r"prefill\[0\].isl must be an integer"),
        ("decode.3.itl_s", ..., r"decode\[3\].itl_s is missing"),
        ("decode.2.concurrency", "4", r"decode\[2\].concurrency must be a number"),
        ("prefill.1.isl", 128, "prefill repeats isl 128"),
    ],
)
def test_validation_names_the_file_and_the_field(tmp_path: Path, path: str, value: Any, message: str) -> None:
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(edited(path, value)))
    with pytest.raises(ConfigError, match=f"profile {file}: {message}"):
        Profile.load(file)


def test_unreadable_or_not_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read it"):
        Profile.load(tmp_path / "missing.json")
    (tmp_path / "p.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not JSON"):
        Profile.load(tmp_path / "p.json")


def test_prefill_ttft_interpolates_and_extrapolates_linearly() -> None:
    p = make_profile()
    assert p.prefill_ttft(512) == pytest.approx(0.02 + 512 / 20000)
    assert p.prefill_ttft(1000) == pytest.approx(0.02 + 1000 / 20000)
    assert p.prefill_ttft(16384) == pytest.approx(0.02 + 16384 / 20000)  # beyond the last row
    assert p.prefill_ttft(0) == pytest.approx(0.02)
    one = Profile("x", (PrefillPoint(100, 0.5, 200.0),), make_profile().decode)
    assert one.prefill_ttft(10_000) == 0.5  # one row: nothing to extrapolate from
    steep = Profile("x", (PrefillPoint(100, 0.5, 200.0), PrefillPoint(200, 0.1, 2000.0)), make_profile().decode)
    assert steep.prefill_ttft(1000) > 0  # a falling line never goes below a small positive value


def test_ttft_p90_model() -> None:
    assert ttft_p90(0.05, 0.1, 0.1) == 0.1  # few requests wait at all
    assert ttft_p90(0.5, 0.1, 0.1) == pytest.approx(0.1 + 0.1 * 1.6094 / 1.0, rel=1e-4)
    values = [ttft_p90(u / 100, 0.1, 0.1) for u in range(10, 96)]
    assert values == sorted(values)


def test_prefill_capacity_shrinks_as_the_target_tightens() -> None:
    p = make_profile()
    caps = [p.prefill_capacity(730, target) for target in (2.0, 0.5, 0.2, 0.1, 0.06)]
    rates = [c.tokens_per_s for c in caps]
    assert rates == sorted(rates, reverse=True) and len(set(rates)) == len(rates)
    service_rate = 730 / p.prefill_ttft(730)
    for target, cap in zip((2.0, 0.5, 0.2, 0.1, 0.06), caps, strict=True):
        assert cap.reachable and cap.latency_s <= target
        assert cap.tokens_per_s == pytest.approx(cap.load * service_rate)
        assert cap.load <= MAX_UTILISATION
    assert caps[0].load == MAX_UTILISATION  # a loose target still keeps the queue bounded


def test_prefill_capacity_when_the_target_is_below_the_floor() -> None:
    p = make_profile()
    cap = p.prefill_capacity(2048, 0.05)  # an idle worker already takes 122 ms
    assert not cap.reachable
    assert cap.latency_s == pytest.approx(p.prefill_ttft(2048))
    assert cap.tokens_per_s == pytest.approx(2048 / p.prefill_ttft(2048))  # the bare service rate


def test_prefill_correction_stretches_service_times() -> None:
    p = make_profile()
    plain, slow = p.prefill_capacity(730, 0.3), p.prefill_capacity(730, 0.3, correction=2.0)
    assert slow.tokens_per_s < plain.tokens_per_s / 2
    assert not p.prefill_capacity(730, 0.1, correction=2.0).reachable  # 2 x 56.5 ms idle > 100 ms


def test_prefill_rate_uses_a_saturation_measurement_when_higher() -> None:
    batched = Profile("x", (PrefillPoint(1000, 0.2, 20000.0),), make_profile().decode)
    assert batched.prefill_rate(1000) == 20000.0  # not 1000 / 0.2
    assert batched.prefill_capacity(1000, 0.5).tokens_per_s > 10000.0


def test_decode_itl_interpolates_in_context_and_concurrency() -> None:
    p = make_profile()
    assert p.decode_itl(2048, 16) == pytest.approx(itl(2048, 16))
    assert p.decode_itl(1280, 16) == pytest.approx((itl(512, 16) + itl(2048, 16)) / 2)
    assert p.decode_itl(2048, 10) == pytest.approx((itl(2048, 4) + itl(2048, 16)) / 2)
    assert p.decode_itl(16384, 4) == pytest.approx(itl(16384, 4))  # linear in context beyond the rows


def test_decode_capacity_is_read_where_the_itl_crosses_the_target() -> None:
    p = make_profile()
    cap = p.decode_capacity(2048, 0.02)
    # ITL at context 2048: 1 -> 12.9 ms, 4 -> 14.1 ms, 16 -> 18.8 ms, 64 -> 37.5 ms: 20 ms falls between 16 and 64
    frac = (0.02 - itl(2048, 16)) / (itl(2048, 64) - itl(2048, 16))
    assert cap.reachable and cap.load == pytest.approx(16 + frac * 48)
    assert cap.latency_s == pytest.approx(0.02)
    assert cap.tokens_per_s == pytest.approx(16 / itl(2048, 16) + frac * (64 / itl(2048, 64) - 16 / itl(2048, 16)))
    assert p.decode_capacity(2048, 0.05).load == 64  # every row meets it: the best row
    looser = [p.decode_capacity(2048, t).tokens_per_s for t in (0.013, 0.015, 0.02, 0.05)]
    assert looser == sorted(looser)


def test_decode_capacity_unreachable_gives_the_lowest_concurrency() -> None:
    p = make_profile()
    cap = p.decode_capacity(2048, 0.005)
    assert not cap.reachable and cap.load == 1
    assert cap.tokens_per_s == pytest.approx(1 / itl(2048, 1))


def test_decode_correction_tightens_the_target() -> None:
    p = make_profile()
    slow = p.decode_capacity(2048, 0.04, correction=2.0)  # must meet 20 ms on the profile's scale
    plain = p.decode_capacity(2048, 0.02)
    assert slow.load == pytest.approx(plain.load) and slow.tokens_per_s == pytest.approx(plain.tokens_per_s)
    assert slow.latency_s == pytest.approx(0.04)  # the latency the mesh will show
    assert p.decode_capacity(2048, 0.04).load == 64


def test_decode_capacity_is_continuous_in_the_correction() -> None:
    """A row lookup falls from one measured concurrency to a far lower one on a small change of correction."""
    p = make_profile()
    caps = [p.decode_capacity(2048, 0.02, correction=1.0 + k / 100).tokens_per_s for k in range(0, 60)]
    assert all(b <= a for a, b in itertools.pairwise(caps))  # slower mesh, never more capacity
    assert max(a - b for a, b in itertools.pairwise(caps)) < 0.05 * caps[0]  # and no cliff

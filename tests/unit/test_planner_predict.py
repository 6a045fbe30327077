"""Load predictors: constant, moving average, Holt-Winters (statsmodels), the registry and LoadPredictor."""

from __future__ import annotations

import builtins
import math
from typing import Any

import pytest

from meshllm.errors import ConfigError
from meshllm.planner.model import Observation
from meshllm.planner.predict import (
    PREDICTORS,
    ConstantPredictor,
    HoltWintersPredictor,
    LoadPredictor,
    MovingAveragePredictor,
    Predictor,
    make_predictor,
)


def feed(p: Predictor, values: list[float | None]) -> Predictor:
    for v in values:
        p.add(v)
    return p


def one_step_error(p: Predictor, series: list[float]) -> float:
    """Mean absolute one-step-ahead error over the series' second half."""
    errors = []
    for i, value in enumerate(series):
        if i >= len(series) // 2:
            errors.append(abs(p.predict() - value))
        p.add(value)
    return sum(errors) / len(errors)


def test_constant_is_the_last_sample_and_zero_before_any() -> None:
    p = ConstantPredictor()
    assert p.predict() == 0.0 and p.why == "no samples yet"
    assert feed(p, [3.0, 7.0, 5.0]).predict() == 5.0


def test_moving_average_of_a_known_series() -> None:
    p = feed(MovingAveragePredictor(window=3), [1.0, 2.0, 3.0, 4.0, 8.0])
    assert p.predict() == pytest.approx((3 + 4 + 8) / 3)
    assert feed(MovingAveragePredictor(window=10), [2.0, 4.0]).predict() == pytest.approx(3.0)  # fewer than the window


def test_none_and_nan_samples_are_ignored_so_the_last_known_value_stays() -> None:
    p = feed(ConstantPredictor(), [400.0, None, float("nan"), None])
    assert p.predict() == 400.0
    m = feed(MovingAveragePredictor(window=2), [100.0, None, 300.0, None])
    assert m.predict() == pytest.approx(200.0)
    assert m.state() == [100.0, 300.0]


def test_predictions_are_never_negative() -> None:
    falling = [100.0 - 15 * i for i in range(8)]  # 100 .. -5 would continue below zero
    hw = feed(HoltWintersPredictor(), [max(v, 0.0) for v in falling])
    assert hw.predict() >= 0.0
    assert feed(ConstantPredictor(), [-3.0]).predict() == 0.0


def test_holt_winters_follows_a_ramp_better_than_constant() -> None:
    ramp = [10.0 + 4.0 * i for i in range(30)]
    hw = one_step_error(HoltWintersPredictor(), ramp)
    const = one_step_error(ConstantPredictor(), ramp)
    assert const == pytest.approx(4.0)
    assert hw < const / 4


def test_holt_winters_uses_the_season_once_two_seasons_exist() -> None:
    season = 8
    series = [50.0 + 30.0 * math.sin(2 * math.pi * t / season) for t in range(48)]
    seasonal = HoltWintersPredictor(season=season)
    trend_only = HoltWintersPredictor()
    assert one_step_error(seasonal, series) < one_step_error(trend_only, series) / 3
    assert seasonal.why == f"holt-winters: trend + season of {season}"


def test_holt_winters_falls_back_with_too_little_history_and_says_so() -> None:
    p = feed(HoltWintersPredictor(window=2), [10.0, 20.0, 30.0])
    assert p.predict() == pytest.approx(25.0)  # the moving average of the last 2
    assert "too little history" in p.why and "3 samples < 6" in p.why
    short_of_seasons = feed(HoltWintersPredictor(season=10), [float(i) for i in range(12)])
    assert short_of_seasons.predict() > 11.0
    assert "season of 10 needs 20 samples, have 12" in short_of_seasons.why


def test_holt_winters_on_a_flat_series_predicts_it_without_warnings() -> None:
    assert feed(HoltWintersPredictor(), [5.0] * 10).predict() == 5.0
    assert feed(HoltWintersPredictor(), [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]).predict() >= 0.0  # pytest makes warnings errors


def test_holt_winters_without_statsmodels_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_statsmodels(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("statsmodels"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_statsmodels)
    with pytest.raises(ConfigError, match="pip install statsmodels"):
        make_predictor("holt-winters")
    assert make_predictor("moving-average").predict() == 0.0  # the others do not need it


def test_registry_and_make_predictor() -> None:
    assert set(PREDICTORS) == {"constant", "moving-average", "holt-winters"}
    p = make_predictor("moving-average", window=2)
    assert isinstance(p, MovingAveragePredictor) and p.window == 2
    with pytest.raises(ValueError, match="choose one of: constant, moving-average, holt-winters"):
        make_predictor("arima")
    with pytest.raises(ValueError, match="'constant'"):
        make_predictor("constant", window=3)
    with pytest.raises(ValueError, match="window must be at least 1"):
        make_predictor("moving-average", window=0)


def test_state_round_trip_predicts_the_same() -> None:
    a = feed(HoltWintersPredictor(), [float(3 * i + (i % 3)) for i in range(20)])
    b = HoltWintersPredictor()
    b.restore(a.state())
    assert b.predict() == a.predict()


def obs(requests: float, isl: float | None, osl: float | None) -> Observation:
    return Observation(at=0.0, interval_s=10.0, requests=requests, isl=isl, osl=osl, ttft_p90_s=None, itl_p90_s=None)


def test_load_predictor_predicts_each_quantity_on_its_own() -> None:
    lp = LoadPredictor("moving-average", window=2)
    for o in (obs(10, 100, 50), obs(30, 300, 150), obs(0, None, None)):
        lp.add(o)
    load = lp.predict()
    assert load.request_rate == pytest.approx((3.0 + 0.0) / 2)  # an idle interval is a rate of 0
    assert (load.isl, load.osl) == (pytest.approx(200.0), pytest.approx(100.0))  # but not an ISL of 0
    assert "request_rate: moving average" in lp.why
    again = LoadPredictor("moving-average", window=2)
    again.restore(lp.state())
    assert again.predict() == load

"""Load predictors: the next interval's request rate, ISL and OSL, each from its own past series.

A predictor takes one sample per interval (`add`; None = the interval had no sample, ignored, so the last
known value stays the basis) and predicts the next one (`predict`), never negative; `why` says how it did.
`LoadPredictor` keeps one predictor per quantity and turns an `Observation` series into a `Load`.
"""

from __future__ import annotations

import abc
import inspect
import math
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from meshllm.errors import ConfigError
from meshllm.planner.model import Load, Observation

__all__ = [
    "PREDICTORS",
    "ConstantPredictor",
    "HoltWintersPredictor",
    "LoadPredictor",
    "MovingAveragePredictor",
    "Predictor",
    "make_predictor",
]

DEFAULT_HISTORY = 256  # samples a predictor keeps: Holt-Winters refits over all of them every interval


class Predictor(abc.ABC):
    """One quantity's series and its next value."""

    name: ClassVar[str]

    def __init__(self, *, history: int = DEFAULT_HISTORY) -> None:
        if history < 1:
            raise ValueError(f"predictor history must be at least 1, got {history}")
        self._samples: deque[float] = deque(maxlen=history)
        self.why = "no samples yet"

    def add(self, value: float | None) -> None:
        """Record one interval's sample; None or NaN (no sample that interval) is ignored."""
        if value is None or not math.isfinite(value):
            return
        self._samples.append(float(value))

    def predict(self) -> float:
        """The next interval's value (0.0 before any sample), never negative; sets `why`."""
        if not self._samples:
            self.why = "no samples yet"
            return 0.0
        return max(0.0, self._predict(list(self._samples)))

    @abc.abstractmethod
    def _predict(self, samples: list[float]) -> float:
        """The next value from a non-empty series; sets `why`."""

    def state(self) -> list[float]:
        """The kept samples, oldest first (JSON-ready)."""
        return list(self._samples)

    def restore(self, samples: Iterable[float]) -> None:
        self._samples.clear()
        for value in samples:
            self.add(value)


class ConstantPredictor(Predictor):
    """Next = last."""

    name = "constant"

    def _predict(self, samples: list[float]) -> float:
        self.why = "constant: the last sample"
        return samples[-1]


class MovingAveragePredictor(Predictor):
    """Next = the mean of the last `window` samples."""

    name = "moving-average"

    def __init__(self, *, window: int = 5, history: int = DEFAULT_HISTORY) -> None:
        if window < 1:
            raise ValueError(f"moving-average window must be at least 1, got {window}")
        super().__init__(history=max(history, window))
        self.window = window

    def _predict(self, samples: list[float]) -> float:
        recent = samples[-self.window :]
        self.why = f"moving average of the last {len(recent)} samples"
        return sum(recent) / len(recent)


class HoltWintersPredictor(Predictor):
    """Holt-Winters exponential smoothing (statsmodels): additive damped trend, plus an additive season of
    `season` intervals once two seasons of history exist. With fewer than `min_points` samples it falls back
    to a moving average of `window`; `why` says which model answered."""

    name = "holt-winters"

    def __init__(
        self, *, season: int | None = None, window: int = 5, min_points: int = 6, history: int = DEFAULT_HISTORY
    ) -> None:
        if season is not None and season < 2:
            raise ValueError(f"holt-winters season must be at least 2 intervals, got {season}")
        if min_points < 4:
            raise ValueError(f"holt-winters min_points must be at least 4, got {min_points}")
        super().__init__(history=max(history, 4 * season if season else 0, min_points))
        self.season = season
        self.min_points = min_points
        self._fallback = MovingAveragePredictor(window=window)
        self._model = _statsmodels_holt_winters()  # fails at construction, not at the first prediction

    def _predict(self, samples: list[float]) -> float:
        if len(samples) < self.min_points:
            return self._fall_back(samples, f"{len(samples)} samples < {self.min_points}")
        if max(samples) == min(samples):
            self.why = "holt-winters: the series is constant"
            return samples[-1]
        seasonal = self.season is not None and len(samples) >= 2 * self.season
        value = self._fit(samples, seasonal)
        if value is None:
            return self._fall_back(samples, "the fit failed")
        kind = f"trend + season of {self.season}" if seasonal else "trend"
        if self.season is not None and not seasonal:
            kind += f" (season of {self.season} needs {2 * self.season} samples, have {len(samples)})"
        self.why = f"holt-winters: {kind}"
        return value

    def _fit(self, samples: list[float], seasonal: bool) -> float | None:
        import numpy as np

        with warnings.catch_warnings(), np.errstate(all="ignore"):
            # Short or flat stretches make the optimiser warn (ConvergenceWarning, log of 0); the forecast is
            # still usable, and a non-finite one falls back below.
            warnings.simplefilter("ignore")
            try:
                fit = self._model(
                    np.asarray(samples, dtype=float),
                    trend="add",
                    damped_trend=True,
                    seasonal="add" if seasonal else None,
                    seasonal_periods=self.season if seasonal else None,
                    initialization_method="estimated",
                ).fit()
                value = float(fit.forecast(1)[0])
            except (ValueError, np.linalg.LinAlgError):
                return None
        return value if math.isfinite(value) else None

    def _fall_back(self, samples: list[float], because: str) -> float:
        value = self._fallback._predict(samples)
        self.why = f"{self._fallback.why} ({because}: too little history for holt-winters)"
        return value


def _statsmodels_holt_winters() -> Callable[..., Any]:
    try:
        from statsmodels.tsa.holtwinters import ExponentialSmoothing
    except ImportError as e:
        raise ConfigError("the holt-winters predictor needs statsmodels: pip install statsmodels (or meshllm[planner])") from e
    return ExponentialSmoothing  # type: ignore[no-any-return]


PREDICTORS: dict[str, Callable[..., Predictor]] = {
    ConstantPredictor.name: ConstantPredictor,
    MovingAveragePredictor.name: MovingAveragePredictor,
    HoltWintersPredictor.name: HoltWintersPredictor,
}


def make_predictor(name: str, **opts: Any) -> Predictor:
    """A new predictor by registry name; ValueError for an unknown name or option."""
    factory = PREDICTORS.get(name)
    if factory is None:
        raise ValueError(f"unknown load predictor {name!r}; choose one of: {', '.join(PREDICTORS)}")
    try:
        inspect.signature(factory).bind(**opts)
    except TypeError as e:
        raise ValueError(f"load predictor {name!r}: {e}") from None
    return factory(**opts)


class LoadPredictor:
    """Request rate, ISL, OSL and output rate, each predicted on its own by a predictor of the same kind."""

    QUANTITIES = ("request_rate", "isl", "osl", "output_rate")

    def __init__(self, name: str = "constant", **opts: Any) -> None:
        self.predictors = {q: make_predictor(name, **opts) for q in self.QUANTITIES}

    def add(self, obs: Observation) -> None:
        self.predictors["request_rate"].add(obs.request_rate)
        self.predictors["isl"].add(obs.isl)
        self.predictors["osl"].add(obs.osl)
        self.predictors["output_rate"].add(obs.output_rate)

    def predict(self) -> Load:
        values = {q: p.predict() for q, p in self.predictors.items()}
        return Load(request_rate=values["request_rate"], isl=values["isl"], osl=values["osl"],
                    output_rate=values["output_rate"])  # fmt: skip

    @property
    def why(self) -> str:
        """How the last `predict` got each quantity."""
        return "; ".join(f"{q}: {p.why}" for q, p in self.predictors.items())

    def state(self) -> dict[str, list[float]]:
        return {q: p.state() for q, p in self.predictors.items()}

    def restore(self, state: dict[str, list[float]]) -> None:
        for q, p in self.predictors.items():
            p.restore(state.get(q, []))

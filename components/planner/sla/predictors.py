"""Load predictors for the SLA planner: the next adjustment interval's value of one series (request count, mean
prompt length, mean output length) from the values of the intervals before it.

Each predictor is a small stateful object fed one value per interval (``observe``) and asked for the next
(``predict``); ``warm_start(xs)`` feeds a history (e.g. a trace cut into intervals) before live values arrive. No
clock: one observation is one interval, whatever its length. Standard library only.

Names (``make_predictor``)
--------------------------
Dynamo's SLA planner chooses its predictor with ``--load-predictor``, whose values are ``constant``, ``arima``,
``kalman`` and ``prophet`` (its planner docs). We keep its names where we implement the same method, ``constant``
and ``kalman`` (and its Kalman knobs' names and defaults: ``q_level`` 2.0, ``q_trend`` 0.5, ``r`` 5.0), so an
operator's flag means the same here. Its seasonal choices, ARIMA and Prophet, need third-party libraries
(statsmodels/pmdarima, prophet) that this package may not import (planner policies are standard library plus
``components.perf``); additive Holt-Winters stands in for periodic load and is named by its own method,
``holt-winters``, rather than borrowing a name whose behaviour it does not have.

Before any observation
----------------------
``predict`` raises ``NoObservationError`` (a ``LookupError``): there is no number to give, and a made-up 0 would
read as "no load" and scale the fleet to its minimum. ``ready`` says whether ``predict`` will answer, so a caller can
treat "no data" as its own branch (STYLE.md habit 3) instead of catching.

``predict_ahead(steps)`` gives the next ``steps`` intervals (the first is ``predict()``): the same model carried
forward without new values (constant: the last value; Holt-Winters: ``L + h T + S[phase]``; Kalman: ``level + h x
slope``), which ``startup`` needs to ask for workers a start-up ahead.

Predictions are floored at 0: every series predicted is a count or a length, and a trend extrapolated below zero
means "falling to nothing", not a negative load.

The methods
-----------
* ``ConstantPredictor``: the last value (what Dynamo's ``constant`` does): right for flat load, one interval late on
  any change.
* ``HoltWintersPredictor``: additive level ``L``, trend ``T`` and season ``S[0..m-1]`` (``m`` = season length in
  intervals). For an observation ``x`` at phase ``p``::

      L' = alpha (x - S[p]) + (1 - alpha)(L + T)
      T' = beta (L' - L) + (1 - beta) T
      S[p] = gamma (x - L') + (1 - gamma) S[p]
      next = L' + T' + S[(p + 1) mod m]

  Initialised, as is classic, from the first two seasons (2m values): ``T`` = (mean of season 2 - mean of
  season 1) / m, each ``S[i]`` = the mean over both seasons of the value minus the trend line through season 1's
  mean, and ``L`` = the trend line at the last of the 2m values. Until 2m values are in (and for ``m`` <= 1 or
  ``None``: no season) it is Holt's linear method, ``L`` and ``T`` only, started from the first two values
  (``L`` = x2, ``T`` = x2 - x1). A straight line is therefore predicted exactly from the second value on, and a
  series periodic in exactly ``m`` intervals from the 2m-th on.
  Defaults: ``alpha`` 0.5 (the level takes half of a surprise at once: load moves within one interval),
  ``beta`` 0.1 (a trend is a claim about many intervals, so one odd interval moves it little), ``gamma`` 0.3 (a
  season's shape is learnt over a few periods). ``season_length`` has no default period: only the operator knows
  it (Dynamo's sinusoid, 150 s, is 5 intervals of 30 s); ``None`` means no seasonal part.
* ``KalmanPredictor``: a local linear trend: state ``[level, slope]``, transition ``level += slope`` each
  interval, the observation is the level plus noise. Process noise ``Q = diag(q_level, q_trend)`` (how much the
  level and the slope may wander per interval), measurement noise ``r``. The first value sets the level with
  variance ``r`` and an unknown slope (variance ``1e6 * max(r, q_level, q_trend)``: diffuse), so the second value
  fixes the slope and a straight line is followed with no lag. ``next = level + slope`` after the update. A larger
  ``q / r`` follows bursts faster and smooths less. The filter depends only on the ratios of ``q_level``,
  ``q_trend`` and ``r`` (scaling all three scales the variances, not the estimates), so the defaults work for
  series of any unit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "PREDICTORS",
    "ConstantPredictor",
    "HoltWintersPredictor",
    "KalmanPredictor",
    "NoObservationError",
    "Predictor",
    "make_predictor",
]


class NoObservationError(LookupError):
    """``predict`` was called before any value was observed."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{name}: no value observed yet, nothing to predict from (check .ready first)")
        self.name = name


@runtime_checkable
class Predictor(Protocol):
    """Predicts the next interval's value of one series from the values observed so far."""

    @property
    def ready(self) -> bool:
        """Whether ``predict`` will answer (at least one value observed)."""
        ...

    def observe(self, x: float) -> None:
        """One interval's value, in order."""
        ...

    def predict(self) -> float:
        """The next interval's value, >= 0; raises ``NoObservationError`` before any observation."""
        ...

    def warm_start(self, xs: Iterable[float]) -> None:
        """Observe a history, oldest first (a trace cut into intervals)."""
        ...

    def predict_ahead(self, steps: int) -> list[float]:
        """The next ``steps`` intervals' values (the first is ``predict()``), each >= 0; for start-up lead."""
        ...


def _finite(x: float, who: str) -> float:
    v = float(x)
    if not math.isfinite(v):
        raise ValueError(f"{who}: observed a non-finite value {x!r}")
    return v


class ConstantPredictor:
    """The next value is the last one."""

    name = "constant"

    def __init__(self) -> None:
        self._last: float | None = None

    @property
    def ready(self) -> bool:
        return self._last is not None

    def observe(self, x: float) -> None:
        self._last = _finite(x, self.name)

    def warm_start(self, xs: Iterable[float]) -> None:
        for x in xs:
            self.observe(x)

    def predict(self) -> float:
        if self._last is None:
            raise NoObservationError(self.name)
        return max(0.0, self._last)

    def predict_ahead(self, steps: int) -> list[float]:
        return [self.predict()] * steps


class HoltWintersPredictor:
    """Additive Holt-Winters (module docstring): level, trend and a season of ``season_length`` intervals."""

    name = "holt-winters"

    def __init__(
        self, season_length: int | None = None, alpha: float = 0.5, beta: float = 0.1, gamma: float = 0.3
    ) -> None:
        for k, v in (("alpha", alpha), ("beta", beta), ("gamma", gamma)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"holt-winters: {k} must be within [0, 1], got {v}")
        if season_length is not None and season_length < 0:
            raise ValueError(f"holt-winters: season_length must be >= 0 (or None), got {season_length}")
        self.season_length = season_length if season_length and season_length > 1 else 0
        self.alpha, self.beta, self.gamma = alpha, beta, gamma
        self._history: list[float] = []  # kept only until the season is initialised (2m values)
        self._n = 0  # values observed
        self._level = 0.0
        self._trend = 0.0
        self._season: list[float] | None = None  # None: not seasonal yet (Holt's linear method)

    @property
    def ready(self) -> bool:
        return self._n > 0

    def observe(self, x: float) -> None:
        v = _finite(x, self.name)
        self._n += 1
        m = self.season_length
        if self._season is not None:
            p = (self._n - 1) % m  # this value's phase
            s = self._season
            level = self.alpha * (v - s[p]) + (1 - self.alpha) * (self._level + self._trend)
            self._trend = self.beta * (level - self._level) + (1 - self.beta) * self._trend
            s[p] = self.gamma * (v - level) + (1 - self.gamma) * s[p]
            self._level = level
            return
        # Holt's linear method until the season can be initialised.
        if self._n == 1:
            self._level, self._trend = v, 0.0
        elif self._n == 2:
            self._level, self._trend = v, v - self._level
        else:
            level = self.alpha * v + (1 - self.alpha) * (self._level + self._trend)
            self._trend = self.beta * (level - self._level) + (1 - self.beta) * self._trend
            self._level = level
        if m:
            self._history.append(v)
            if len(self._history) == 2 * m:
                self._init_season(self._history)
                self._history = []

    def _init_season(self, xs: list[float]) -> None:
        m = self.season_length
        mean1 = sum(xs[:m]) / m
        mean2 = sum(xs[m:]) / m
        trend = (mean2 - mean1) / m
        # The trend line through season 1's mean, centred on its middle: line(t) = mean1 + trend (t - (m-1)/2).
        line = [mean1 + trend * (t - (m - 1) / 2) for t in range(2 * m)]
        self._season = [((xs[i] - line[i]) + (xs[m + i] - line[m + i])) / 2 for i in range(m)]
        self._trend = trend
        self._level = line[2 * m - 1]

    def warm_start(self, xs: Iterable[float]) -> None:
        for x in xs:
            self.observe(x)

    def predict(self) -> float:
        if self._n == 0:
            raise NoObservationError(self.name)
        return self.predict_ahead(1)[0]

    def predict_ahead(self, steps: int) -> list[float]:
        # h intervals ahead: L + h T + S[phase of that value]; the value observed last had phase (n - 1) mod m.
        if self._n == 0:
            raise NoObservationError(self.name)
        out = []
        for h in range(1, steps + 1):
            v = self._level + h * self._trend
            if self._season is not None:
                v += self._season[(self._n - 1 + h) % self.season_length]
            out.append(max(0.0, v))
        return out


class KalmanPredictor:
    """A local-linear-trend Kalman filter (module docstring): state ``[level, slope]``."""

    name = "kalman"

    def __init__(self, q_level: float = 2.0, q_trend: float = 0.5, r: float = 5.0) -> None:
        for k, v in (("q_level", q_level), ("q_trend", q_trend), ("r", r)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"kalman: {k} must be a finite number >= 0, got {v}")
        if r == 0 and q_level == 0 and q_trend == 0:
            raise ValueError("kalman: q_level, q_trend and r cannot all be 0")
        self.q_level, self.q_trend, self.r = q_level, q_trend, r
        self._n = 0
        self._x = [0.0, 0.0]  # level, slope
        self._p = [[0.0, 0.0], [0.0, 0.0]]  # their covariance

    @property
    def ready(self) -> bool:
        return self._n > 0

    def observe(self, x: float) -> None:
        v = _finite(x, self.name)
        self._n += 1
        if self._n == 1:
            diffuse = 1e6 * max(self.r, self.q_level, self.q_trend)
            self._x = [v, 0.0]
            self._p = [[self.r, 0.0], [0.0, diffuse]]
            return
        # Predict: x = F x, P = F P F' + Q with F = [[1, 1], [0, 1]].
        lvl, slope = self._x
        (a, b), (c, d) = self._p
        lvl, slope = lvl + slope, slope
        p00 = a + b + c + d + self.q_level
        p01 = b + d
        p10 = c + d
        p11 = d + self.q_trend
        # Update with H = [1, 0]: innovation v - level, its variance p00 + r, gain K = P H' / s.
        s = p00 + self.r
        k0, k1 = p00 / s, p10 / s
        innov = v - lvl
        self._x = [lvl + k0 * innov, slope + k1 * innov]
        # P = (I - K H) P
        self._p = [[(1 - k0) * p00, (1 - k0) * p01], [p10 - k1 * p00, p11 - k1 * p01]]

    def warm_start(self, xs: Iterable[float]) -> None:
        for x in xs:
            self.observe(x)

    def predict(self) -> float:
        return self.predict_ahead(1)[0]

    def predict_ahead(self, steps: int) -> list[float]:
        # h intervals ahead: level + h x slope (the transition applied h times).
        if self._n == 0:
            raise NoObservationError(self.name)
        return [max(0.0, self._x[0] + h * self._x[1]) for h in range(1, steps + 1)]


# The names ``make_predictor`` accepts (Dynamo's ``--load-predictor`` values where the method is the same).
PREDICTORS: dict[str, type[ConstantPredictor] | type[HoltWintersPredictor] | type[KalmanPredictor]] = {
    "constant": ConstantPredictor,
    "holt-winters": HoltWintersPredictor,
    "kalman": KalmanPredictor,
}


def make_predictor(name: str, **params: Any) -> Predictor:
    """A fresh predictor by its name (``PREDICTORS``), its parameters as keywords (e.g. ``season_length=5``).
    An unknown name or parameter raises ``ValueError`` naming what is accepted."""
    cls = PREDICTORS.get(name)
    if cls is None:
        raise ValueError(f"unknown load predictor {name!r}; choose one of {', '.join(PREDICTORS)}")
    try:
        return cls(**params)
    except TypeError as e:
        raise ValueError(f"load predictor {name!r}: {e}") from e

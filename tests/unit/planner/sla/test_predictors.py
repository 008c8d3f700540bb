"""The SLA planner's load predictors on series whose next value is known: constant, a straight line, a sinusoid
with an exact period, a step.

Why the expected values are what they are:
* a constant series: every method's estimate is that constant (Holt-Winters' trend and season start at 0 for it,
  the Kalman filter's innovations are all 0), so the prediction is the constant itself, to float rounding;
* a straight line ``a + c t``: Holt's linear start (``L`` = x2, ``T`` = x2 - x1) is the line itself, and every later
  update of a value on the line leaves it there (the surprise is 0); the Kalman filter's second value fixes the slope
  up to its diffuse prior's 1e-6 share, which decays as the filter keeps following the line: the next value within a
  stated tolerance after a short warm-up;
* a sinusoid of period ``m`` intervals: after two seasons, Holt-Winters' trend is (mean2 - mean1) / m = 0 and its
  season is the sinusoid itself, so it predicts the next point exactly, while "the last value" is off by the
  sinusoid's change over one interval.
"""

from __future__ import annotations

import math

import pytest

from components.planner.sla.predictors import (
    PREDICTORS,
    ConstantPredictor,
    HoltWintersPredictor,
    KalmanPredictor,
    NoObservationError,
    Predictor,
    make_predictor,
)

pytestmark = pytest.mark.unit

ALL = ["constant", "holt-winters", "kalman"]


@pytest.mark.parametrize("name", ALL)
def test_each_name_makes_a_predictor_of_the_protocol(name):
    p = make_predictor(name)
    assert isinstance(p, Predictor)
    assert isinstance(p, PREDICTORS[name])
    assert not p.ready


def test_an_unknown_name_or_parameter_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="constant, holt-winters, kalman"):
        make_predictor("arima")
    with pytest.raises(ValueError, match="kalman"):
        make_predictor("kalman", season_length=3)


@pytest.mark.parametrize("name", ALL)
def test_predict_before_any_observation_raises_a_clear_error(name):
    p = make_predictor(name)
    with pytest.raises(NoObservationError, match="no value observed yet"):
        p.predict()
    p.observe(4.0)
    assert p.ready
    assert p.predict() == pytest.approx(4.0)  # one value: every method's best guess is that value


@pytest.mark.parametrize("name,params", [("constant", {}), ("holt-winters", {"season_length": 4}), ("kalman", {})])
def test_a_constant_series_predicts_the_constant(name, params):
    p = make_predictor(name, **params)
    for _ in range(20):  # 20 > 2 x 4: Holt-Winters' season is initialised on the way
        p.observe(12.5)
        assert p.predict() == pytest.approx(12.5, abs=1e-9)


def test_constant_is_the_last_value():
    p = ConstantPredictor()
    p.warm_start([3.0, 9.0, 5.0])
    assert p.predict() == 5.0


def test_holt_winters_follows_a_straight_line_exactly():
    # x_t = 10 + 3 t. Holt's start after two values: L = 13, T = 3, so next = 16; each later value lies on the line.
    p = HoltWintersPredictor()
    for t in range(12):
        p.observe(10 + 3 * t)
        if t >= 1:
            assert p.predict() == pytest.approx(10 + 3 * (t + 1), abs=1e-9)


def test_holt_winters_with_a_season_follows_a_straight_line_exactly():
    # Season length 4: the classic start after 8 values gives T = (mean2 - mean1) / 4 = 3 * 4 / 4 = 3, every
    # S[i] = 0 (the values lie on the trend line), L = the line at t = 7: exact from there on; before it, Holt's
    # linear start is exact from the second value (one value alone predicts itself).
    p = HoltWintersPredictor(season_length=4)
    for t in range(20):
        p.observe(10 + 3 * t)
        if t >= 1:
            assert p.predict() == pytest.approx(10 + 3 * (t + 1), abs=1e-9)


def test_kalman_follows_a_straight_line_within_a_tolerance_after_warm_up():
    # Tolerance: 1e-3 of the value after 5 values. The slope's diffuse prior (1e6 x the largest noise) leaves a
    # relative error of order r / 1e6 after the second value, and the local-linear-trend filter tracks a ramp with no
    # steady-state error, so by the sixth value the error is far below 1e-3.
    p = KalmanPredictor()
    for t in range(30):
        p.observe(10 + 3 * t)
        if t >= 5:
            assert p.predict() == pytest.approx(10 + 3 * (t + 1), rel=1e-3)


def test_holt_winters_predicts_a_sinusoid_better_than_constant_after_two_seasons():
    # 100 + 50 sin(2 pi t / 6): period 6 intervals exactly. From the 12th value on (two seasons) Holt-Winters is
    # exact (module docstring of the test); constant is off by |x_{t+1} - x_t|, whose mean over a period is
    # 50 * (sum of |sin(a + 60 deg) - sin(a)| over the 6 phases) / 6 = 50 * (0 + 0.866 + 0.866 + 0 + 0.866 + 0.866) / 6
    # = 50 * 4 * sin(60 deg) / 6 = 28.87. Margin stated: Holt-Winters' mean error is under 1% of constant's.
    m = 6
    xs = [100 + 50 * math.sin(2 * math.pi * t / m) for t in range(60)]
    hw, const = HoltWintersPredictor(season_length=m), ConstantPredictor()
    hw_err, const_err = [], []
    for t in range(len(xs) - 1):
        hw.observe(xs[t])
        const.observe(xs[t])
        if t + 1 >= 2 * m:
            hw_err.append(abs(hw.predict() - xs[t + 1]))
            const_err.append(abs(const.predict() - xs[t + 1]))
    hw_mean, const_mean = sum(hw_err) / len(hw_err), sum(const_err) / len(const_err)
    assert const_mean == pytest.approx(50 * 4 * math.sin(math.pi / 3) / 6, rel=0.02)
    assert hw_mean < 0.01 * const_mean


def test_holt_winters_learns_a_sinusoid_on_a_trend():
    # 100 + 2 t + 30 sin(2 pi t / 5): the classic start removes the trend line (slope 2: (mean2 - mean1) / 5 =
    # 2 * 5 / 5) before taking the season, so the next value is exact from the 10th on.
    m = 5
    xs = [100 + 2 * t + 30 * math.sin(2 * math.pi * t / m) for t in range(40)]
    p = HoltWintersPredictor(season_length=m)
    for t in range(len(xs) - 1):
        p.observe(xs[t])
        if t + 1 >= 2 * m:
            assert p.predict() == pytest.approx(xs[t + 1], abs=1e-9)


def test_warm_start_is_the_same_as_observing_each_value():
    xs = [5.0, 7.0, 6.0, 9.0, 12.0, 11.0, 15.0]
    for name, params in (("holt-winters", {"season_length": 3}), ("kalman", {})):
        a, b = make_predictor(name, **params), make_predictor(name, **params)
        a.warm_start(xs)
        for x in xs:
            b.observe(x)
        assert a.predict() == b.predict()


def test_kalman_moves_further_on_a_step_with_a_larger_process_noise():
    # A step from 10 to 100. After the first value at 100 the prediction moves by (k_level + k_slope) x 90, and both
    # gains grow with q / r: the filter with q / r 100x larger (0.2/5 against 2/0.5) moves further. Neither ignores
    # the step (it moves more than a tenth of the way) and the settled flat run before it predicts 10 exactly.
    slow, fast = KalmanPredictor(q_level=0.2, q_trend=0.05, r=5.0), KalmanPredictor(q_level=2.0, q_trend=0.5, r=0.5)
    for p in (slow, fast):
        p.warm_start([10.0] * 10)
        assert p.predict() == pytest.approx(10.0)
        p.observe(100.0)
    assert fast.predict() - 10 > slow.predict() - 10 > 9


def test_predictions_are_never_negative():
    # A falling line 20 - 8 t extrapolates below 0 at t = 3: a load cannot be negative, the prediction is floored.
    for p in (HoltWintersPredictor(), KalmanPredictor()):
        p.warm_start([20.0, 12.0, 4.0])
        assert p.predict() == 0.0


def test_non_finite_values_and_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="non-finite"):
        ConstantPredictor().observe(math.nan)
    with pytest.raises(ValueError, match="alpha"):
        HoltWintersPredictor(alpha=1.5)
    with pytest.raises(ValueError, match="r must be"):
        KalmanPredictor(r=-1.0)

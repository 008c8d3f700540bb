"""Correction factors: the smoothed ratio of observed to predicted latency, kept when there is no sample and held at
its bounds, with the numbers worked out here."""

from __future__ import annotations

import pytest

from components.planner.sla.correction import deadband, update_correction

pytestmark = pytest.mark.unit


def test_the_factor_is_the_smoothed_ratio_of_observed_to_predicted():
    # Observed 30 ms against 20 ms predicted: raw 1.5; 0.5 x 1.5 + 0.5 x 1.0 = 1.25.
    c = update_correction(1.0, 0.030, 0.020)
    assert c.raw == pytest.approx(1.5)
    assert c.factor == pytest.approx(1.25)
    assert "= 1.500" in c.reason and "= 1.250" in c.reason
    # smoothing 1.0 (each interval's ratio as it is): 1.5.
    assert update_correction(1.0, 0.030, 0.020, smoothing=1.0).factor == pytest.approx(1.5)


def test_a_lasting_2x_error_is_followed_to_within_12_5_percent_in_three_intervals():
    # From 1.0 towards 2.0 with half-weight: 1.5, 1.75, 1.875 = 2 - 1 x 0.5^3.
    f = 1.0
    for _ in range(3):
        f = update_correction(f, 0.040, 0.020).factor
    assert f == pytest.approx(1.875)


def test_no_sample_keeps_the_previous_factor():
    for observed, predicted in ((None, 0.02), (0.03, None), (0.03, 0.0)):
        c = update_correction(1.3, observed, predicted)
        assert c.factor == 1.3 and c.raw is None
        assert "keeping 1.300" in c.reason


def test_a_model_far_off_is_held_at_the_bound_with_the_reason():
    # 100 ms observed against 10 ms predicted: raw 10, smoothed 0.5 x 10 + 0.5 = 5.5 > 4: held at 4.
    c = update_correction(1.0, 0.100, 0.010)
    assert c.factor == 4.0
    assert "held at 4" in c.reason and "check the profile" in c.reason
    # 1 ms against 100 ms: raw 0.01, smoothed 0.505 ... then 0.2575 ... then 0.13 < 0.25: held at 0.25.
    f = 1.0
    for _ in range(3):
        f = update_correction(f, 0.001, 0.100).factor
    assert f == 0.25


def test_the_deadband_applies_a_factor_within_it_as_1_and_beyond_it_by_its_excess():
    # Width 0.05: 0.95-1.05 is the model (1.0); 1.08 is 3% slow, 0.90 5% fast; continuous at the edges.
    assert [deadband(f, 0.05) for f in (1.0, 0.97, 1.04, 0.95, 1.05)] == [1.0] * 5
    assert deadband(1.08, 0.05) == pytest.approx(1.03) and deadband(0.90, 0.05) == pytest.approx(0.95)
    assert deadband(1.050001, 0.05) == pytest.approx(1.0) and deadband(2.0, 0.05) == pytest.approx(1.95)
    assert deadband(0.97, 0.0) == 0.97  # no band: as measured
    with pytest.raises(ValueError, match="width"):
        deadband(1.0, 1.0)

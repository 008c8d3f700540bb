"""Start-up lead: a step up in the forecast with a start-up of 2 intervals is asked for 2 intervals early, and a
rolling loop that asks that way always has the workers ready; one that asks for the current need is short for 2."""

from __future__ import annotations

import pytest

from components.planner.sla.predictors import ConstantPredictor, HoltWintersPredictor, KalmanPredictor
from components.planner.sla.startup import lead_intervals, pool_to_request

pytestmark = pytest.mark.unit

# Needs per interval: 2 workers until interval 5, then 5, then back to 2 from interval 10.
NEEDS = [2] * 5 + [5] * 5 + [2] * 5


def test_lead_is_the_start_up_in_whole_intervals():
    assert lead_intervals(60, 30) == 2  # exactly 2 intervals
    assert lead_intervals(61, 30) == 3  # a second more: ready only in the third
    assert lead_intervals(0, 30) == 0
    with pytest.raises(ValueError, match="interval_s"):
        lead_intervals(10, 0)


def test_a_step_up_is_asked_for_the_start_up_ahead():
    # Start-up 60 s, interval 30 s: lead 2. At interval 3 the forecast is [2, 2, 5, ...]: the need at 3 + 2 = 5
    # is in the window, ask 5; at interval 2 the window [2, 2, 2] still asks 2.
    assert pool_to_request(NEEDS[2:], 60, 30).workers == 2
    lead = pool_to_request(NEEDS[3:], 60, 30)
    assert (lead.workers, lead.lead, lead.at_interval) == (5, 2, 2)
    assert "start-up 60 s = 2 interval(s) of 30 s" in lead.reason


def test_a_rolling_loop_with_lead_is_never_short_and_one_without_is_short_for_the_start_up():
    # Each interval i asks pool_to_request(NEEDS[i:]); what is asked at i serves from i + lead, removals are at once
    # (the pool starts at the first ask, already serving). With the lead the pool serving at k >= 2 covers
    # NEEDS[k]; without it (asking NEEDS[i] now) the pool is short at intervals 5 and 6: the 2 intervals of start-up
    # after the step.
    lead = 2

    def serving(asks):
        # The pool at each interval k: workers asked for at j arrive at j + lead; a smaller ask first cancels workers
        # still starting (newest first), then removes serving ones at once.
        ready, out = asks[0], []
        pending: list[int] = []  # arrival intervals of workers still starting
        for k, ask in enumerate(asks):
            ready += sum(1 for t in pending if t <= k)
            pending = [t for t in pending if t > k]
            while ready + len(pending) > ask:
                if pending:
                    pending.pop()
                else:
                    ready -= 1
            pending += [k + lead] * (ask - ready - len(pending))
            ready += sum(1 for t in pending if t <= k)  # lead 0: at once
            pending = [t for t in pending if t > k]
            out.append(ready)
        return out

    with_lead = [pool_to_request(NEEDS[i:], 60, 30).workers for i in range(len(NEEDS))]
    without = [NEEDS[i] for i in range(len(NEEDS))]
    short_with = [k for k in range(lead, len(NEEDS)) if serving(with_lead)[k] < NEEDS[k]]
    short_without = [k for k in range(lead, len(NEEDS)) if serving(without)[k] < NEEDS[k]]
    assert short_with == []
    assert short_without == [5, 6]
    # The lead costs 2 intervals of 3 extra workers before the step (intervals 3 and 4); down at 10 without delay.
    assert with_lead == [2, 2, 2, 5, 5, 5, 5, 5, 5, 5, 2, 2, 2, 2, 2]


def test_a_short_forecast_is_extended_with_its_last_value():
    lead = pool_to_request([3, 4], 120, 30)  # lead 4, forecast of 2 intervals
    assert lead.workers == 4
    assert "extended with its last value" in lead.reason


def test_predictors_forecast_ahead_consistently_with_their_next_value():
    # predict_ahead(h)[0] is predict(); for the line 10 + 3 t observed up to t = 9, h ahead is 10 + 3 (9 + h).
    for p in (HoltWintersPredictor(), KalmanPredictor()):
        p.warm_start([10 + 3 * t for t in range(10)])
        ahead = p.predict_ahead(3)
        assert ahead[0] == p.predict()
        assert ahead == pytest.approx([40, 43, 46], rel=1e-3)
    c = ConstantPredictor()
    c.observe(7)
    assert c.predict_ahead(3) == [7, 7, 7]
    # A seasonal forecast: period 4, values 1, 5, 1, 5, ... after two seasons the next four are 1, 5, 1, 5.
    hw = HoltWintersPredictor(season_length=4)
    hw.warm_start([1, 5, 1, 5, 1, 5, 1, 5])
    assert hw.predict_ahead(4) == pytest.approx([1, 5, 1, 5])


def test_the_horizon_reads_the_interpolated_forecast_where_it_can_peak():
    from components.planner.sla.startup import horizon_points

    # Means 40, 50, 60, 70 at the midpoints 15, 45, 75, 105 s; observed 30 at -15 s. A 60 s start-up and 30 s
    # decisions: the span is 90 s. Points: now (halfway from 30 to 40: 35), the midpoints inside (15, 45, 75) and the
    # end (90 s: halfway from 60 to 70, 65), each with the interval holding it.
    pts = horizon_points(30.0, [40.0, 50.0, 60.0, 70.0], 30.0, 60.0)
    assert [(p.t_s, p.rate, p.interval) for p in pts] == [
        (0.0, 35.0, 0),
        (15.0, 40.0, 0),
        (45.0, 50.0, 1),
        (75.0, 60.0, 2),
        (90.0, 65.0, 3),
    ]
    # A 1.23 s start-up: the span ends at 31.23 s, 16.23 s past the first midpoint toward the second:
    # 40 + 10 x 16.23 / 30.
    pts = horizon_points(30.0, [40.0, 50.0, 60.0], 30.0, 1.23)
    assert [p.t_s for p in pts] == [0.0, 15.0, 31.23] and pts[-1].rate == pytest.approx(40 + 10 * 16.23 / 30)
    # A falling load peaks now: halfway between the observed 100 and the first mean 60.
    assert max(p.rate for p in horizon_points(100.0, [60.0, 40.0], 30.0, 0.0)) == 80.0
    # A flat forecast is flat; a forecast too short for the span is refused; rates are never negative.
    assert {p.rate for p in horizon_points(5.0, [5.0, 5.0, 5.0], 30.0, 30.0)} == {5.0}
    with pytest.raises(ValueError, match="do not reach 60 s ahead"):
        horizon_points(5.0, [5.0], 30.0, 30.0)
    assert min(p.rate for p in horizon_points(0.0, [0.0, -10.0], 30.0, 0.0)) == 0.0

"""The loads of ``kvmesh bench planner --load`` (components/cli/bench/loads.py) and the clairvoyant schedule with
several workers per decision (components/cli/bench/clairvoyant.py): shapes, levels and times relative to capacity,
the trace's scaling; every expected number is derived in the test."""

from __future__ import annotations

import math

import pytest

from components.cli.bench.clairvoyant import Oracle
from components.cli.bench.loads import Step, TraceLoad, dynamo_sinusoid, slow_sinusoid
from components.cli.bench.scaling import arrival_times

pytestmark = pytest.mark.unit


def test_dynamo_sinusoid_runs_from_a_quarter_to_all_of_capacity_every_150_s():
    s = dynamo_sinusoid()
    assert (s.period_s, s.duration_s, s.start) == (150.0, 600.0, 0.25)
    assert s.fraction(0) == pytest.approx(0.25) and s.fraction(75) == pytest.approx(1.0)
    assert max(s.fraction(t / 10) for t in range(6000)) == pytest.approx(1.0)


def test_the_slow_sinusoid_has_a_period_of_twenty_start_ups_over_two_periods():
    s = slow_sinusoid(30.0)
    assert (s.period_s, s.duration_s, s.low, s.high) == (600.0, 1200.0, 0.25, 1.0)
    # Its peak is half a period in: 300 s, and again at 900 s.
    assert s.fraction(300) == pytest.approx(1.0) and s.fraction(900) == pytest.approx(1.0)
    assert s.fraction(600) == pytest.approx(0.25)
    # A longer period is allowed; one shorter than 20 start-ups is not.
    assert slow_sinusoid(30.0, 900.0).duration_s == 1800.0
    with pytest.raises(ValueError, match="at least 20 start-ups"):
        slow_sinusoid(30.0, 599.0)


def test_the_10528_step_goes_from_a_24th_of_capacity_to_all_of_it_and_back():
    s = Step.issue_10528(600.0)
    # 1 and 24 requests/s: the high level is capacity, the low one 1/24 of it.
    assert (s.low, s.high, s.up_s, s.down_s) == (pytest.approx(1 / 24), 1.0, 150.0, 450.0)
    assert s.start == pytest.approx(1 / 24)
    assert [s.fraction(t) for t in (0, 149.999, 150, 449.999, 450, 599)] == [
        pytest.approx(1 / 24), pytest.approx(1 / 24), 1.0, 1.0, pytest.approx(1 / 24), pytest.approx(1 / 24)
    ]  # fmt: skip
    # Mean: 300 s at 1 and 300 s at 1/24, over 600 s.
    assert s.mean == pytest.approx((300 + 300 / 24) / 600)
    c = s.scaled(10)
    assert (c.duration_s, c.up_s, c.down_s, c.low, c.high) == (60.0, 15.0, 45.0, s.low, 1.0)
    with pytest.raises(ValueError):
        Step(600, 0.5, 0.2)


def test_step_arrivals_are_poisson_at_each_level():
    # Capacity 24 req/s: the high phase (300 s) expects 7,200 arrivals, each low phase (150 s at 1 req/s) 150.
    s = Step.issue_10528(600.0)
    arr = arrival_times(s, 24.0, seed=3)
    high = sum(150 <= t < 450 for t in arr)
    low = [sum(t < 150 for t in arr), sum(t >= 450 for t in arr)]
    assert abs(high - 7200) < 4 * math.sqrt(7200)
    assert all(abs(n - 150) < 4 * math.sqrt(150) for n in low)
    assert arr == arrival_times(s, 24.0, seed=3) and arr != arrival_times(s, 24.0, seed=4)


def test_a_trace_load_scales_its_time_so_its_mean_is_the_stated_fraction_of_capacity():
    # 10 arrivals a second apart: 9 s span, 10 s of trace (n / (n - 1) of it), 1 req/s. At capacity 4 req/s and a
    # mean of half of it (2 req/s), every gap halves: arrivals at 0, 0.5 ... 4.5 over 5 s.
    load = TraceLoad.from_timestamps([float(i) for i in range(10)], capacity_rps=4.0, mean_fraction=0.5, window_s=1.0)
    assert load.arrivals_s == pytest.approx([i / 2 for i in range(10)])
    assert load.rows == tuple(range(10))
    assert load.duration_s == pytest.approx(5.0) and load.time_scale == pytest.approx(0.5)
    assert load.mean == pytest.approx(0.5)
    # Two arrivals in each 1 s window: 2 req/s = half of capacity; no arrival after the last: 0.
    assert load.fraction(0.2) == pytest.approx(0.5) and load.fraction(4.9) == pytest.approx(0.5)
    assert load.fraction(7.0) == 0.0 and load.start == pytest.approx(0.5)


def test_a_trace_load_keeps_its_bursts():
    # A burst of 8 arrivals in the trace's first second, then one a second to 8 s: 16 arrivals, span 8 s (trace time
    # 8 x 16 / 15 = 8.53 s). Scaled to a mean of 0.25 x 16 req/s = 4 req/s: 4 s of load, a factor of 4 / 8.53.
    ts = [i / 8 for i in range(8)] + [float(i) for i in range(1, 9)]
    load = TraceLoad.from_timestamps(ts, capacity_rps=16.0, mean_fraction=0.25, window_s=0.5)
    f = 4.0 / (8 * 16 / 15)
    assert load.duration_s == pytest.approx(4.0) and load.time_scale == pytest.approx(f)
    assert load.arrivals_s == pytest.approx([t * f for t in ts])
    # The burst's 8 arrivals land within 7/8 x f = 0.41 s, in the first 0.5 s window with the next (f = 0.47 s; the
    # one after is at 0.94 s): 9 in 0.5 s = 18 req/s = 1.125 x capacity, 4.5 times the mean.
    assert load.fraction(0.1) == pytest.approx(9 / 0.5 / 16) and load.high == pytest.approx(9 / 0.5 / 16)
    assert load.high / load.mean == pytest.approx(4.5)


def test_compressing_a_trace_load_keeps_its_rate_and_thins_its_arrivals():
    ts = [i * 0.01 for i in range(20000)]  # 100 req/s for 200 s
    load = TraceLoad.from_timestamps(ts, capacity_rps=200.0, mean_fraction=0.5, window_s=10.0)
    assert load.duration_s == pytest.approx(200.0)
    c = load.scaled(4, seed=1)
    # A quarter kept (binomial: 5,000 +- 61), on a clock 4 times shorter: the same rate.
    assert abs(len(c.arrivals_s) - 5000) < 4 * math.sqrt(20000 * 0.25 * 0.75)
    assert (c.duration_s, c.window_s, c.time_scale) == (pytest.approx(50.0), 2.5, pytest.approx(0.25))
    assert c.mean == pytest.approx(load.mean, rel=0.05)
    assert all(r * 0.01 / 4 == pytest.approx(t) for t, r in zip(c.arrivals_s, c.rows, strict=True))
    assert c.rows == load.scaled(4, seed=1).rows and load.scaled(1, seed=1) is load


def step_oracle(step_workers: int | None) -> Oracle:
    return Oracle(sinusoid=Step.issue_10528(600.0), load_start_s=0.0, peak_workers=8, utilisation=1.0,
                  interval_s=10.0, startup_s=30.0, max_workers=8, step_workers=step_workers)  # fmt: skip


def test_a_clairvoyant_schedule_without_a_step_limit_adds_the_whole_step_one_start_up_ahead():
    o = step_oracle(None)
    # The need: ceil(8 / 24) = 1 in the low phases, 8 in the high one (150 s to 450 s).
    assert o.need(100) == 1 and o.need(150) == 8 and o.need(450) == 1
    plan = o.plan(0.0, 600.0)
    # The last decision whose additions register by 150 s is at 120 s (start-up 30 s): all 7 at once then; the
    # first decision after the step down (450 s) removes all 7.
    assert plan.start == 1
    assert [(t, n) for (t, n), (_, before) in zip(plan.decisions, [(0, 1), *plan.decisions], strict=False)
            if n != before] == [(120.0, 8), (450.0, 1)]  # fmt: skip
    # Held: 1 x 600 s + 7 x 330 s = 2,910 worker-seconds; the bound is the need shifted by the start-up, the same.
    assert plan.worker_seconds(0, 600) == pytest.approx(2910)
    assert o.least_worker_seconds(0, 600) == pytest.approx(2910, abs=2)


def test_with_one_worker_per_decision_the_step_needs_seven_decisions_ahead():
    o = step_oracle(1)
    plan = o.plan(0.0, 600.0)
    # 7 additions, the last at 120 s (registers at 150 s), one per 10 s interval before it: 60, 70, ... 120 s; then
    # one removal per decision from 450 s: 450 ... 510 s.
    changes = [(t, n) for (t, n), (_, before) in zip(plan.decisions, [(0, 1), *plan.decisions], strict=False)
               if n != before]  # fmt: skip
    assert changes == [(60.0 + 10 * i, 2 + i) for i in range(7)] + [(450.0 + 10 * i, 7 - i) for i in range(7)]
    # Held: 1 x 600 + the 7 added workers for (450 + 10 i) - (60 + 10 (6 - i)) ... summed: 7 workers added at
    # 60 ... 120 and removed last-first at 450 ... 510: the one added at 120 leaves at 450 (330 s), at 110 leaves at
    # 460 (350 s) ... at 60 leaves at 510 (450 s): 330 + 350 + ... + 450 = 7 x 390 = 2,730.
    assert plan.worker_seconds(0, 600) == pytest.approx(600 + 2730)
    assert o.least_worker_seconds(0, 600) <= plan.worker_seconds(0, 600) + 1e-6
    # Several per step saves what one per step cannot (the plans: 2,910 against 3,330).
    assert step_oracle(None).least_worker_seconds(0, 600) < o.least_worker_seconds(0, 600)


def test_a_limit_of_two_workers_per_decision_starts_four_decisions_ahead():
    plan = step_oracle(2).plan(0.0, 600.0)
    changes = [(t, n) for (t, n), (_, before) in zip(plan.decisions, [(0, 1), *plan.decisions], strict=False)
               if n != before]  # fmt: skip
    # 7 workers at 2 a decision, just in time: at 90 s, decisions at 100, 110 and 120 s could still add 6 by 150 s,
    # one short of 7: add 1; then 2 at each of 100, 110 and 120 s. The step down removes 2 a decision.
    assert changes[:4] == [(90.0, 2), (100.0, 4), (110.0, 6), (120.0, 8)]
    assert changes[4:] == [(450.0, 6), (460.0, 4), (470.0, 2), (480.0, 1)]

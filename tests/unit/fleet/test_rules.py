"""The fleet's one staleness rule and one schedulability rule (components/fleet/rules.py): boundaries and derived
values, with the numbers derived in the comments."""

from __future__ import annotations

import math

import pytest

from components.fleet.rules import (
    DOWN_HOLD_S,
    LOAD_REPORTS,
    MAX_GAP_FACTOR,
    QUEUE_REPORTS,
    StaleRule,
    is_fresh,
    is_schedulable,
    next_interval,
    report_clears_down,
    stale_at,
)
from components.router.config import RouterConfig

pytestmark = pytest.mark.unit


def test_the_load_rule_is_a_few_of_the_senders_own_intervals_never_less_than_the_floor():
    assert stale_at(None, None) == math.inf  # never reported: nothing to go stale
    assert stale_at(10.0, None) == pytest.approx(20.0)  # one report: 10 s (the lease TTL), no interval known yet
    assert stale_at(10.0, 0.1) == pytest.approx(10.5)  # 5 x 0.1 s = the 0.5 s floor
    assert stale_at(10.0, 0.05) == pytest.approx(10.5)  # 5 x 0.05 = 0.25 s: the floor wins
    assert stale_at(10.0, 1.0) == pytest.approx(15.0)  # a slow publisher is given 5 x 1 s
    assert stale_at(10.0, 2.0) == pytest.approx(20.0)  # every 2 s: 10 s, where 3 planner pulls (3 s) flapped


def test_the_queue_rule_keeps_the_decode_workers_numbers():
    assert stale_at(None, None, QUEUE_REPORTS) == math.inf
    assert stale_at(5.0, None, QUEUE_REPORTS) == pytest.approx(6.0)  # one report: the 1 s floor
    assert stale_at(5.0, 0.1, QUEUE_REPORTS) == pytest.approx(6.0)  # max(1 s, 3 x 0.1 s)
    assert stale_at(5.0, 2.0, QUEUE_REPORTS) == pytest.approx(11.0)  # 3 x 2 s


def test_fresh_strictly_before_the_stale_instant():
    at = stale_at(1.0, 0.1)  # 1.5
    assert is_fresh(1.4999, at) and not is_fresh(at, at) and not is_fresh(1.6, at)
    assert is_fresh(1e12, math.inf)  # no report: never stale


def test_the_router_config_defaults_are_the_load_rule():
    cfg = RouterConfig()
    assert (cfg.metrics_stale_intervals, cfg.metrics_stale_min_s) == (LOAD_REPORTS.intervals, LOAD_REPORTS.floor_s)


def test_the_interval_estimate_takes_the_first_gap_then_moves_a_tenth_of_the_way_capped_at_twice():
    assert next_interval(None, None, 0.0) is None  # the first report: no gap yet
    assert next_interval(0.0, None, 0.1) == pytest.approx(0.1)  # the first gap as it is
    # A 0.3 s gap against an estimate of 0.1: counted as min(0.3, 2 x 0.1) = 0.2; the estimate moves 0.1 of the way.
    assert next_interval(0.1, 0.1, 0.4) == pytest.approx(0.1 + 0.1 * (0.2 - 0.1))
    # A 10 s pause (a GC, a reconnect) moves it by at most 10%: 0.1 + 0.1 x (0.2 - 0.1) = 0.11, not ~1.1.
    assert next_interval(0.0, 0.1, 10.0) == pytest.approx(0.11)
    # A shorter gap moves it down: 0.1 + 0.1 x (0.05 - 0.1) = 0.095.
    assert next_interval(0.0, 0.1, 0.05) == pytest.approx(0.095)
    # Two reports at one instant leave it as it was.
    assert next_interval(1.0, 0.1, 1.0) == 0.1 and next_interval(1.0, None, 0.5) is None
    # The queue stream smooths by 0.3: 1.0 + 0.3 x (min(5, 2 x 1) - 1) = 1.3.
    assert next_interval(0.0, 1.0, 5.0, QUEUE_REPORTS) == pytest.approx(1.0 + 0.3 * (MAX_GAP_FACTOR * 1.0 - 1.0))


def test_a_steady_reporter_converges_on_its_interval_and_stays_fresh_between_reports():
    # Reports every 0.25 s: the estimate is 0.25 from the second report on; stale 5 x 0.25 = 1.25 s after each.
    rule = StaleRule(intervals=5.0, floor_s=0.5, first_report_s=10.0, smoothing=0.1)
    received, interval = None, None
    for k in range(20):
        t = 0.25 * k
        interval = next_interval(received, interval, t, rule)
        received = t
    assert interval == pytest.approx(0.25)
    assert stale_at(received, interval, rule) == pytest.approx(4.75 + 1.25)


def test_schedulable_unless_a_status_said_no_or_an_owner_marked_it_down():
    assert is_schedulable(True, None)
    assert not is_schedulable(False, None)
    assert not is_schedulable(True, 3.0)
    assert not is_schedulable(False, 3.0)


def test_a_mark_is_cleared_by_a_report_received_one_second_after_it():
    assert DOWN_HOLD_S == 1.0
    assert not report_clears_down(10.0, 10.0)  # a report in flight when the process died
    assert not report_clears_down(10.0, 10.999)
    assert report_clears_down(10.0, 11.0)  # the boundary counts: 1.0 s after the mark
    assert not report_clears_down(10.0, 9.0)  # received before the mark

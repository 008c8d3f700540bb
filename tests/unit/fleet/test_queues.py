"""The prefill queues as their reports tell them (components/fleet/queues.py): which prefill workers count as
alive (the decode workers' rule), which report gives a model's numbers, and what "no data" looks like. Explicit
clock throughout."""

from __future__ import annotations

import pytest

from components.fleet.queues import FORGET_AFTER_S, PrefillQueues, PrefillQueueView, parse_report
from components.protocol.messages import PrefillQueueReport
from components.workers.disagg import PrefillWorkers

pytestmark = pytest.mark.unit


def report(model: str = "m", waiting: int = 0, *, in_flight: int = 0, error: str = "", busy: bool = False):
    return PrefillQueueReport(model, waiting, in_flight, 0.25 * waiting, 1, 0, busy, stats_error=error)


def test_workers_count_while_they_report_and_stop_after_three_intervals_or_one_second():
    q = PrefillQueues()
    assert q.views(0.0) == [] and q.count("m", 0.0) == 0
    for t in (0.0, 0.1, 0.2):
        q.apply(1, report(), t)
    q.apply(2, report(), 0.2)
    q.apply(3, report(model="other"), 0.2)  # another model's prefill worker counts there, not here
    assert q.count("m", 0.25) == 2 and q.count("other", 0.25) == 1
    # Worker 1 reports every 0.1 s: stale after max(3 x 0.1, 1 s) = 1 s after its last report, at 1.2;
    # worker 2 (one report, no interval yet) after the 1 s minimum, also at 1.2.
    assert q.count("m", 1.15) == 2
    assert q.count("m", 1.25) == 0
    # A slow reporter (every 2 s) stays alive for 3 of its intervals, not 1 s.
    for t in (10.0, 12.0, 14.0):
        q.apply(4, report(), t)
    assert q.is_alive(4, 19.9) and not q.is_alive(4, 20.1)


def test_the_count_agrees_with_the_decode_workers_rule():
    # The frontend and the decode workers must agree on how many prefill workers there are: same reports, same count.
    q, decode = PrefillQueues(), PrefillWorkers("m")
    arrivals = [(1, 0.0), (1, 0.1), (2, 0.15), (1, 0.2), (1, 0.9), (2, 1.0), (1, 1.0), (1, 1.1), (3, 2.0)]
    for iid, t in arrivals:
        q.apply(iid, report(), t)
        decode.apply(iid, report(), t)
    for t in [x / 20 for x in range(0, 120)]:
        assert q.count("m", t) == decode.count(t), t


def test_the_numbers_are_the_freshest_readable_report_of_an_alive_worker():
    q = PrefillQueues()
    q.apply(1, report(waiting=5, in_flight=1, busy=True), 0.0)
    q.apply(2, report(waiting=2, in_flight=2), 0.05)
    v = q.view("m", 0.1)
    # Both workers read the same stream; the newer reading wins (summing would count one queue twice).
    assert (v.waiting, v.in_flight, v.oldest_age_s, v.prefill_workers, v.busy) == (2, 2, 0.5, 2, 1)
    assert v.report_age_s == pytest.approx(0.05)
    # A newer report that could not read the queue does not blank the numbers while an older readable one is alive.
    q.apply(1, report(error="stream not found"), 0.2)
    v = q.view("m", 0.2)
    assert (v.waiting, v.prefill_workers, v.stats_error) == (2, 2, "")


def test_no_data_is_none_not_zero():
    q = PrefillQueues()
    q.apply(1, report(error="nats: timeout"), 0.0)
    v = q.view("m", 0.5)
    assert v == PrefillQueueView("m", prefill_workers=1, stats_error="nats: timeout") and not v.known
    # Every reporter silent: the model is still known, with 0 workers and unknown numbers (not an empty queue).
    assert q.views(5.0) == [PrefillQueueView("m", 0)]
    assert q.view("never-heard", 0.0) == PrefillQueueView("never-heard", 0)


def test_silent_reporters_are_forgotten_and_the_model_stays():
    q = PrefillQueues()
    q.apply(1, report(), 0.0)
    q.apply(2, report(), FORGET_AFTER_S + 20.0)  # a sweep: worker 1 has been silent longer than FORGET_AFTER_S
    assert q.sources() == [2] and q.latest(1) is None
    q.forget(2)
    assert q.sources() == [] and q.models() == ["m"]


def test_parse_report_accepts_reports_and_refuses_anything_else():
    good = report(waiting=3).to_dict()
    assert parse_report(good) == report(waiting=3)
    assert parse_report({**good, "new_field": 1}) == report(waiting=3)  # a newer peer's extra field: ignored
    for bad in (None, 7, "m", [good], {"model": "m"}, {**good, "model": ""}):
        assert parse_report(bad) is None, bad

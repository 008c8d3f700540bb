"""The request reports' book (components/frontend/request_stats.py): one report per model per interval, zeros for
a served model without traffic, a model no longer served reported until its requests have ended, then forgotten.
The per-request counting is in test_dispatch.py; the published reports on a real mesh in
tests/integration/test_request_stats.py."""

from __future__ import annotations

import pytest

from components.frontend.request_stats import RequestStatsBook
from components.protocol.messages import RequestStatsReport

pytestmark = pytest.mark.unit


def test_a_served_model_without_traffic_gets_a_zero_report_for_the_interval_it_covers():
    book = RequestStatsBook(now_s=10.0)
    assert book.take({"m"}, now_s=11.0) == [RequestStatsReport(model="m", interval_s=1.0)]
    assert book.take({"m"}, now_s=12.5) == [RequestStatsReport(model="m", interval_s=1.5)]
    assert book.take(set(), now_s=13.0) == [RequestStatsReport(model="m", interval_s=0.5)]  # its last
    assert book.take(set(), now_s=14.0) == []


def test_counts_go_to_the_interval_they_happened_in_and_restart_at_zero():
    book = RequestStatsBook(now_s=0.0)
    s = book.model("m")
    s.arrived(100)
    s.arrived(50)
    s.ended(7, failed=False)
    (r,) = book.take({"m"}, now_s=1.0)
    assert (r.requests, r.prompt_tokens, r.finished, r.failed, r.output_tokens) == (2, 150, 1, 0, 7)
    s.ended(0, failed=True)  # the second request, in the next interval
    (r,) = book.take({"m"}, now_s=2.0)
    assert (r.requests, r.prompt_tokens, r.finished, r.failed, r.output_tokens) == (0, 0, 1, 1, 0)
    assert s.inflight == 0


def test_a_model_no_longer_served_is_reported_until_its_requests_in_flight_have_ended():
    book = RequestStatsBook(now_s=0.0)
    s = book.model("gone")
    s.arrived(10)
    # Its workers left (not served) with the request still running: reported (it arrived), and kept.
    assert [(r.model, r.requests) for r in book.take({"other"}, now_s=1.0)] == [("gone", 1), ("other", 0)]
    assert [(r.model, r.finished) for r in book.take({"other"}, now_s=2.0)] == [("gone", 0), ("other", 0)]
    s.ended(3, failed=True)
    assert [(r.model, r.failed) for r in book.take({"other"}, now_s=3.0)] == [("gone", 1), ("other", 0)]
    assert [r.model for r in book.take({"other"}, now_s=4.0)] == ["other"]  # forgotten


def test_prefixes_are_reported_only_when_asked_and_restart_each_interval():
    from components.protocol.messages import PrefixCount

    # Without --request-stats-prefixes nothing carried is reported (the reports as they were).
    off = RequestStatsBook(0.0)
    off.model("m").carried((1, 2, 3))
    [r] = off.take({"m"}, 1.0)
    assert r.prefixes == ()
    # With 1: the prefix most requests carried, (1, 2) by two requests (their shared run), over (9,) by one.
    book = RequestStatsBook(0.0, max_prefixes=1)
    c = book.model("m")
    for hashes in ((1, 2, 3), (1, 2, 4), (9,)):
        c.carried(hashes)
    [r] = book.take({"m"}, 1.0)
    assert r.prefixes == (PrefixCount((1, 2), 2),)
    [r] = book.take({"m"}, 2.0)
    assert r.prefixes == ()  # the next interval starts empty

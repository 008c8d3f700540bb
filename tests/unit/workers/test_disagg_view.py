"""A decode worker's count of live prefill workers, from their queue reports (pure: explicit clock)."""

from __future__ import annotations

import pytest

from components.protocol.messages import PrefillQueueReport
from components.workers.disagg import PrefillWorkers

pytestmark = pytest.mark.unit


def report(model: str = "m", waiting: int = 0) -> PrefillQueueReport:
    return PrefillQueueReport(model, waiting, 0, 0.0, 1, 0, False)


def test_prefill_workers_count_while_they_report_and_not_after():
    view = PrefillWorkers("m")
    assert view.count(0.0) == 0
    for t in (0.0, 0.1, 0.2):
        view.apply(1, report(), t)
    view.apply(2, report(), 0.2)
    view.apply(3, report(model="other"), 0.2)  # another model's prefill worker does not count
    assert view.count(0.25) == 2
    # Reporting every 0.1 s: worker 1 is stale after max(3 intervals, 1 s); worker 2 (one report) after 1 s.
    assert view.count(1.15) == 2
    assert view.count(1.25) == 0
    view.forget(1)
    view.apply(2, report(), 1.3)
    assert view.count(1.3) == 1

"""``PrefillQueueFeed``: the frontend's subscription to ``TOPIC_PREFILL_QUEUE``, feeding a ``PrefillQueues`` that
``/metrics`` renders at scrape time (components/frontend/metrics.py). All of its I/O is here; what counts as alive
and which report gives a model's numbers is the pure ``components.fleet.queues``.

The frontend does not use these numbers to route: clients go to decode (or aggregated) workers, and a decode worker
decides itself whether a prompt goes to the queue (components/workers/disagg.py). They are here for the operator and
the planner's dashboards: one scrape shows how deep each model's prefill queue is and how many prefill workers
drain it.

Owns: one subscription and one task (``frontend-prefill-queue:<namespace>``, in the runtime's supervisor), both
released by ``stop()`` (components/frontend/report_feed.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from components.fleet.queues import PrefillQueues, parse_report
from components.frontend.report_feed import ReportFeed
from components.protocol.endpoints import TOPIC_PREFILL_QUEUE
from components.protocol.messages import PrefillQueueReport
from components.runtime import Runtime


class PrefillQueueFeed(ReportFeed[PrefillQueueReport]):
    def __init__(
        self,
        runtime: Runtime,
        namespace: str,
        queues: PrefillQueues,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(runtime, namespace, TOPIC_PREFILL_QUEUE, "prefill-queue", parse_report, queues.apply, clock)
        self.queues = queues

"""Workers' migration counters for ``/metrics``: ``MigrationCounters`` keeps the latest ``MigrationCountersReport`` of
each worker (pure: every call takes ``now_s``), ``MigrationCountersFeed`` follows ``TOPIC_MIGRATION_COUNTERS`` into it,
and ``components.frontend.metrics`` renders it at scrape time as ``kvmesh_worker_migrations_total`` and friends.

Why through the frontend: a worker serves no HTTP endpoint of its own (its load goes out on NATS), and the frontend's
``/metrics`` is where operators already look; every worker publishes its counters when they changed and every 10 s
otherwise (components/workers/worker.py), so a frontend started later has them within 10 s. The counters are the
worker's own, cumulative since it started: the frontend relays them as Prometheus counters (a restarted worker is a
new instance id, hence new series). A worker silent for ``FORGET_AFTER_S`` is dropped (its series end, as a scrape
target's do when it goes); at most ``MAX_WORKERS`` are kept, the longest silent dropped first.

Owns: one subscription and one task (``frontend-migration-counters:<namespace>``, in the runtime's supervisor), both
released by ``stop()`` (components/frontend/report_feed.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from components.frontend.report_feed import ReportFeed
from components.protocol.endpoints import TOPIC_MIGRATION_COUNTERS
from components.protocol.migration import MigrationCountersReport
from components.runtime import Runtime

logger = logging.getLogger(__name__)

FORGET_AFTER_S = 300.0  # 30 of a worker's repeats missed: it is gone
MAX_WORKERS = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerCounters:
    instance_id: int
    report: MigrationCountersReport
    received_s: float


class MigrationCounters:
    """The latest counters heard from each worker (module docstring). Not thread-safe; one event loop owns it."""

    def __init__(self) -> None:
        self._workers: dict[int, WorkerCounters] = {}

    def apply(self, source_id: int, report: MigrationCountersReport, now_s: float) -> None:
        self._workers.pop(source_id, None)  # re-inserted last: the dict stays ordered by last report
        self._workers[source_id] = WorkerCounters(source_id, report, now_s)
        self._forget(now_s)

    def workers(self, now_s: float) -> list[WorkerCounters]:
        """Every worker heard within ``FORGET_AFTER_S``, by instance id."""
        return sorted(
            (w for w in self._workers.values() if now_s - w.received_s <= FORGET_AFTER_S), key=lambda w: w.instance_id
        )

    def _forget(self, now_s: float) -> None:
        for iid in [i for i, w in self._workers.items() if now_s - w.received_s > FORGET_AFTER_S]:
            del self._workers[iid]
        while len(self._workers) > MAX_WORKERS:
            del self._workers[next(iter(self._workers))]


def parse_report(payload: Any) -> MigrationCountersReport | None:
    """An event's payload as a ``MigrationCountersReport``; None when it is not one (a peer of another version)."""
    if not isinstance(payload, dict):
        return None
    try:
        return MigrationCountersReport.from_dict(payload)
    except (KeyError, TypeError, ValueError):
        return None


class MigrationCountersFeed(ReportFeed[MigrationCountersReport]):
    def __init__(
        self, runtime: Runtime, namespace: str, counters: MigrationCounters, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(
            runtime, namespace, TOPIC_MIGRATION_COUNTERS, "migration-counters", parse_report, counters.apply, clock
        )
        self.counters = counters

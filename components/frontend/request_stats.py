"""The frontend's request reports for the SLA planner: what this frontend process saw of its requests, per served
model, published as one ``RequestStatsReport`` per model every ``request_stats_interval_s`` on ``TOPIC_REQUEST_STATS``
(source id: the process's router replica id, so each replica of ``kvmesh frontend --replicas N`` reports its own).

- ``RequestCounts`` (components/fleet/request_counts.py, shared with the simulator): one model's counts since the
  last report. The service counts a request's arrival when it hands it to the router (``FrontendService.start``)
  and its end once (``FrontendService.observe``, or a failure before the first token); ``Generation._process``
  adds its TTFT and inter-token gaps per chunk it hands to the client, in place (a few float operations per chunk,
  no allocation: the hot path, see ``kvmesh bench frontend``).
- ``RequestStatsBook``: every model's counts; ``take(served, now_s)`` turns them into reports and starts the next
  interval (pure: time is an argument). A served model gets a report every interval, zeros included, so the planner
  can tell "heard, no load" from "nothing heard"; a model no longer served gets its last report once its requests
  in flight have ended, then none.
- ``RequestStatsPublisher``: the task that calls ``take`` on a fixed cadence and publishes. A report that cannot be
  published (NATS reconnecting) is lost: its counts are not carried to the next one, which would report them as the
  wrong interval's.

Owns: one task (``frontend-request-stats:<namespace>``, in the runtime's supervisor), cancelled by ``stop()``, which
publishes a last report of the requests that ended meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection

from components.fleet.request_counts import RequestCounts
from components.protocol.endpoints import TOPIC_REQUEST_STATS
from components.protocol.messages import RequestStatsReport
from components.runtime import Runtime

logger = logging.getLogger(__name__)


class RequestStatsBook:
    """Every model's ``RequestCounts`` of one frontend process (module docstring)."""

    def __init__(self, now_s: float, max_prefixes: int = 0) -> None:
        self._models: dict[str, RequestCounts] = {}
        self._since_s = now_s  # when the current interval began
        self.max_prefixes = max_prefixes  # prefixes per report (``RequestCounts.carried``; 0: none counted)

    def model(self, name: str) -> RequestCounts:
        """``name``'s counts, created at its first request (a request holds on to them until it ends)."""
        stats = self._models.get(name)
        if stats is None:
            stats = self._models[name] = RequestCounts()
        return stats

    def take(self, served: Collection[str], now_s: float) -> list[RequestStatsReport]:
        """The reports of the interval ending at ``now_s``, by model name, and the start of the next: one for every
        model in ``served`` and every model with counts or requests in flight; a model not in ``served`` whose
        requests have all ended is then forgotten."""
        interval_s = now_s - self._since_s
        self._since_s = now_s
        for name in served:
            self.model(name)
        reports = []
        for name in sorted(self._models):
            stats = self._models[name]
            reports.append(stats.report(name, interval_s, self.max_prefixes))
            stats.reset()
            if name not in served and stats.inflight <= 0:
                del self._models[name]
        return reports


class RequestStatsPublisher:
    """Publishes ``book``'s reports for the models ``served()`` names every ``interval_s`` (module docstring)."""

    def __init__(
        self,
        runtime: Runtime,
        namespace: str,
        book: RequestStatsBook,
        served: Callable[[], Collection[str]],
        source_id: int,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.book = book
        self.served = served
        self.source_id = source_id
        self.interval_s = interval_s
        self.clock = clock
        self.num_published = 0
        self.num_lost = 0  # reports the bus refused
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.book.take((), self.clock())  # the first interval starts now, not when the book was made
        self._task = self.runtime.supervisor.spawn(self._run(), name=f"frontend-request-stats:{self.namespace}")

    async def stop(self) -> None:
        """Stop the cadence and publish what the last, shorter interval saw (requests that ended while the frontend
        drained)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        # gather, not "await task" under suppress(CancelledError): a stop() that is itself cancelled stays so.
        await asyncio.gather(task, return_exceptions=True)
        await self.publish()

    async def publish(self) -> None:
        """Take the reports of the interval ending now and publish them."""
        events = self.runtime.namespace(self.namespace).events
        for report in self.book.take(set(self.served()), self.clock()):
            try:
                await events.publish(TOPIC_REQUEST_STATS, report.to_dict(), source_id=self.source_id)
                self.num_published += 1
            except Exception as e:  # noqa: BLE001 - NATS reconnecting: this interval is lost, the next one is not
                self.num_lost += 1
                if self.num_lost == 1 or self.num_lost % 100 == 0:
                    logger.warning(
                        "publishing request stats of %s: %s (%d lost so far)", report.model, e, self.num_lost
                    )

    async def _run(self) -> None:
        # A fixed cadence (the next tick from the previous one, not from when publishing ended), so the reports'
        # intervals tile time without gaps or drift; each report carries the interval it covers as measured.
        loop = asyncio.get_running_loop()
        next_s = loop.time()
        while True:
            next_s += self.interval_s
            await asyncio.sleep(max(0.0, next_s - loop.time()))
            await self.publish()
            if next_s < loop.time() - self.interval_s:  # starved for more than an interval: do not burst to catch up
                next_s = loop.time()

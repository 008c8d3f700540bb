"""``ReportFeed``: the frontend's subscription to one event-plane topic of workers' periodic reports, each parsed and
handed to a pure keeper that ``/metrics`` reads at scrape time (``MigrationCountersFeed``; the prefill queue's
reports are the fleet view's, ``components.fleet.live``).

A report that does not parse (a peer of another version) is counted and logged, the first and then every 1000th, not
at the rate such peers publish. Events wait unread up to ``MAX_PENDING`` when the loop is starved; the oldest are
dropped first, which loses nothing of value (a newer report from the same worker supersedes them).

Owns: one subscription and one task (``frontend-<name>:<namespace>``, in the runtime's supervisor), both released
by ``stop()``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from components.runtime import EventSubscription, Runtime

logger = logging.getLogger(__name__)

MAX_PENDING = 10_000

R = TypeVar("R")


class ReportFeed(Generic[R]):
    """Follows ``topic`` in ``namespace``: ``parse(payload)`` (None: not a report) then ``apply(source_id, report,
    clock())``; ``name`` names the task and the log lines."""

    def __init__(
        self,
        runtime: Runtime,
        namespace: str,
        topic: str,
        name: str,
        parse: Callable[[Any], R | None],
        apply: Callable[[int, R, float], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.clock = clock
        self.num_unparsed = 0
        self._topic = topic
        self._name = name
        self._parse = parse
        self._apply = apply
        self._sub: EventSubscription[Any] | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        events = self.runtime.namespace(self.namespace).events
        self._sub = await events.subscribe(self._topic, max_pending=MAX_PENDING)
        self._task = self.runtime.supervisor.spawn(
            self._consume(self._sub), name=f"frontend-{self._name}:{self.namespace}"
        )

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # gather, not "await task" under suppress(CancelledError): a stop() that is itself cancelled stays so.
            await asyncio.gather(task, return_exceptions=True)
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.close()
            except Exception as e:  # noqa: BLE001 - the runtime's shutdown releases it anyway
                logger.warning("closing subscription %s: %s", sub.topic, e)

    async def _consume(self, sub: EventSubscription[Any]) -> None:
        async for ev in sub:
            report = self._parse(ev.payload)
            if report is None:
                self.num_unparsed += 1
                if self.num_unparsed == 1 or self.num_unparsed % 1000 == 0:  # a foreign publisher: say so, not 10/s
                    logger.warning(
                        "%s report from %x does not parse (%d so far)", self._name, ev.source_id, self.num_unparsed
                    )
                continue
            self._apply(ev.source_id, report, self.clock())

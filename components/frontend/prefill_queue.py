"""``PrefillQueueFeed``: the frontend's subscription to ``TOPIC_PREFILL_QUEUE``, feeding a ``PrefillQueues`` that
``/metrics`` renders at scrape time (components/frontend/metrics.py). All of its I/O is here; what counts as alive
and which report gives a model's numbers is the pure ``components.router.prefill_queue``.

The frontend does not use these numbers to route: clients go to decode (or aggregated) workers, and a decode worker
decides itself whether a prompt goes to the queue (components/workers/disagg.py). They are here for the operator and
the planner's dashboards: one scrape shows how deep each model's prefill queue is and how many prefill workers
drain it.

Owns: one subscription and one task (``frontend-prefill-queue:<namespace>``, in the runtime's supervisor), both
released by ``stop()``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from components.protocol.endpoints import TOPIC_PREFILL_QUEUE
from components.router.prefill_queue import PrefillQueues, parse_report
from components.runtime import EventSubscription, Runtime

logger = logging.getLogger(__name__)

# Events that may wait unread: one prefill worker reporting every 100 ms makes 10 a second; the loop reads them as
# they come, so this bounds memory only when the loop is starved. The oldest are dropped first, which loses nothing
# of value (a newer report from the same worker supersedes them).
MAX_PENDING = 10_000


class PrefillQueueFeed:
    def __init__(
        self,
        runtime: Runtime,
        namespace: str,
        queues: PrefillQueues,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.queues = queues
        self.clock = clock
        self.num_unparsed = 0
        self._sub: EventSubscription[Any] | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        events = self.runtime.namespace(self.namespace).events
        self._sub = await events.subscribe(TOPIC_PREFILL_QUEUE, max_pending=MAX_PENDING)
        self._task = self.runtime.supervisor.spawn(
            self._consume(self._sub), name=f"frontend-prefill-queue:{self.namespace}"
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
            report = parse_report(ev.payload)
            if report is None:
                self.num_unparsed += 1
                if self.num_unparsed == 1 or self.num_unparsed % 1000 == 0:  # a foreign publisher: say so, not 10/s
                    logger.warning(
                        "prefill queue report from %x does not parse (%d so far)", ev.source_id, self.num_unparsed
                    )
                continue
            self.queues.apply(ev.source_id, report, self.clock())

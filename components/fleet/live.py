"""``LiveFleet``: a ``FleetState`` kept current from the mesh. All of the fleet view's I/O lives here.

- membership (``watch_membership``): one etcd watch over the namespace's instance registrations
  (``kvmesh/<ns>/instances/``), optionally only those of some components. A worker registers once per endpoint it
  serves (a decode worker: ``generate``, ``kv_state``, ...; a prefill worker: no ``generate``), all under one instance
  id: it is a member while any of its registrations is, with the metadata of its ``generate`` registration (else of
  any). A registration lost with etcd's data (a re-listing's DELETE) counts as a deregistration here, as in the
  planner's listings; the request plane's ``Client`` keeps such an instance a while longer for calls to it;
- ``load_metrics`` -> ``FleetState.apply_load``; ``worker_status`` -> ``apply_status``; ``prefill_queue`` ->
  ``apply_queue`` (``follow_queues``); ``request_stats`` (the frontends' request reports, ``follow_requests``) ->
  ``apply_request_stats`` with the frontend's source id in hex as its source; each stamped with ``clock()`` (the
  monotonic clock) as it is read.

The frontend and the standalone router feed their own membership (their model registries list the workers they
call) and share the state with their ``Router``: ``watch_membership=False``. The planner and a rescheduler, which do
not call workers, let this class follow membership.

Owns: its subscriptions and its tasks (``fleet-*:<namespace>``, in the runtime's supervisor), released by ``stop()``,
each in its own try.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from components.fleet.model import FleetInstance, FleetSnapshot
from components.fleet.queues import parse_report
from components.fleet.state import FleetListener, FleetState
from components.protocol.endpoints import (
    ENDPOINT_GENERATE,
    TOPIC_LOAD_METRICS,
    TOPIC_PREFILL_QUEUE,
    TOPIC_REQUEST_STATS,
    TOPIC_WORKER_STATUS,
)
from components.protocol.messages import LoadSnapshot, RequestStatsReport
from components.protocol.migration import WorkerStatus
from components.runtime import EventSubscription, InstanceInfo, Runtime
from components.runtime.discovery import WatchEventKind
from components.runtime.runtime import instances_prefix

logger = logging.getLogger(__name__)


class LiveFleet:
    """The live fleet view of ``namespace`` (module docstring); ``state`` is shared with whoever passes it (a new one
    otherwise). Gives ``FleetView``'s reading methods."""

    def __init__(
        self,
        runtime: Runtime,
        namespace: str,
        *,
        state: FleetState | None = None,
        components: Sequence[str] | None = None,
        watch_membership: bool = True,
        follow_queues: bool = True,
        follow_requests: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.state = state if state is not None else FleetState()
        self.components = None if components is None else frozenset(components)
        self.watch_membership = watch_membership
        self.follow_queues = follow_queues
        self.follow_requests = follow_requests
        self.clock = clock
        # Events applied and events that did not parse, by topic (tests wait on these, operators read them).
        self.received: collections.Counter[str] = collections.Counter()
        self.unparsed: collections.Counter[str] = collections.Counter()
        self._subs: list[EventSubscription[Any]] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._regs: dict[int, dict[str, InstanceInfo]] = {}  # instance id -> registration key -> its info

    # --- FleetView --------------------------------------------------------------------------------------------------

    def snapshot(self, now_s: float | None = None) -> FleetSnapshot:
        """The fleet at ``now_s`` (default: now on ``clock``)."""
        return self.state.snapshot(self.clock() if now_s is None else now_s)

    def instance(self, instance_id: int) -> FleetInstance | None:
        return self.state.instance(instance_id)

    def add_listener(self, listener: FleetListener) -> None:
        self.state.add_listener(listener)

    def remove_listener(self, listener: FleetListener) -> None:
        self.state.remove_listener(listener)

    # --- life -------------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Subscribe, then list the registrations (reports that arrive meanwhile are kept: they may overtake a
        registration), then watch."""
        ns = self.runtime.namespace(self.namespace)
        spawn = self.runtime.supervisor.spawn
        topics: list[tuple[str, Callable[[EventSubscription[Any]], Any]]] = [
            (TOPIC_LOAD_METRICS, self._consume_loads),
            (TOPIC_WORKER_STATUS, self._consume_status),
        ]
        if self.follow_queues:
            topics.append((TOPIC_PREFILL_QUEUE, self._consume_queue))
        if self.follow_requests:
            topics.append((TOPIC_REQUEST_STATS, self._consume_requests))
        for topic, consume in topics:
            sub: EventSubscription[Any] = await ns.events.subscribe(topic)
            self._subs.append(sub)
            self._tasks.append(spawn(consume(sub), name=f"fleet-{topic}:{self.namespace}"))
        if self.watch_membership:
            prefix = instances_prefix(self.namespace)
            listing = await self.runtime.discovery.get_prefix(prefix)
            for key, value in listing.items():
                self._put(key, value)
            for iid in sorted(self._regs):
                self._sync_member(iid)
            self._tasks.append(spawn(self._watch(prefix, listing), name=f"fleet-members:{self.namespace}"))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        # gather, not "await t" under suppress(CancelledError): a stop() that is itself cancelled must stay cancelled.
        await asyncio.gather(*tasks, return_exceptions=True)
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await sub.close()
            except Exception as e:  # noqa: BLE001 - release the rest
                logger.warning("closing subscription %s: %s", sub.topic, e)

    # --- membership -------------------------------------------------------------------------------------------------

    async def _watch(self, prefix: str, known: dict[str, bytes]) -> None:
        async for ev in self.runtime.discovery.watch_prefix(prefix, known=known):
            if ev.kind == WatchEventKind.PUT and ev.value is not None:
                iid = self._put(ev.key, ev.value)
            else:
                iid = self._delete(ev.key)
            if iid is not None:
                self._sync_member(iid)

    def _put(self, key: str, value: bytes) -> int | None:
        try:
            info = InstanceInfo.from_json(value)
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("registration %s does not parse: %r", key, e)
            return None
        if self.components is not None and info.component not in self.components:
            return None
        self._regs.setdefault(info.instance_id, {})[key] = info
        return info.instance_id

    def _delete(self, key: str) -> int | None:
        for iid, regs in self._regs.items():
            if regs.pop(key, None) is not None:
                if not regs:
                    del self._regs[iid]
                return iid
        return None

    def _sync_member(self, iid: int) -> None:
        regs = self._regs.get(iid)
        if not regs:
            self.state.remove_instance(iid)
            return
        infos = sorted(regs.values(), key=lambda i: (i.endpoint != ENDPOINT_GENERATE, i.endpoint, i.component))
        metadata = infos[0].metadata
        current = self.state.instance(iid)
        if current is None or dict(current.metadata) != dict(metadata):
            self.state.add_instance(iid, metadata)

    # --- reports ----------------------------------------------------------------------------------------------------

    async def _consume_loads(self, sub: EventSubscription[Any]) -> None:
        state = self.state
        async for ev in sub:
            try:
                snap = LoadSnapshot.from_dict(ev.payload)
            except (KeyError, TypeError) as e:
                self.unparsed[TOPIC_LOAD_METRICS] += 1
                logger.warning("load metrics from %x do not parse: %r", ev.source_id, e)
                continue
            state.apply_load(ev.source_id, snap, self.clock())
            self.received[TOPIC_LOAD_METRICS] += 1

    async def _consume_status(self, sub: EventSubscription[Any]) -> None:
        state = self.state
        async for ev in sub:
            try:
                status = WorkerStatus.from_dict(ev.payload)
            except (KeyError, TypeError, ValueError) as e:
                self.unparsed[TOPIC_WORKER_STATUS] += 1
                logger.warning("worker status from %x does not parse: %r", ev.source_id, e)
                continue
            state.apply_status(ev.source_id, status, self.clock())
            self.received[TOPIC_WORKER_STATUS] += 1

    async def _consume_queue(self, sub: EventSubscription[Any]) -> None:
        state = self.state
        async for ev in sub:
            report = parse_report(ev.payload)
            if report is None:
                n = self.unparsed[TOPIC_PREFILL_QUEUE] = self.unparsed[TOPIC_PREFILL_QUEUE] + 1
                if n == 1 or n % 1000 == 0:  # a foreign publisher: say so, not 10/s
                    logger.warning("prefill queue report from %x does not parse (%d so far)", ev.source_id, n)
                continue
            state.apply_queue(ev.source_id, report, self.clock())
            self.received[TOPIC_PREFILL_QUEUE] += 1

    async def _consume_requests(self, sub: EventSubscription[Any]) -> None:
        state = self.state
        async for ev in sub:
            report = parse_request_stats(ev.payload)
            if report is None:
                n = self.unparsed[TOPIC_REQUEST_STATS] = self.unparsed[TOPIC_REQUEST_STATS] + 1
                if n == 1 or n % 1000 == 0:  # a foreign publisher: say so, not once a second per model
                    logger.warning("request stats from %x do not parse (%d so far)", ev.source_id, n)
                continue
            state.apply_request_stats(f"{ev.source_id:x}", report, self.clock())
            self.received[TOPIC_REQUEST_STATS] += 1


def parse_request_stats(payload: Any) -> RequestStatsReport | None:
    """An event's payload as a ``RequestStatsReport``; None when it is not one (a peer of another version)."""
    if not isinstance(payload, dict):
        return None
    try:
        report = RequestStatsReport.from_dict(payload)
    except (KeyError, TypeError, ValueError):
        return None
    return report if isinstance(report.model, str) else None

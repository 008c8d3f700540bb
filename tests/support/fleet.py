"""The fleet view's behaviour, written once and run against both implementations (components/fleet): the in-memory
twin fed by explicit calls (tests/unit/fleet/test_view_behaviour.py) and the live view fed by real etcd and
nats-server (tests/integration/test_fleet_live.py).

A *driver* does to a fleet what the world does: a worker registers (with chosen metadata and instance id) or leaves,
a load report, a status or a queue report arrives at a given instant. ``MemoryDriver`` calls the twin's methods;
``LiveDriver`` registers real endpoints and publishes real events, and waits until the live view has read each one.
Both stamp arrivals with the driver's clock, which the test sets (``at``), so staleness is checked to the instant.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import pytest

from components.fleet.rules import DOWN_HOLD_S
from components.fleet.state import FleetState
from components.protocol.endpoints import (
    ENDPOINT_GENERATE,
    ENDPOINT_KV_STATE,
    TOPIC_LOAD_METRICS,
    TOPIC_PREFILL_QUEUE,
    TOPIC_WORKER_STATUS,
)
from components.protocol.messages import LoadSnapshot, PrefillQueueReport
from components.protocol.metadata import WorkerMetadata, WorkerRole
from components.protocol.migration import WorkerStatus
from tests.support.waiting import wait_until

MODEL = "m"


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class Driver(Protocol):
    state: FleetState
    clock: Clock

    async def register(self, iid: int, metadata: Mapping[str, Any], *, generate: bool = True) -> None: ...

    async def leave(self, iid: int) -> None: ...

    async def load(self, iid: int, snap: LoadSnapshot, at: float) -> None: ...

    async def status(self, iid: int, status: WorkerStatus, at: float) -> None: ...

    async def queue(self, iid: int, report: PrefillQueueReport, at: float) -> None: ...


class MemoryDriver:
    def __init__(self) -> None:
        self.clock = Clock()
        self.state = FleetState()

    async def register(self, iid: int, metadata: Mapping[str, Any], *, generate: bool = True) -> None:
        self.state.add_instance(iid, metadata)

    async def leave(self, iid: int) -> None:
        self.state.remove_instance(iid)

    async def load(self, iid: int, snap: LoadSnapshot, at: float) -> None:
        self.clock.now_s = at
        self.state.apply_load(iid, snap, self.clock())

    async def status(self, iid: int, status: WorkerStatus, at: float) -> None:
        self.clock.now_s = at
        self.state.apply_status(iid, status, self.clock())

    async def queue(self, iid: int, report: PrefillQueueReport, at: float) -> None:
        self.clock.now_s = at
        self.state.apply_queue(iid, report, self.clock())


class LiveDriver:
    """Drives a ``LiveFleet`` (watching membership) through ``runtime`` in ``namespace``."""

    def __init__(self, fleet: Any, runtime: Any, namespace: str) -> None:
        self.fleet = fleet
        self.state: FleetState = fleet.state
        self.clock: Clock = fleet.clock
        self.runtime = runtime
        self.ns = runtime.namespace(namespace)
        self._served: dict[int, list[Any]] = {}

    async def ready(self) -> None:
        """Until each subscription receives what is published (core NATS delivers only to live subscriptions): an
        unparsable marker per topic, counted by the view as ``unparsed``, and nothing else."""
        for topic in (TOPIC_LOAD_METRICS, TOPIC_WORKER_STATUS, TOPIC_PREFILL_QUEUE):
            for _ in range(200):
                before = self.fleet.unparsed[topic]
                await self.ns.events.publish(topic, {"marker": True}, source_id=1)
                try:
                    await wait_until(lambda t=topic, b=before: self.fleet.unparsed[t] > b, timeout_s=0.05)
                    break
                except AssertionError:
                    continue
            else:  # pragma: no cover - the mesh is broken
                raise AssertionError(f"the fleet never heard {topic}")
        # Markers still in flight arrive before anything published after this one.
        await self.runtime.bus.flush()

    async def register(self, iid: int, metadata: Mapping[str, Any], *, generate: bool = True) -> None:
        comp = self.ns.component("backend")
        endpoints = [ENDPOINT_KV_STATE, ENDPOINT_GENERATE] if generate else [ENDPOINT_KV_STATE]
        served = [await comp.endpoint(e).serve(_never_called, metadata=metadata, instance_id=iid) for e in endpoints]
        self._served[iid] = served
        await wait_until(lambda: self.state.instance(iid) is not None and self.state.instance(iid).model == MODEL)

    async def leave(self, iid: int) -> None:
        for s in reversed(self._served.pop(iid)):
            await s.stop(drain_timeout_s=1.0)
        await wait_until(lambda: self.state.instance(iid) is None)

    async def _publish(self, topic: str, iid: int, payload: Any, at: float) -> None:
        before = self.fleet.received[topic]
        self.clock.now_s = at
        await self.ns.events.publish(topic, payload, source_id=iid)
        await wait_until(lambda: self.fleet.received[topic] > before)

    async def load(self, iid: int, snap: LoadSnapshot, at: float) -> None:
        await self._publish(TOPIC_LOAD_METRICS, iid, snap.to_dict(), at)

    async def status(self, iid: int, status: WorkerStatus, at: float) -> None:
        await self._publish(TOPIC_WORKER_STATUS, iid, status.to_dict(), at)

    async def queue(self, iid: int, report: PrefillQueueReport, at: float) -> None:
        await self._publish(TOPIC_PREFILL_QUEUE, iid, report.to_dict(), at)


async def _never_called(body: Any, ctx: Any) -> Any:  # pragma: no cover - nothing calls these endpoints
    yield {}


def meta(role: WorkerRole = WorkerRole.AGGREGATED, **extra: Any) -> dict[str, Any]:
    md = WorkerMetadata(model=MODEL, role=role, node="n1", pid=100, block_size=16).to_dict()
    md.update(extra)
    return md


def snap(kv: float = 0.25, running: int = 1) -> LoadSnapshot:
    return LoadSnapshot(0.0, kv, 100, int(kv * 100), running, 0, 0, 0, running, 0)


# --- the behaviours -------------------------------------------------------------------------------------------------


async def an_instance_carries_its_role_domains_and_performance_model(d: Driver) -> None:
    step = {"prefill_base_ms": 7.5, "decode_base_ms": 3.0}
    await d.register(
        0x10, meta(WorkerRole.DECODE, step_time=step, profile_id="p-1", failure_unit="rack-2", later_key={"x": 1})
    )
    await d.register(0x11, meta(WorkerRole.PREFILL, node="n2", pid=7), generate=False)
    s = d.state.snapshot(0.0)
    dec, pre = s.instances[0x10], s.instances[0x11]
    assert (dec.model, dec.role, dec.profile_id, dec.serving) == (MODEL, WorkerRole.DECODE, "p-1", True)
    assert (dec.domains.node, dec.domains.process, dec.domains.unit) == ("n1", ("n1", 100), "rack-2")
    assert dec.metadata["later_key"] == {"x": 1}  # a key this version does not know is kept, not a crash
    assert (dec.perf.prefill_base_ms, dec.perf.decode_base_ms) == (7.5, 3.0)
    # No failure_unit announced: the unit is the node, the largest domain known.
    assert (pre.role, pre.serving, pre.domains.unit, pre.domains.process) == (
        WorkerRole.PREFILL,
        False,
        "n2",
        ("n2", 7),
    )
    assert [i.instance_id for i in s.serving(MODEL)] == [0x10] and [i.instance_id for i in s.prefill(MODEL)] == [0x11]
    assert s.disaggregated(MODEL) and s.models() == [MODEL]
    assert (dec.schedulable, dec.load, dec.fresh(0.0)) == (True, None, False)


async def loads_go_stale_by_the_one_rule(d: Driver) -> None:
    # Times in eighths of a second: exact in binary, so the boundary instants are exact too.
    await d.register(0x20, meta())
    await d.register(0x21, meta())
    for t in (1.0, 1.125, 1.25):
        await d.load(0x20, snap(kv=t / 10), at=t)
    await d.load(0x21, snap(kv=0.5), at=1.25)  # one report only
    rec = d.state.load(0x20)
    assert rec is not None
    # Gaps 0.125 and 0.125: the estimate is 0.125; stale at 1.25 + max(0.5, 5 x 0.125) = 1.875.
    assert (rec.received_s, rec.snapshot.kv_usage, rec.interval_s, rec.stale_at_s) == (1.25, 0.125, 0.125, 1.875)
    assert d.state.load(0x21).stale_at_s == 11.25  # one report: 1.25 + 10 s
    assert sorted(d.state.snapshot(1.874).fresh_loads(MODEL)) == [0x20, 0x21]
    later = d.state.snapshot(1.875)
    assert sorted(later.fresh_loads(MODEL)) == [0x21] and later.stale(MODEL) == [0x20]
    assert not later.instances[0x20].fresh(1.875) and later.instances[0x20].schedulable  # stale, still schedulable
    # A new report makes it fresh again. Gap 0.75, counted as 0.25 (twice the estimate): 0.125 + 0.1 x 0.125 =
    # 0.1375; stale 5 x 0.1375 = 0.6875 after it.
    await d.load(0x20, snap(), at=2.0)
    assert d.state.load(0x20).stale_at_s == pytest.approx(2.0 + 0.6875)
    assert sorted(d.state.snapshot(2.0).fresh_loads(MODEL)) == [0x20, 0x21]


async def a_status_makes_an_instance_unschedulable_until_it_says_otherwise(d: Driver) -> None:
    await d.register(0x30, meta())
    await d.register(0x31, meta())
    await d.status(0x30, WorkerStatus(False, "draining", 2), at=5.0)
    s = d.state.snapshot(5.0)
    assert (s.instances[0x30].schedulable, s.instances[0x30].unschedulable_reason) == (False, "draining")
    assert [i.instance_id for i in s.schedulable(MODEL)] == [0x31] and s.schedulable_count(MODEL) == 1
    assert d.state.unschedulable() == {0x30: "draining"}
    await d.status(0x30, WorkerStatus(False, "draining", 1), at=5.1)  # repeated every interval: no change
    assert d.state.snapshot(5.1).schedulable_count(MODEL) == 1
    await d.status(0x30, WorkerStatus(True), at=6.0)
    assert d.state.snapshot(6.0).schedulable_count(MODEL) == 2 and d.state.unschedulable() == {}


async def a_mark_down_holds_until_a_report_one_second_later(d: Driver) -> None:
    await d.register(0x40, meta())
    await d.load(0x40, snap(), at=9.9)
    assert d.state.mark_down(0x40, 10.0, "no responders") and not d.state.mark_down(0x40, 10.2)
    inst = d.state.snapshot(10.0).instances[0x40]
    assert (inst.schedulable, inst.unschedulable_reason) == (False, "down: no responders")
    await d.load(0x40, snap(), at=10.0 + DOWN_HOLD_S / 2)  # in flight when it died: the mark stays
    assert d.state.down_since(0x40) == 10.0
    await d.load(0x40, snap(), at=10.0 + DOWN_HOLD_S)
    assert d.state.down_since(0x40) is None and d.state.snapshot(11.0).instances[0x40].schedulable


async def the_prefill_queue_is_read_from_its_workers_reports(d: Driver) -> None:
    await d.register(0x50, meta(WorkerRole.PREFILL), generate=False)
    await d.register(0x51, meta(WorkerRole.PREFILL), generate=False)
    await d.queue(0x50, PrefillQueueReport(MODEL, 4, 1, 0.5, 1, 0, True), at=2.0)
    await d.queue(0x51, PrefillQueueReport(MODEL, 6, 2, 0.7, 0, 0, False), at=2.05)
    q = d.state.snapshot(2.1).queue(MODEL)
    assert q is not None
    # The freshest reading of the one queue (0x51's), not a sum; both workers alive, one busy.
    assert (q.waiting, q.in_flight, q.prefill_workers, q.busy) == (6, 2, 2, 1)
    # One report each: alive for the queue rule's 1 s; at 3.05 0x51's report is stale too.
    assert d.state.snapshot(3.05).queue(MODEL).prefill_workers == 0
    assert d.state.snapshot(3.05).queue("other") is None


async def a_departed_instance_is_gone_and_its_late_reports_are_ignored(d: Driver) -> None:
    await d.register(0x60, meta())
    await d.load(0x60, snap(), at=1.0)
    await d.status(0x60, WorkerStatus(False, "draining"), at=1.0)
    await d.leave(0x60)
    s = d.state.snapshot(1.1)
    assert 0x60 not in s.instances and s.models() == [] and d.state.has_departed(0x60)
    assert d.state.unschedulable() == {} and d.state.load(0x60) is None
    await d.load(0x60, snap(), at=1.2)  # a report that was on its way
    await d.status(0x60, WorkerStatus(False, "draining"), at=1.2)
    assert d.state.load(0x60) is None and d.state.unschedulable() == {}
    # Registering again makes it a member, with nothing of its past.
    await d.register(0x60, meta())
    inst = d.state.snapshot(1.3).instances[0x60]
    assert (inst.load, inst.schedulable, d.state.has_departed(0x60)) == (None, True, False)


async def a_report_that_overtakes_the_registration_is_kept(d: Driver) -> None:
    await d.load(0x70, snap(kv=0.75), at=3.0)
    assert 0x70 not in d.state.snapshot(3.0).instances
    await d.register(0x70, meta())
    inst = d.state.snapshot(3.1).instances[0x70]
    assert inst.load is not None and inst.load.snapshot.kv_usage == 0.75 and inst.fresh(3.1)


BEHAVIOURS: dict[str, Callable[[Driver], Awaitable[None]]] = {
    f.__name__: f
    for f in (
        an_instance_carries_its_role_domains_and_performance_model,
        loads_go_stale_by_the_one_rule,
        a_status_makes_an_instance_unschedulable_until_it_says_otherwise,
        a_mark_down_holds_until_a_report_one_second_later,
        the_prefill_queue_is_read_from_its_workers_reports,
        a_departed_instance_is_gone_and_its_late_reports_are_ignored,
        a_report_that_overtakes_the_registration_is_kept,
    )
}
